"""SGLang's own step trace: its "Prefill batch" and "Decode batch" log lines as step records.

SGLang logs every prefill batch and every ``--decode-log-interval``-th decode batch, e.g.::

    [2026-12-01 15:00:00] Decode batch, #running-req: 256, #token: 301234, token usage: 0.33,
        cuda graph: True, gen throughput (token/s): 7543.21, #queue-req: 12,
    [2026-12-01 15:00:00] Prefill batch, #new-seq: 3, #new-token: 1234, #cached-token: 24576, ...

Each line becomes one ``steps.jsonl`` row: ``kind`` (prefill | decode), ``batch_size`` (running
requests of a decode step, new sequences of a prefill), ``num_tokens`` (tokens the step adds),
every ``key: value`` field of the line under a snake-case name (``running_req``, ``token``,
``token_usage``, ``cuda_graph``, ``gen_throughput_token_s``, ``queue_req``, ``new_token``,
``cached_token``, ...), the log's wall-clock stamp and the raw line. A decode row stands for
``decode_log_interval`` steps (its field says so).
"""
from __future__ import annotations

import re

_HEAD = re.compile(r"(Prefill|Decode) batch(?: \[\d+\])?, ")
_STAMP = re.compile(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})")
_FIELD = re.compile(r"\s*([^:,]+?):\s*([^,]+)")


def _name(key: str) -> str:
    key = key.replace("#", "").replace("(", "").replace(")", "").replace("/", "_")
    return re.sub(r"[^a-z0-9]+", "_", key.strip().lower()).strip("_")


def _value(v: str):
    v = v.strip()
    if v in ("True", "False"):
        return v == "True"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_line(line: str, decode_log_interval: int = 1) -> dict | None:
    """A step record from one log line, or None for any other line."""
    m = _HEAD.search(line)
    if m is None:
        return None
    kind = m.group(1).lower()
    fields = {_name(k): _value(v) for k, v in _FIELD.findall(line[m.end():]) if _name(k)}
    stamp = _STAMP.search(line[:m.start()])
    row = {"kind": kind, **fields, "log_time": stamp.group(1) if stamp else None, "line": line.strip()}
    if kind == "decode":
        n = int(fields.get("running_req", 0) or 0)
        row |= {"batch_size": n, "num_tokens": n, "decode_log_interval": int(decode_log_interval)}
    else:
        row |= {"batch_size": int(fields.get("new_seq", 0) or 0), "num_tokens": int(fields.get("new_token", 0) or 0)}
    return row


def parse_steps(lines: list[str], decode_log_interval: int = 1) -> list[dict]:
    """The step records of a log window, numbered in order."""
    rows = [r for r in (parse_line(ln, decode_log_interval) for ln in lines) if r is not None]
    return [{"step": i, **r} for i, r in enumerate(rows)]
