"""analysis.measures.admission: a burst's request admitted only after another of the burst had finished is
counted, with the makespan its tail added; warm-up requests and unfinished ones are left out; only single bursts
with one output length are measured; the in-SGLang table and the REPORT's in-SGLang line carry it."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.exhibits.sglang import in_sglang
from analysis.load import Results
from analysis.measures.admission import held_back, is_single_burst, with_held_back
from analysis.report.claims import NUMBER
from analysis.report.sglang import held_back_sentence


def req(first, finish, warmup=False, rid=0):
    return {"rid": rid, "arrival_s": 100.0, "first_token_s": None if first is None else 100.0 + first,
            "finish_s": None if finish is None else 100.0 + finish, "warmup": warmup,
            "output_ids": [1, 2, 3], "token_times_s": [1.0, 2.0, 3.0]}


def write_cell(folder: Path, rows: list[dict], gz: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
            f.write(text)
    else:
        (folder / "requests.jsonl").write_text(text)
    return folder


def test_one_request_held_back_until_the_batch_finished(tmp_path):
    rows = [req(1.0, 4.0), req(1.1, 4.05), req(1.2, 4.1), req(4.2, 5.0)]
    n, tail = held_back(write_cell(tmp_path / "c", rows, gz=True))
    assert n == 1 and tail == pytest.approx(0.9)


def test_no_request_held_back_and_warmup_and_unfinished_left_out(tmp_path):
    # the warm-up request started after the others finished, and one request never got a token: neither counts
    rows = [req(1.0, 4.0), req(1.5, 4.1), req(9.0, 9.5, warmup=True), req(None, None)]
    assert held_back(write_cell(tmp_path / "c", rows)) == (0.0, 0.0)
    assert all(np.isnan(held_back(tmp_path / "missing")))
    assert all(np.isnan(held_back(write_cell(tmp_path / "w", [req(1.0, 2.0, warmup=True)]))))


def test_only_single_bursts_with_one_output_length_are_measured(tmp_path):
    cells = pd.DataFrame([
        {"path": "a", "workload.arrival": "burst", "workload.output_len": 128, "workload.num_requests": None,
         "workload.batch": 256},
        {"path": "b", "workload.arrival": "poisson", "workload.output_len": 128, "workload.num_requests": None,
         "workload.batch": 256},
        {"path": "c", "workload.arrival": "burst", "workload.output_len": 128, "workload.num_requests": 512,
         "workload.batch": 256},
        {"path": "d", "workload.arrival": "burst", "workload.output_len": None, "workload.num_requests": None,
         "workload.batch": 256}])
    assert list(is_single_burst(cells)) == [True, False, False, False]
    for p in "abcd":      # every folder holds a held-back request: only the single burst's is read
        write_cell(tmp_path / p, [req(1.0, 2.0), req(3.0, 4.0)])
    out = with_held_back(cells, tmp_path)
    assert out.loc[0, "held_back"] == 1 and out.loc[0, "held_back_s"] == pytest.approx(2.0)
    assert out.loc[1:, "held_back"].isna().all()


HET = {"model.name": "llama3_8b", "tp": 1, "workload.batch": 256, "profile_steps": 0, "nsys": False,
       "workload.kind": "multiprefix", "workload.num_prefixes": 4, "hardware.name": "a100_40gb",
       "workload.prefix_lens": "[2048, 4096, 8192, 16384]", "workload.prefix_len": 8192,
       "workload.arrival": "burst", "workload.output_len": 128, "workload.num_requests": None}


def test_in_sglang_table_and_report_line_carry_held_back_requests(tmp_path):
    cells = []
    for i, (system, late) in enumerate([("sglang_server", False), ("sglang_server", True),
                                        ("sglang_server_granikv", True)]):
        rows = [req(1.0, 3.0), req(1.2, 3.1)] + ([req(3.2, 4.1)] if late else [])
        write_cell(tmp_path / f"c{i}", rows)
        cells.append({**HET, "system.name": system, "rep": i, "path": f"c{i}",
                      "output_throughput_tok_s": 4000.0 + 1000 * i, "itl_p50_ms": 20.0, "ttft_p50_ms": 1.0})
    res = Results(root=tmp_path, cells=pd.DataFrame(cells), failures=pd.DataFrame(), kernels=pd.DataFrame())
    t = in_sglang.in_sglang_table(res).set_index(["set", "system"])
    assert t.loc[("hetero k=4", "sglang_default"), "held_back"] == pytest.approx(0.5)
    assert t.loc[("hetero k=4", "sglang_default"), "held_back_s"] == pytest.approx(0.5)
    assert t.loc[("hetero k=4", "granikv"), "held_back"] == 1
    frame = pd.DataFrame(cells)
    line = held_back_sentence(res, frame[frame["system.name"] == "sglang_server_granikv"],
                              frame[frame["system.name"] == "sglang_server"], "sglang_server_granikv", "sglang_server")
    assert line.startswith("A request held back until the rest of the burst had finished: every "
                           "sglang_server_granikv cell (+1.00 s each); 1 of 2 sglang_server cells.")
    assert len(NUMBER.findall(line)) <= 3                 # the REPORT's cut keeps a sentence of three numbers
    none = frame[frame["rep"] == 0]
    assert held_back_sentence(res, none, none, "a", "b") == ""
