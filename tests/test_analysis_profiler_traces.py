"""analysis.profiler.graph_traces: a configuration traced with CUDA-graph steps keeps those traces only (its
eager-step traces feed the distance-to-limit split), one traced only eagerly keeps its own."""
from __future__ import annotations
import pandas as pd

from analysis.exhibits.kernel.profiler import at_b3_point, graph_traces


def test_eager_traces_drop_only_where_a_graph_trace_exists():
    tf = pd.DataFrame({"config": ["a"] * 3 + ["cpu"], "system": ["granikv"] * 4,
                       "workload.prefix_len": [16384, 16384, 8192, 64], "workload.batch": [256, 256, 256, 4],
                       "hardware.cuda_graph_max_bs": [256, 0, 0, 0]})
    got = graph_traces(tf)
    assert list(zip(got["workload.prefix_len"], got["hardware.cuda_graph_max_bs"])) == [(16384, 256), (8192, 0), (64, 0)]
    assert list(at_b3_point(got)["workload.prefix_len"]) == [8192]
