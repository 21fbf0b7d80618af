"""``python -m analysis.reproduce [--results results/raw] [--out results] [--only tables|figures]``

Loads every cell under ``--results`` (schema-checked), runs every table / figure module into
``--out``/tables and ``--out``/figures, writes the campaign's coverage (``analysis.coverage``) and
``--out``/REPORT.md (claim by claim).
``--only tables``: tables and the report, no figures; ``--only figures``: the modules with their
figures (and the tables they are drawn from), no report. The claim map (``analysis.claim_map``) is
written with the report.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis import (amdahl, beyond, beyond_plan, beyond_steps, claim_map, coverage, dispatch_overhead, dispatch_regret, dispatch_routing, distance_to_limit, engine_fidelity, gemm_floor,
                      grid, headline, headline_steps, in_sglang, kernel, kernel_breakdown, limitation, multiclass,
                      multiprefix, plan_host, prefill_host, prefix_kernel, prefill_host_ops, profiler, reruns, sharegpt_matrix)
from analysis.clean import prefer_clean, prefer_rerun
from analysis.load import load_results

MODULES = (headline, engine_fidelity, in_sglang, headline_steps, prefill_host, prefill_host_ops, grid, sharegpt_matrix, multiprefix, kernel,
           kernel_breakdown, plan_host, multiclass, prefix_kernel, amdahl, dispatch_routing, dispatch_regret, dispatch_overhead, profiler, limitation, gemm_floor, distance_to_limit, beyond,
           beyond_steps, beyond_plan)


def run(results: str | Path = "results/raw", out: str | Path = "results", only: str | None = None) -> dict:
    """Regenerate everything; returns {"tables": [...], "figures": [...], "claims": DataFrame | None}."""
    out = Path(out)
    res = prefer_clean(prefer_rerun(load_results(results)))
    for m in MODULES:
        m.build(res, out, figures=only != "tables")
    coverage.build(res, out)   # bookkeeping, not a paper table: the campaign's cells against the raw results
    reruns.build(res, out)     # bookkeeping too: superseded configurations, before and after
    tables = [m.NAME for m in MODULES] + list(coverage.TABLES) + [reruns.NAME]
    figs = [f for m in MODULES for f in m.FIGURES]
    ev = None
    if only != "figures":
        from analysis.report import write_report
        tables += list(claim_map.TABLES)
        ev = write_report(res, out, tables + ["claims"], figs)
        claim_map.build(res, out, ev=ev)   # claim -> experiment -> command -> GPUs -> time -> output
    return {"tables": tables, "figures": figs, "claims": ev, "results": res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.reproduce", description=__doc__.split("\n\n")[1])
    ap.add_argument("--results", default="results/raw", help="raw results folder (default results/raw)")
    ap.add_argument("--out", default="results", help="where tables/, figures/ and REPORT.md go (default results)")
    ap.add_argument("--only", choices=("tables", "figures"), default=None)
    a = ap.parse_args(argv)
    if Path(a.results).exists() and not Path(a.results).is_dir():
        ap.error(f"--results {a.results} is not a folder (give the raw results root, e.g. results/raw)")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        ap.error(f"--out {a.out} is not a folder")
    if not Path(a.results).exists():
        print(f"note: {a.results} does not exist yet: every cell is reported as not measured", file=sys.stderr)
    t0 = time.perf_counter()
    r = run(a.results, a.out, a.only)
    res = r["results"]
    print(f"analysis: {len(res.cells) + len(res.set_aside)} cells ({len(res.set_aside)} set aside), "
          f"{len(res.failures)} failed/unfinished, {len(res.kernels)} kernel rows from {a.results}")
    print(f"wrote {len(r['tables'])} tables to {Path(a.out) / 'tables'}" +
          (f", {len(r['figures'])} figures to {Path(a.out) / 'figures'}" if a.only != "tables" else ""))
    if r["claims"] is not None:
        v = r["claims"]["verdict"].value_counts()
        print(f"wrote {Path(a.out) / 'REPORT.md'}: " + ", ".join(f"{n} {k}" for k, n in sorted(v.items())))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
