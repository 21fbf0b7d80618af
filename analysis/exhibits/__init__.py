"""Every table and figure of the reproduction, one module each, grouped by the part of the paper they
reproduce. Importing this package registers them all (analysis.registry), in the order below, which is
the order of the tables and figures in the REPORT; an exhibit never imports another. ``exhibits`` and
``chapter_lines`` are analysis.registry's, handed on here so that whoever walks the registry has it filled."""
from analysis.exhibits.headline import headline
from analysis.exhibits.sglang import engine_fidelity, in_sglang, in_sglang_paths, in_sglang_steps
from analysis.exhibits.headline import headline_steps, prefill_host, prefill_host_ops
from analysis.exhibits.grid import grid, sharegpt_matrix
from analysis.exhibits.multiprefix import multiprefix
from analysis.exhibits.kernel import kernel, kernel_breakdown, plan_host
from analysis.exhibits.dispatch import multiclass
from analysis.exhibits.kernel import prefix_kernel, amdahl
from analysis.exhibits.dispatch import dispatch_routing, dispatch_regret, dispatch_overhead
from analysis.exhibits.kernel import profiler
from analysis.exhibits.headline import limitation
from analysis.exhibits.kernel import gemm_floor, distance_to_limit, hot_batch, graph_step
from analysis.exhibits.beyond import beyond, beyond_steps, beyond_plan
from analysis.exhibits.campaign import coverage, reruns, claim_map
from analysis.registry import chapter_lines, exhibits

__all__ = ["chapter_lines", "exhibits", "headline", "engine_fidelity", "in_sglang", "in_sglang_paths", "in_sglang_steps", "headline_steps", "prefill_host", "prefill_host_ops", "grid",
           "sharegpt_matrix", "multiprefix", "kernel", "kernel_breakdown", "plan_host", "multiclass", "prefix_kernel",
           "amdahl", "dispatch_routing", "dispatch_regret", "dispatch_overhead", "profiler", "limitation", "gemm_floor",
           "distance_to_limit", "hot_batch", "graph_step", "beyond", "beyond_steps", "beyond_plan", "coverage", "reruns", "claim_map"]
