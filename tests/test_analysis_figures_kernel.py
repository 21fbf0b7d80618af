"""kernel_roofline with kernel rows of two GPU models: one roofline panel per GPU, each roof from that GPU's
own measured peaks, on the same axes; at most five series per panel, the legends below the panels."""
from __future__ import annotations

import pandas as pd

from analysis.exhibits.kernel import kernel
from figure_rules import catch, check_all, shared_y, series

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
BACKENDS = ("paged", "dense", "dense_fa2", "contiguous_dense", "granikv", "granikv_cascade", "cascade",
            "cascade_composed", "hydragen", "qkv", "o", "lm_head", "step")


def _rows(gpu: str, tflops: float, tbps: float) -> list[dict]:
    return [{"provenance.gpu_name": gpu, "cell.kind": "decode", "cell.shape.name": "llama3_8b", "cell.prefix_len": lp,
             "cell.batch": 256, "k.backend": b, "time_us_mean": 10.0 + i, "intensity": 4.0 * (i + 1) * lp / 512,
             "tflops": 1.0 + i, "peak_tflops": tflops, "peak_tbps": tbps}
            for i, b in enumerate(BACKENDS) for lp in (512, 8192)]


def test_one_roofline_per_gpu_from_its_own_peaks(tmp_path, monkeypatch):
    t = pd.DataFrame(_rows(H200, 800.0, 4.2) + _rows(H100, 790.0, 3.0))
    caught = catch(monkeypatch, kernel)
    kernel.roofline(t, [], tmp_path)
    fig = caught.figs["kernel_roofline"]
    roofs = [ax for ax in fig.axes if ax.get_xscale() == "log"]
    assert len(roofs) == 2
    assert [ax.get_title().split(":")[0] for ax in roofs] == [H200, H100]     # the primary GPU model first
    assert "4.20 TB/s" in roofs[0].get_title() and "3.00 TB/s" in roofs[1].get_title()
    for ax, bw in zip(roofs, (4.2, 3.0)):     # the roof's slope is that GPU's bandwidth
        roof = next(line for line in ax.get_lines() if line.get_label().startswith("roof"))
        x, y = roof.get_xydata()[0]
        assert abs(y / x - bw) < 1e-9
    assert shared_y(roofs) and len({ax.get_xlim() for ax in roofs}) == 1
    assert all(len(series(ax)) <= 5 for ax in roofs)
    check_all(fig)


def test_one_gpu_one_roofline(tmp_path, monkeypatch):
    caught = catch(monkeypatch, kernel)
    kernel.roofline(pd.DataFrame(_rows(H200, 800.0, 4.2)), [], tmp_path)
    fig = caught.figs["kernel_roofline"]
    assert len([ax for ax in fig.axes if ax.get_xscale() == "log"]) == 1
    check_all(fig)


def test_every_backend_falls_in_one_of_five_families():
    fams = {kernel.family(b) for b in BACKENDS + ("dense_s16", "paged_unique_decode", "gate_up", "new_kernel")}
    assert len(fams) == 5 and kernel.family("paged_unique_decode") == "paged"
    assert kernel.family("contiguous_dense_split") == "dense" and kernel.family("hydragen") == "cascade, hydragen"


def test_rows_without_a_gpu_name_still_draw_their_layout_panel(tmp_path, monkeypatch):
    """CPU runs carry no provenance.gpu_name (tests/test_analysis_runs.py's runner output)."""
    rows = [{k: v for k, v in r.items() if k != "provenance.gpu_name"} for r in _rows(H200, 800.0, 4.2)]
    rows += [{"cell.kind": "layout", "cell.shape.name": "llama3_8b", "cell.prefix_len": 2048, "cell.batch": 256,
              "k.backend": b, "time_us_mean": v} for b, v in (("contiguous_dense", 1.0), ("paged_unique_decode", 9.0))]
    caught = catch(monkeypatch, kernel)
    kernel.roofline(pd.DataFrame(rows), [], tmp_path)
    fig = caught.figs["kernel_roofline"]
    assert fig.axes[0].get_title().startswith("GPU ?") and "GPU ?" in fig.axes[1].get_title()
    check_all(fig)
