"""Distance to the hardware limit (issue 29): each system's full-batch decode step at the headline and
synthetic-grid cells as a multiple of the step's limit on its GPU, and where it goes (profiler).

Per row (table headline | grid, config, Lp, B, system, GPU; repetitions averaged):

- ``step_ms``: the measured full-batch decode step, ``decode_full_p50_ms`` of
  ``analysis.headline_steps.cell_steps`` (p50 of the decode steps with batch >= 90% of B, steps.jsonl;
  uninstrumented cells only).
- ``gemm_floor_ms``: the GEMM floor of that step, measured by ``python -m runners.kernel_bench_gemm_floor``
  (cells ``<model>-tp<tp>-m<M>``, row ``backend=step``: every weight GEMM of one decode step of one TP
  shard, QKV + O + gate/up + down per layer x layers + LM head, as one CUDA graph), at M = B, for the
  row's model, TP degree and GPU (``provenance.gpu_name`` equal). CPU cells (``cell.device=cpu``) and
  eager timings (``graph`` false) are never used. Where no such cell exists the entry says
  ``not measured``: no number is estimated in its place.
- ``attn_roofline_ms``: the attention limit of the best possible system at that Lp and B, per TP rank::

      bytes_kv  = 2 * (Lp + B * s) * (Hkv / tp) * D * e     K and V: the shared prefix once, plus every
                                                            request's own suffix KV, once
      flops     = 4 * (Hq / tp) * D * B * (Lp + s)          QK^T and PV over each request's whole context
      attn_roofline_ms = L * max(bytes_kv / BW, flops / PEAK) * 1e3

  with L layers, Hq / Hkv / D the model's query heads, KV heads and head dim, e the KV element size
  (2 bytes for bf16), and ``s`` the mean suffix KV length of a decode step's requests, weighted by
  decode tokens: ``s = sum_r (o_r - 1) * (p_r - Lp_r + o_r / 2) / sum_r (o_r - 1)`` over the cell's
  requests (workload.jsonl: prompt length p_r, shared prefix length Lp_r, output length o_r; the
  decode step that produces token j of a request reads p_r + j - 1 KV rows, j = 2..o_r). PEAK and BW
  are the cell's ``hardware.peak_tflops`` / ``peak_tbps`` when set (> 0), else the GPU vendor's
  datasheet values in ``VENDOR_PEAKS`` (H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e; H100 SXM: 3.35 TB/s HBM3).
  ``attn_bound`` says which of the two terms is larger. It is a model of the hardware, not a
  measurement; Q / O traffic and the all-reduce of TP > 1 are not in it.
- ``limit_ms = gemm_floor_ms + attn_roofline_ms`` and ``multiple = step_ms / limit_ms`` (1 = at the limit).
  The limit is taken at the configured B, while the p50 full-batch step may hold 0.9 B..B requests:
  the limit of a smaller batch is no larger, so the multiple is never overstated.

Breakdown (``prof_*``, ms per decode step), from a torch.profiler trace of the same configuration:
the analysis expects ``<cell>/trace.json.gz`` (or ``trace.json``) of a serving cell run with
``profile_steps > 0`` (e.g. ``python -m runners.run sweep=profiler workload.prefix_len=16384``), whose
steps are marked by ``decode_step`` GPU annotations (``gpu_user_annotation``, as the engine writes
them). Kernels inside the steps are summed per class: ``prof_gemm_ms`` (cuBLAS / nvjet / CUTLASS GEMMs),
``prof_attention_ms`` (FlashInfer decode / prefill / merge kernels: prefix + suffix + merge),
``prof_prefix_attn_ms`` and ``prof_suffix_merge_ms`` (the attention kernels inside / outside
``prefix_attention*`` annotations; ``not measured`` when the trace has none: kernel names alone do not
tell a prefix from a suffix. The engine's FlashInfer path marks each prefix call it launches eagerly
(granikv.attention.gpu_paths.prefix_mark); a replayed CUDA graph carries no range inside it, so the
split needs a trace of eager steps: ``hardware.cuda_graph_max_bs=0``), ``prof_other_ms`` (norms, RoPE, activation, sampling, copies), and
``prof_host_gap_ms`` = the step period (start to start of consecutive steps) minus the time some
kernel ran (GPU idle: the host's share). Profiled cells are instrumented runs of their own; their
breakdown stands beside the uninstrumented step time, it is not subtracted from it. A configuration
without such a trace says ``not measured``.

Writes tables/distance_to_limit.{csv,md} and figures/distance_to_limit.{png,pdf} (multiple vs Lp, headline).
"""
from __future__ import annotations

from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (GRID_B, GRID_CELLS, HEADLINE_CELLS, LPS, NOT_MEASURED, PAPER_CONFIG_LABELS,
                             placeholder_figure, select, sort_rows, with_derived, write_table)
from analysis.load import Results
from analysis.measures.limit import FLOOR_CMD, PROF, breakdown_of, cell_row, gemm_floors, profiled
from analysis.plots import gpu_names, lines_vs
from analysis.registry import register_exhibit
from granikv.config import SYSTEMS

NAME = "distance_to_limit"
FIGURES = (NAME,)
# the two grids of rows: (table, sweep folder prefix, selection, workload kind, expected Lp, expected B): the headline sweeps
# (headline_<model>_tp<tp>) and the synthetic grid (synthetic_grid_<model>_tp<tp>); other sweeps whose
# cells match the selection (sharegpt_matrix, limitation, dispatch_trace, runners.engine_bench, ...) are
# not these tables' cells
SOURCES = (("headline", "headline_", HEADLINE_CELLS, "sharegpt", LPS, (256,)),
           ("grid", "synthetic_grid_", GRID_CELLS, "synthetic", LPS, GRID_B))
# sweep: cells of two sweep folders (another runner, e.g. runners.engine_bench, or a rerun) are never pooled
KEYS = ["table", "config", "workload.prefix_len", "workload.batch", "system", "gpu", "sweep"]
VALUES = ["step_ms", "suffix_kv_mean", "gemm_floor_ms", "attn_roofline_ms", "attn_bound", "limit_ms", "multiple"]
DIGITS = {"step_ms": 2, "suffix_kv_mean": 1, "gemm_floor_ms": 3, "attn_roofline_ms": 3, "limit_ms": 3, "multiple": 2,
          **{c: 3 for c in PROF}}


# ---- the limit ----------------------------------------------------------------------------------------


# ---- the profiler breakdown -----------------------------------------------------------------------------


# ---- the table ------------------------------------------------------------------------------------------


def frame(res: Results) -> pd.DataFrame:
    """Every expected row of both grids (plus measured rows outside them), numbers as floats (NaN where
    not measured) and ``status``."""
    floors, prof = gemm_floors(res), profiled(res)
    rows, seen = [], set()
    base = with_derived(res.cells)
    for table, sweep, sel, kind, lps, bs in SOURCES:
        cells = select(base, {**sel, "instrumented": "=False", "kind": "=serving"}) if not base.empty else base
        if not cells.empty:
            cells = cells[cells["system"].isin(SYSTEMS) & cells["sweep"].astype(str).str.startswith(sweep)]
        per = [{"table": table, "sweep": c["sweep"], "config": c["config"], "workload.prefix_len": int(c["workload.prefix_len"]),
                "workload.batch": int(c["workload.batch"]), "system": c["system"], "workload.kind": kind,
                **cell_row(res, c, floors)} for _, c in cells.iterrows()]
        if per:
            d = pd.DataFrame(per)
            for col in VALUES:
                if col not in d.columns:
                    d[col] = np.nan
            g = d.groupby(KEYS, sort=True, dropna=False)
            agg = g[["step_ms", "suffix_kv_mean", "gemm_floor_ms", "attn_roofline_ms"]].mean()
            agg["n"] = g.size()
            agg["attn_bound"] = g["attn_bound"].agg(lambda v: ",".join(sorted({x for x in v if isinstance(x, str)})))
            agg["why"] = g["why"].agg(lambda v: next((x for x in v if isinstance(x, str)), None))
            agg = agg.reset_index()
            agg["limit_ms"] = agg["gemm_floor_ms"] + agg["attn_roofline_ms"]
            agg["multiple"] = agg["step_ms"] / agg["limit_ms"]
            for r in agg.to_dict("records"):
                r["status"] = "measured" if np.isfinite(r["multiple"]) else \
                    f"{NOT_MEASURED}: {r['why'] or 'no full-batch decode step'}"
                mine = cells[(cells["sweep"] == r["sweep"]) & (cells["config"] == r["config"])
                             & (cells["system"] == r["system"]) & (cells["workload.prefix_len"] == r["workload.prefix_len"])
                             & (cells["workload.batch"] == r["workload.batch"])]
                r.update(breakdown_of(prof, {**r, "workload.kind": kind}, mine))
                rows.append(r)
                seen.add((table, r["config"], r["workload.prefix_len"], r["workload.batch"], r["system"]))
        for cfg, lp, b, s in product(PAPER_CONFIG_LABELS, lps, bs, SYSTEMS):
            if (table, cfg, lp, b, s) not in seen:
                r = {"table": table, "config": cfg, "workload.prefix_len": lp, "workload.batch": b, "system": s,
                     "n": 0, "status": NOT_MEASURED}
                r.update(breakdown_of(prof, {**r, "workload.kind": kind}, None))
                rows.append(r)
    cols = KEYS + ["n"] + VALUES + PROF + ["prof_source", "status"]
    return sort_rows(pd.DataFrame(rows, columns=cols), KEYS)


def shown(t: pd.DataFrame) -> pd.DataFrame:
    """The table as written: every missing value of a measured or derived column says ``not measured``."""
    out = t.copy()
    for col in VALUES + PROF + ["prof_source"]:
        out[col] = out[col].astype(object).where(out[col].notna() & (out[col] != ""), NOT_MEASURED)
    out["gpu"] = out["gpu"].astype(object).where(out["gpu"].notna(), "")
    return out.rename(columns={"workload.prefix_len": "Lp", "workload.batch": "B"})


NOTE = ("step_ms: p50 full-batch decode step (batch >= 90% of B, steps.jsonl; repetitions averaged). "
        "multiple = step_ms / limit_ms, limit_ms = gemm_floor_ms + attn_roofline_ms. gemm_floor_ms: every weight GEMM "
        "of one decode step of one TP shard (QKV, O, gate+up, down x layers + LM head) at M = B, one CUDA graph, "
        f"measured on the row's GPU ({FLOOR_CMD}; 'not measured' until those cells exist). attn_roofline_ms = "
        "L x max(bytes_kv / BW, flops / PEAK) per TP rank, bytes_kv = 2 (K,V) x (Lp + B x s) x Hkv/tp x D x 2 B "
        "(the shared prefix read once plus every request's own suffix), flops = 4 x Hq/tp x D x B x (Lp + s), "
        "s = suffix_kv_mean (decode-token-weighted mean suffix KV length of the cell's requests); PEAK / BW: "
        "hardware.peak_* when set, else the vendor's datasheet (H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s; H100 SXM: 989, 3.35 TB/s); "
        "all-reduce and Q/O traffic not included. prof_*: ms per decode step from a torch.profiler trace of the "
        "same configuration (an instrumented run; prefix/suffix split only where the trace marks prefix_attention), "
        "prof_host_gap_ms: step period minus GPU busy time.")


def _span(v: pd.Series) -> str:
    lo, hi = f"{v.min():.2f}", f"{v.max():.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


def lines(t: pd.DataFrame) -> list[str]:
    """The REPORT's lines on the rows with a profiler breakdown: step, limit and where the step goes."""
    if t.empty:
        return []
    m = t[(t["status"] == "measured") & t["prof_gemm_ms"].notna()]
    if m.empty:
        return [f"- Profiler breakdown: {NOT_MEASURED} (no torch.profiler trace matches a measured row)."]
    L = ["Full-batch decode step over its limit (GEMM floor + attention roofline), and where a profiled step of "
         "the same configuration goes, ms per step (tables/distance_to_limit.md; prefix / suffix split from "
         "eager-step traces where present):", "",
         "| config | Lp | B | system | step | limit | multiple | GEMMs | attention | prefix attn | suffix + merge | other | host gap |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, nd=2):
        return NOT_MEASURED if pd.isna(v) else f"{v:.{nd}f}"
    for _, r in m.iterrows():
        L.append(f"| {r['config']} | {int(r['workload.prefix_len'])} | {int(r['workload.batch'])} | {r['system']} | "
                 f"{f(r['step_ms'])} | {f(r['limit_ms'])} | {f(r['multiple'])} | {f(r['prof_gemm_ms'])} | {f(r['prof_attention_ms'])} | "
                 f"{f(r['prof_prefix_attn_ms'])} | {f(r['prof_suffix_merge_ms'])} | {f(r['prof_other_ms'])} | "
                 f"{f(r['prof_host_gap_ms'])} |")
    under = m[m["prof_gemm_ms"] < m["gemm_floor_ms"]]
    if not under.empty:
        L += ["", f"In {len(under)} of these rows the GEMM kernels of a profiled step take less time than the GEMM floor "
                  f"timed alone ({_span(under['prof_gemm_ms'])} ms against {_span(under['gemm_floor_ms'])} ms): "
                  "there the floor is not a "
                  "lower bound, and the multiple understates the distance to the hardware."]
    return L


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return lines(frame(res))


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=1, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/distance_to_limit.{csv,md} (and the figure unless ``figures`` is False); return the table."""
    t = frame(res)
    text = shown(t)
    # every column given a precision: write_table's integer check per value is slow on wide tables
    digits = {**{c: 0 for c in text.columns}, **DIGITS}
    write_table(text, NAME, out, digits, title="Distance to the hardware limit: full-batch decode step / "
                "(GEMM floor + attention roofline)", note=NOTE)
    if not figures:
        return text
    m = t[(t["table"] == "headline") & (t["status"] == "measured")]
    if m.empty:
        placeholder_figure(NAME, out, "no headline cell with a measured GEMM floor (gemm_floor cells not measured)")
        return text
    lines_vs(m.assign(multiple=m["multiple"].astype(float)), NAME, out, "workload.prefix_len", ["config"],
             value="multiple", ylabel="decode step / (GEMM floor + attention roofline)", hline=1.0,
             gpu=gpu_names(select(res.cells, HEADLINE_CELLS)),
             title="Headline (B=256): full-batch decode step over its hardware limit")
    return text
