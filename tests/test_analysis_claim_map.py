"""analysis/claim_map.py on hand-built plans and cells: which experiment a claim maps to (plain cells,
profiled cells, both for an Amdahl claim, the dispatcher sweep for a step-trace claim, none from the
campaign for a kernel claim), and a bench's command and time from its cells' own config."""
from __future__ import annotations
from pathlib import Path
import pandas as pd
import pytest

from analysis.exhibits.campaign import claim_map
from analysis.common import with_derived
from analysis.load import Results


def _planned() -> pd.DataFrame:
    rows = []
    for item, sweep, kind, lp, prof, systems in (
            ("grid", "synthetic_grid_m", "synthetic", 8192, 0, ("granikv", "sglang_default")),
            ("prof", "profiler_m", "synthetic", 8192, 20, ("granikv", "sglang_default")),
            ("disp", "dispatch_overhead_m", "synthetic", 16384, 0, ("granikv",)),
            ("head", "headline_m", "sharegpt", 16384, 0, ("granikv", "sglang_default"))):
        for s in systems:
            rows.append({"item": item, "sweep": sweep, "kind": "serving", "workload.kind": kind, "model.name": "m",
                         "tp": 1, "workload.prefix_len": lp, "workload.batch": 256, "workload.num_prefixes": 1,
                         "system.name": s, "profile_steps": prof, "nsys": False, "_identity": {}})
    return with_derived(pd.DataFrame(rows))


def _claim(frame="cells", statistic="ratio", selectors="", baseline="system.name=sglang_default") -> pd.Series:
    return pd.Series({"frame": frame, "statistic": statistic, "baseline": baseline,
                      "selectors": selectors or "workload.kind=synthetic;workload.prefix_len=8192;model.name=m;"
                                                "system.name=granikv"})


@pytest.mark.parametrize("claim,want", [
    (_claim(), ["grid"]),                                                       # plain cells only
    (_claim(frame="trace", statistic="trace_speedup"), ["prof"]),               # profiled cells only
    (_claim(statistic="amdahl_overshoot"), ["grid", "prof"]),                   # the plain pair and the profile
    (_claim(frame="steps", statistic="overhead_cpu_us", selectors="system.name=granikv;dispatch_from=steps.jsonl",
            baseline=""), ["disp"]),                                            # the sweep made for it
    (_claim(frame="kernels", statistic="kernel_speedup"), []),                  # a bench, not a campaign item
    (_claim(selectors="workload.kind=sharegpt;model.name=m;system.name=granikv"), ["head"]),
    (_claim(selectors="workload.kind=sharegpt;model.name=other;system.name=granikv"), []),
])
def test_a_claim_maps_to_the_items_whose_planned_cells_it_reads(claim, want):
    assert claim_map.claim_items(claim, _planned()) == want


def test_a_bench_row_takes_its_command_and_time_from_its_cells():
    cells = pd.DataFrame([{"sweep": "engine_bench_x", "path": f"engine_bench_x/{s}", "kind": "serving",
                           "system.name": s, "duration_s": 10.0, "warmup.duration_s": 5.0, "bench.model": "qwen25_14b",
                           "bench.tp": 2.0, "bench.hardware": "h200", "bench.prefix_len": 8192.0, "bench.batch": 256.0,
                           "bench.output_len": 128.0, "bench.out": "results/raw/engine_bench_x"}
                          for s in ("granikv", "sglang_default")])
    res = Results(root=Path("/nonexistent"), cells=cells, failures=pd.DataFrame(), kernels=pd.DataFrame())
    row = claim_map.bench_row(res, None, "engine_bench_x")
    assert row["command"] == ("torchrun --standalone --nproc_per_node=2 -m runners.engine_bench --model qwen25_14b "
                              "--hardware h200 --prefix-len 8192 --batch 256 --output-len 128 "
                              "--out results/raw/engine_bench_x")
    assert row["gpus"] == 2 and row["cells"] == 2 and row["gpu_time_min"] == pytest.approx(30.0 / 60)
    assert row["time_note"] == "measured" and row["raw"] == "results/raw/engine_bench_x/"
