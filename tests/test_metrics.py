"""Serving metrics against hand-computed examples (vLLM / SGLang definitions)."""
from __future__ import annotations
import pytest

from granikv.metrics import dispatch_counts, summarize
from granikv.rawio import SERVING_METRICS
from granikv.request import RequestRecord


def rec(rid, arrival, times, prompt=10, warmup=False):
    return RequestRecord(rid=rid, arrival_s=arrival, prompt_len=prompt, output_ids=list(range(len(times))),
                         token_times_s=times, warmup=warmup)


def test_keys_are_the_schema():
    m = summarize([rec(0, 0.0, [0.1, 0.2])])
    assert set(SERVING_METRICS) <= set(m)


def test_single_request():
    # arrival 1.0; tokens at 1.5, 1.6, 1.8, 2.1 -> TTFT 500, E2E 1100, TPOT (1100-500)/3 = 200,
    # ITL 100, 200, 300
    m = summarize([rec(0, 1.0, [1.5, 1.6, 1.8, 2.1], prompt=7)])
    assert m["num_requests"] == 1 and m["num_input_tokens"] == 7 and m["num_output_tokens"] == 4
    assert m["duration_s"] == pytest.approx(1.1)
    assert m["ttft_mean_ms"] == pytest.approx(500) and m["ttft_p99_ms"] == pytest.approx(500)
    assert m["e2e_p50_ms"] == pytest.approx(1100)
    assert m["tpot_mean_ms"] == pytest.approx(200)
    assert m["itl_mean_ms"] == pytest.approx(200)
    assert m["itl_p50_ms"] == pytest.approx(200)
    assert m["itl_p90_ms"] == pytest.approx(280)   # linear interpolation over [100, 200, 300]
    assert m["output_throughput_tok_s"] == pytest.approx(4 / 1.1)
    assert m["total_throughput_tok_s"] == pytest.approx(11 / 1.1)
    assert m["request_throughput_req_s"] == pytest.approx(1 / 1.1)


def test_one_token_outputs_have_no_tpot_or_itl():
    m = summarize([rec(0, 0.0, [0.2]), rec(1, 0.0, [0.4])])
    assert m["ttft_mean_ms"] == pytest.approx(300) and m["ttft_p50_ms"] == pytest.approx(300)
    assert m["e2e_mean_ms"] == pytest.approx(300)
    for s in ("mean", "p50", "p90", "p99"):
        assert m[f"tpot_{s}_ms"] is None and m[f"itl_{s}_ms"] is None
    assert m["output_throughput_tok_s"] == pytest.approx(2 / 0.4)


def test_no_requests():
    m = summarize([])
    assert m["num_requests"] == 0 and m["num_output_tokens"] == 0
    assert m["duration_s"] is None and m["output_throughput_tok_s"] is None
    assert m["ttft_mean_ms"] is None and m["dispatch_counts"] == {}


def test_pooled_itl_tpot_per_request_and_warmup_excluded():
    recs = [rec(0, 0.0, [1.0, 2.0, 3.0]),      # TTFT 1000, TPOT 1000, ITL 1000 1000
            rec(1, 1.0, [1.5, 1.6]),           # TTFT 500,  TPOT 100,  ITL 100
            rec(9, 0.0, [50.0, 99.0], warmup=True)]
    m = summarize(recs)
    assert m["num_requests"] == 2 and m["num_warmup_requests"] == 1
    assert m["tpot_mean_ms"] == pytest.approx(550)           # mean of per-request TPOTs
    assert m["itl_mean_ms"] == pytest.approx(700)            # pooled gaps (1000+1000+100)/3
    assert m["ttft_p50_ms"] == pytest.approx(750)
    assert m["duration_s"] == pytest.approx(3.0)              # last finish - first arrival
    assert m["output_throughput_tok_s"] == pytest.approx(5 / 3.0)


def test_warmup_count_from_engine_stats():
    """The engine returns no warm-up records; its stats say how many warm-up requests it served."""
    recs = [rec(0, 0.0, [1.0, 2.0])]
    assert summarize(recs)["num_warmup_requests"] == 0
    m = summarize(recs, [], {"warmup": {"requests": 3, "steps": 5, "duration_s": 0.1}})
    assert m["num_warmup_requests"] == 3 and m["num_requests"] == 1
    assert summarize(recs, [], {"dispatch_counts": {}})["num_warmup_requests"] == 0


def test_dispatch_counts_forms():
    steps = [{"decisions": [{"backend": "dense"}, {"backend": "cascade"}]}, {"decisions": []},
             {"backend": "dense"}, {"backends": {"0": "cascade"}}, {"kind": "prefill"}]
    assert dispatch_counts(steps) == {"cascade": 2, "dense": 2}


def test_missing_token_times_is_an_error():
    with pytest.raises(ValueError, match="request 3"):
        summarize([rec(3, 0.0, [])])
