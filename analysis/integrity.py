"""A serving cell's metrics.json against its own requests.jsonl, and cells whose requests are one run.

granikv.metrics.summarize defines a cell's numbers from its request records, warm-up records excluded:
``num_requests`` and ``num_output_tokens`` count them, ``duration_s`` = last finish - first arrival and
``output_throughput_tok_s`` = output tokens / duration. :func:`check_summary` recomputes them from the
records and raises SchemaError naming the cell and the field where metrics.json disagrees (counts exactly,
duration and throughput within :data:`REL_TOL`). :func:`request_digest` fingerprints a cell's request
records; :func:`check_duplicates` raises where two cells hold the same records (a copy of one run under
another folder or repetition number is not a second measurement).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from granikv.rawio import SchemaError

REL_TOL = 0.01     # duration and output throughput: metrics.json within 1% of what the records give

FIX = ("metrics.json must be what granikv.metrics.summarize computes from the cell's requests.jsonl: rerun the "
       "cell (force=true) or move the folder out of the results tree; never edit raw results by hand")


def summary_of(rows: list[dict]) -> dict:
    """The counts, duration and output throughput granikv.metrics.summarize gives for these records
    (``output_len`` per record: the number of tokens it generated)."""
    recs = [r for r in rows if not r.get("warmup")]
    n_out = sum(int(r.get("output_len") or 0) for r in recs)
    dur = (max(float(r["finish_s"]) for r in recs) - min(float(r["arrival_s"]) for r in recs)) if recs else None
    return {"num_requests": len(recs), "num_output_tokens": n_out, "duration_s": dur,
            "output_throughput_tok_s": n_out / dur if dur else None}


def check_summary(cell: Path, metrics: dict, rows: list[dict]) -> None:
    """Raise SchemaError (naming ``cell``'s metrics.json, the field and both values) where metrics.json
    disagrees with the summary of its request records."""
    need = ("finish_s", "arrival_s", "output_len")
    for i, r in enumerate(rows, 1):
        if not all(k in r for k in need):
            raise SchemaError(f"{cell / 'requests.jsonl'}: line {i} lacks one of {need}. Fix: {FIX}")
    ours = summary_of(rows)
    for k in ("num_requests", "num_output_tokens"):
        if metrics.get(k) != ours[k]:
            raise SchemaError(f"{cell / 'metrics.json'}: field `{k}` is {metrics.get(k)!r}, but requests.jsonl "
                              f"holds {ours[k]} (warm-up records excluded). Fix: {FIX}")
    for k in ("duration_s", "output_throughput_tok_s"):
        got, want = metrics.get(k), ours[k]
        if want is None and got is None:
            continue
        if got is None or want is None or abs(float(got) - want) > REL_TOL * abs(want):
            raise SchemaError(f"{cell / 'metrics.json'}: field `{k}` is {got!r}, but requests.jsonl gives {want!r} "
                              f"(more than {REL_TOL:.0%} apart). Fix: {FIX}")


def request_digest(rows: list[dict]) -> str:
    """A fingerprint of a cell's request records (as read, key order aside)."""
    return hashlib.sha1(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def check_duplicates(digests: dict[str, str]) -> None:
    """``digests``: cell path -> request_digest. Raise SchemaError naming both cells where two hold the
    same records."""
    seen: dict[str, str] = {}
    for path in sorted(digests):
        d = digests[path]
        if d in seen:
            raise SchemaError(f"{path}: its requests.jsonl holds the same request records as {seen[d]}: one run "
                              "stored twice (a copied folder, or a copy under another rep) would count as two "
                              "repetitions. Fix: keep one of the two folders (move the copy out of the results "
                              "tree); never edit raw results by hand")
        seen[d] = path
