"""analysis.exhibits.kernel.hot_batch: one row per GPU model and case of runners.hot_batch_bench cells (measured
here on CPU with the FlashInfer stand-in), never pooling two GPU models; the generic kernel table leaves them out."""
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import fake_flashinfer
from analysis.exhibits.kernel import hot_batch as hb
from analysis.load import load_results
from granikv import rawio
from granikv.config import register
from runners import hot_batch_bench as hbb

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture()
def two_gpu_cells(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    register()
    real = rawio.provenance
    for gpu, sweep in (("GPU A", "hot_batch_a"), ("GPU B", "hot_batch_b")):
        monkeypatch.setattr(hbb.rawio, "provenance", lambda g=gpu, **kw: {**real(**kw), "gpu_name": g})
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose("hot_batch_bench", overrides=[f"results_dir={tmp_path}", f"sweep_name={sweep}"])
        assert hbb.run(hbb.resolve(cfg))["done"] == ["lp64", "hetero_k3"]
    return tmp_path


def test_one_row_per_gpu_and_case_with_the_fastest_batched_variant(two_gpu_cells, tmp_path):
    res = load_results(two_gpu_cells)
    t = hb.frame(res)
    assert sorted(zip(t["gpu"], t["case"])) == [("GPU A", "hetero_k3"), ("GPU A", "lp64"), ("GPU B", "hetero_k3"),
                                                ("GPU B", "lp64")]
    k = res.kernels
    for _, r in t.iterrows():
        rows = k[(k["provenance.gpu_name"] == r["gpu"]) & (k["cell.cell_id"] == r["case"])]
        batched = rows[rows["k.backend"] != "per_group"]
        assert r["best_us"] == pytest.approx(1e3 * batched["k.time_ms"].min())
        assert r["ratio"] == pytest.approx(r["best_us"] / r["per_group_us"])
    assert set(t.loc[t["case"] == "hetero_k3", "prefix_lens"]) == {"32/64/128"}
    hb.build(res, tmp_path / "out")
    assert "GPU A" in (tmp_path / "out" / "tables" / "hot_batch.md").read_text()


def test_the_generic_kernel_table_leaves_hot_batch_cells_to_their_exhibit(two_gpu_cells, tmp_path):
    from analysis.exhibits.kernel import kernel

    t = kernel.build(load_results(two_gpu_cells), tmp_path / "out", figures=False)
    assert "hot_batch" not in set(t.get("cell.kind", []))
