"""Replay a request trace against a server's streaming ``/generate`` API, one wall time per token.

    rep = ReplayClient("http://127.0.0.1:30000").replay(requests)   # -> Replay
    rep.records   # RequestRecord per request: output ids, the time each token reached the client

Each request is sent at its ``arrival_s`` after the replay's start (t=0), as token ids
(``input_ids``), greedy, with ``max_new_tokens = output_len`` and ``ignore_eos`` (random weights:
exactly the engine's output lengths). The response is SGLang's server-sent-event stream: lines
``data: {json}`` whose ``output_ids`` are the new tokens (``--incremental-streaming-output``) or
all tokens so far (SGLang's default), then ``data: [DONE]``. A chunk that carries several tokens
(the server coalesced steps) gives them all the chunk's arrival time. TTFT is measured from the
request's scheduled arrival, as the engine measures it; how late the client sent it is kept
(``extra.send_lag_s``; ``Replay.max_send_lag_s``). Request bodies are serialised, aiohttp is warmed by
one ``GET /server_info`` and every request's task is created before the clock starts.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

from granikv.sglang_plugin.settings import PREFIX_PARAM
from granikv.request import Request, RequestRecord

DONE = object()   # the end-of-stream event
START_LEAD_S = 0.05   # the tasks are created this long before the trace's t=0


class ReplayError(RuntimeError):
    """A request that failed on the wire or got a malformed stream (the message names it)."""


def parse_event(line: bytes | str):
    """One line of an SSE stream -> a JSON dict, :data:`DONE`, or None (blank, comment, other field)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise ReplayError(f"malformed stream line (not JSON): {data[:120]!r}") from e
    if not isinstance(obj, dict):
        raise ReplayError(f"malformed stream line (not an object): {data[:120]!r}")
    return obj


class TokenStream:
    """Accumulates one request's streamed tokens: ids, per-token times, chunk count, last meta_info."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.ids: list[int] = []
        self.times: list[float] = []
        self.chunks = 0
        self.meta: dict = {}
        self.done = False

    def feed(self, event, now_s: float) -> None:
        if event is None:
            return
        if event is DONE:
            self.done = True
            return
        if "error" in event:
            raise ReplayError(f"the server reported an error: {json.dumps(event['error'])[:300]}")
        ids = event.get("output_ids")
        if not isinstance(ids, list):
            raise ReplayError(f"stream chunk without output_ids: {json.dumps(event)[:200]}")
        new = ids if self.incremental else ids[len(self.ids):]
        if not self.incremental and ids[:len(self.ids)] != self.ids:
            raise ReplayError("cumulative output_ids changed their earlier tokens (is the server's "
                              "--incremental-streaming-output on? set system.server.incremental_streaming)")
        self.meta = event.get("meta_info") or self.meta
        if new:
            self.chunks += 1
            self.ids.extend(int(t) for t in new)
            self.times.extend([now_s] * len(new))


@dataclass
class Replay:
    """What one replay produced: records in request order, and the client's own timing."""

    records: list[RequestRecord]
    duration_s: float                 # replay start -> last token
    max_send_lag_s: float             # how late the client sent its latest-sent request
    chunks: int = 0                   # streamed chunks that carried tokens, all requests
    errors: list[str] = field(default_factory=list)


class ReplayClient:
    """Streams a trace through ``POST {url}/generate`` (aiohttp, one connection per request)."""

    def __init__(self, url: str, incremental: bool = True, timeout_s: float = 3600.0, send_prefix_len: bool = False):
        self.url, self.incremental, self.timeout_s = url.rstrip("/"), incremental, float(timeout_s)
        self.send_prefix_len = bool(send_prefix_len)

    def replay(self, requests: list[Request]) -> Replay:
        """Serve ``requests`` (arrivals relative to now); raises ReplayError on timeout."""
        return asyncio.run(self._replay(requests))

    def payload(self, r: Request) -> dict:
        """The /generate body of ``r``; with ``send_prefix_len``, a request with a shared prefix names
        it in ``custom_params.granikv_prefix_len`` (how the GraniKV plugin learns it)."""
        sp = {"max_new_tokens": int(r.output_len), "ignore_eos": True, "temperature": 0.0}
        if self.send_prefix_len and r.shared_len > 0:
            sp["custom_params"] = {PREFIX_PARAM: int(r.shared_len)}
        return {"input_ids": list(r.prompt_ids), "stream": True, "sampling_params": sp}

    async def _replay(self, requests: list[Request]) -> Replay:
        import aiohttp

        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
        streams = [TokenStream(self.incremental) for _ in requests]
        sent = [0.0] * len(requests)
        errors: list[Optional[str]] = [None] * len(requests)
        # request bodies serialised before the clock starts: a 16K-token prompt is ~100 KB of JSON
        bodies = [json.dumps(self.payload(r)).encode() for r in requests]
        headers = {"Content-Type": "application/json"}
        t0 = 0.0

        async def one(i: int, session) -> None:
            r = requests[i]
            delay = t0 + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[i] = time.perf_counter() - t0
            try:
                async with session.post(self.url + "/generate", data=bodies[i], headers=headers) as resp:
                    if resp.status != 200:
                        body = (await resp.read()).decode(errors="replace")[:300]
                        raise ReplayError(f"HTTP {resp.status}: {body}")
                    async for line in resp.content:
                        streams[i].feed(parse_event(line), time.perf_counter() - t0)
                        if streams[i].done:
                            break
                if not streams[i].done:
                    raise ReplayError("the stream ended without `data: [DONE]`")
            except (ReplayError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                errors[i] = f"request {r.rid}: {type(e).__name__}: {e}"

        async with aiohttp.ClientSession(connector=conn, timeout=timeout, read_bufsize=1 << 20) as session:
            # one request before the clock: aiohttp's first request pays its lazy set-up (seen on the H200
            # host: requests 2-5 of a trace sent 75-135 ms late without it)
            async with session.get(self.url + "/server_info") as warm:
                await warm.read()
            t0 = time.perf_counter() + START_LEAD_S   # every task exists and sleeps before the trace's t=0
            tasks = [asyncio.create_task(one(i, session)) for i in range(len(requests))]
            done, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                finished = sum(s.done for s in streams)
                raise ReplayError(f"the replay did not finish within {self.timeout_s:.0f} s "
                                  f"(system.server.request_timeout_s): {finished} of {len(requests)} requests done")
        records = [RequestRecord(rid=r.rid, arrival_s=r.arrival_s, prompt_len=len(r.prompt_ids),
                                 output_ids=s.ids, token_times_s=s.times,
                                 cached_len=int(s.meta.get("cached_tokens") or 0), prefix_class=r.prefix_class,
                                 prefix_where="server",
                                 extra={"send_lag_s": max(sent[i] - r.arrival_s, 0.0), "chunks": s.chunks,
                                        "finish_reason": s.meta.get("finish_reason")})
                   for i, (r, s) in enumerate(zip(requests, streams))]
        last = max((s.times[-1] for s in streams if s.times), default=0.0)
        lags = [max(sent[i] - r.arrival_s, 0.0) for i, r in enumerate(requests)]
        return Replay(records, last, max(lags, default=0.0), sum(s.chunks for s in streams),
                      [e for e in errors if e])
