"""Workloads: seeded request traces (synthetic grid, ShareGPT, multi-prefix) and arrivals.

``build(cfg)`` turns a RunConfig into ``list[Request]``; ``trace_rows`` is what a cell saves
as ``workload.jsonl``. Token ids are not stored: they are regenerated exactly from
(``seed``, ``workload``, ``model.vocab_size``), and each row carries ``prompt_sha1`` so a
regenerated trace can be checked against the saved one.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

from granikv.config import RunConfig
from granikv.request import Request
from granikv.workloads.multiprefix import class_lengths, multiprefix_requests
from granikv.workloads.sharegpt import load_lengths, sharegpt_requests
from granikv.workloads.synthetic import synthetic_requests

BUILDERS = {"synthetic": synthetic_requests, "sharegpt": sharegpt_requests, "multiprefix": multiprefix_requests}


def build(cfg: RunConfig) -> list[Request]:
    """The cell's request trace (deterministic in cfg.seed)."""
    w = cfg.workload
    if w.kind not in BUILDERS:
        raise ValueError(f"config error at `workload.kind`: '{w.kind}' not in {sorted(BUILDERS)}")
    return BUILDERS[w.kind](w, cfg.model.vocab_size, cfg.seed)


def longest_request(cfg: RunConfig) -> tuple[int, int]:
    """(prompt_len, output_len) of the workload's longest request, without building it."""
    w = cfg.workload
    if w.kind == "sharegpt":
        p, o = max(load_lengths(w.sharegpt_lengths), key=lambda x: x[0] + x[1])
        return w.prefix_len + p, o
    return max(class_lengths(w)) + w.suffix_len, w.output_len


def prompt_sha1(ids: list[int]) -> str:
    """Short fingerprint of a prompt's token ids."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def trace_rows(requests: list[Request]) -> list[dict]:
    """One row per request for ``workload.jsonl``."""
    return [{"rid": r.rid, "arrival_s": r.arrival_s, "prompt_len": len(r.prompt_ids),
             "shared_len": r.shared_len, "prefix_class": r.prefix_class,
             "output_len": r.output_len, "prompt_sha1": prompt_sha1(r.prompt_ids)}
            for r in requests]


def warmup_requests(requests: list[Request], n: int, max_len: int | None = None) -> list[Request]:
    """The warm-up pass: the first ``n`` requests (prompts and prefixes as measured), all at t=0, with
    staggered output lengths n+1, n, ..., 2 (the first token comes from prefill): the decode batch is
    n, n-1, ..., 1, one request finishing per step, so one pass of n steps JIT-compiles the kernels and captures the CUDA graph of every padded batch
    size (and single-class dispatch choice) the measured run can meet, instead of replaying the
    workload's long tail (a ShareGPT tail runs ~1,800 steps at tiny batch)."""
    base = requests[:n]
    cap = (lambda r: max_len - len(r.prompt_ids)) if max_len else (lambda r: len(base) + 1)
    return [replace(r, arrival_s=0.0, output_len=max(1, min(len(base) + 1 - i, cap(r)))) for i, r in enumerate(base)]
