"""A stand-in for ``python -m sglang.launch_server`` that speaks its HTTP protocol, for CPU tests.

    python -m tests.fake_sglang_server --port P --max-running-requests B ... (SGLang's flags; the rest ignored)

Endpoints as SGLang 0.5.17 has them: ``GET /health_generate`` (503 while starting, then 200),
``GET /server_info`` (version, resolved args, max_total_num_tokens), ``POST /flush_cache`` (400
while requests run), ``POST /generate`` with ``stream: true``: chunked ``data: {json}`` lines
carrying ``output_ids`` (new ones with --incremental-streaming-output, else all so far) and
``meta_info``, then ``data: [DONE]``; ``POST /start_profile`` (``num_steps`` decode steps later it writes
``<output_dir>/<profile_id>-TP-0.trace.json.gz``). At most B requests generate at once (the rest queue); one
token per ``FAKE_SGLANG_TOKEN_S`` seconds; token ids are a function of the prompt. It logs
"Prefill batch" / "Decode batch" lines as SGLang does, and appends each event (``generate``
with the request's length, ``flush``) to ``FAKE_SGLANG_EVENTS`` when set.

``FAKE_SGLANG_MODE`` makes it fail the ways a real server can: ``exit_early`` (dies while starting,
with a traceback in its log), ``never_healthy`` (answers 503 forever), ``short`` (one token fewer
than asked), ``stall`` (stops streaming after the first token), ``die_mid`` (exits after its
third generate request).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_SGLANG_MODE", "ok")
TOKEN_S = float(os.environ.get("FAKE_SGLANG_TOKEN_S", "0.002"))
EVENTS = os.environ.get("FAKE_SGLANG_EVENTS")


def log(msg: str) -> None:
    print(f"[{datetime.now():%Y-%m-%d %H:%M:%S}] {msg}", flush=True)


class State:
    def __init__(self, args):
        self.args = args
        self.ready = False
        self.running = 0
        self.generates = 0
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(args.max_running_requests)
        self.step = 0
        self.profile = None       # (output path, steps left) while a /start_profile runs

    def event(self, **kw) -> None:
        if EVENTS:
            with self.lock, open(EVENTS, "a") as f:
                f.write(json.dumps({"t": time.time(), **kw}) + "\n")


def make_handler(st: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):   # keep the log to SGLang-like lines
            pass

        def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_GET(self):
            if self.path.startswith("/health"):
                self._send(200 if st.ready and MODE != "never_healthy" else 503, b"")
            elif self.path.startswith("/server_info"):
                a = st.args
                info = {"version": "0.0.0-fake", "max_total_num_tokens": a.max_total_tokens or 100000,
                        "max_running_requests": a.max_running_requests, "attention_backend": a.attention_backend,
                        "incremental_streaming_output": a.incremental_streaming_output,
                        "internal_states": [{"big": "dropped"}]}
                self._send(200, json.dumps(info).encode(), "application/json")
            else:
                self._send(404, b"not found")

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            if self.path.startswith("/flush_cache"):
                with st.lock:
                    busy = st.running > 0
                if not busy:
                    st.event(kind="flush")
                    log("Cache flushed successfully!")
                self._send(400 if busy else 200, b"pending requests" if busy else b"Cache flushed.\n")
                return
            if self.path.startswith("/start_profile"):
                req = json.loads(body or b"{}")
                path = os.path.join(req.get("output_dir") or "/tmp", f"{req.get('profile_id', 'x')}-TP-0.trace.json.gz")
                with st.lock:
                    st.profile = (path, int(req.get("num_steps") or 5))
                st.event(kind="start_profile", num_steps=st.profile[1], activities=req.get("activities"),
                         output_dir=req.get("output_dir"))
                log("Profiling starts.")
                self._send(200, b"Start profiling.\n")
                return
            if not self.path.startswith("/generate"):
                self._send(404, b"not found")
                return
            self._generate(json.loads(body))

        def _generate(self, req: dict) -> None:
            ids, sp = req["input_ids"], req["sampling_params"]
            want = int(sp["max_new_tokens"])
            with st.lock:
                st.generates += 1
                nth = st.generates
            if MODE == "die_mid" and nth > 3:
                log("Traceback (most recent call last):\nRuntimeError: fake scheduler crashed")
                os._exit(1)
            st.event(kind="generate", prompt_len=len(ids), max_new_tokens=want, ignore_eos=sp.get("ignore_eos"))
            if nth == 1:                      # as FlashInfer says when it builds a kernel at first use
                log("[flashinfer.jit] Loading JIT ops: fake_single_prefill")
            with st.slots:
                with st.lock:
                    st.running += 1
                log(f"Prefill batch, #new-seq: 1, #new-token: {len(ids)}, #cached-token: 0, token usage: 0.01, "
                    f"#running-req: {st.running - 1}, #queue-req: 0, #pending-token: 0, cuda graph: False, "
                    f"input throughput (token/s): 1000.00")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                n = want - 1 if MODE == "short" else want
                out: list[int] = []
                seed = sum(ids) % 997
                try:
                    for i in range(n):
                        if MODE == "stall" and i == 1:
                            time.sleep(3600)
                        time.sleep(TOKEN_S)
                        tok = (seed * 31 + i * 7) % 512
                        out.append(tok)
                        fin = {"type": "length", "length": want} if i == n - 1 else None
                        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0,
                                "finish_reason": fin}
                        ids_field = [tok] if st.args.incremental_streaming_output else list(out)
                        self._chunk(b"data: " + json.dumps({"output_ids": ids_field, "meta_info": meta}).encode() + b"\n\n")
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                finally:
                    with st.lock:
                        st.running -= 1
    return Handler


def decode_logger(st: State) -> None:
    while True:
        time.sleep(0.02)
        with st.lock:
            r = st.running
        if r:
            st.step += 1
            with st.lock:
                prof = st.profile
                if prof is not None:
                    st.profile = (prof[0], prof[1] - 1) if prof[1] > 1 else None
            if prof is not None and prof[1] == 1:     # the last profiled step: write the trace, as SGLang does
                import gzip

                os.makedirs(os.path.dirname(prof[0]), exist_ok=True)
                with gzip.open(prof[0], "wt") as f:
                    json.dump({"traceEvents": [{"name": "fake_decode_step", "ph": "X", "ts": 0, "dur": 1}]}, f)
                log("Profiling done.")
            if st.step % st.args.decode_log_interval == 0:
                log(f"Decode batch, #running-req: {r}, #token: {r * 10}, token usage: 0.01, cuda graph: True, "
                    f"gen throughput (token/s): {r / 0.02:.2f}, #queue-req: 0, ")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="flashinfer")
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--incremental-streaming-output", action="store_true")
    args, _ = p.parse_known_args()
    if os.environ.get("FAKE_SGLANG_ARGV"):
        with open(os.environ["FAKE_SGLANG_ARGV"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    log(f"server_args={vars(args)}")
    if MODE == "exit_early":
        log("Traceback (most recent call last):\nRuntimeError: Not enough memory. Please try to increase "
            "--mem-fraction-static (fake)")
        sys.exit(3)
    st = State(args)
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(st))
    httpd.daemon_threads = True
    threading.Thread(target=decode_logger, args=(st,), daemon=True).start()
    time.sleep(0.3)   # "loading the model"
    st.ready = True
    log("The server is fired up and ready to roll!")
    httpd.serve_forever()


if __name__ == "__main__":
    main()
