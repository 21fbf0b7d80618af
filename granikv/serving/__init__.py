"""A real serving engine in the loop: start an SGLang server for a cell, replay the cell's requests
against it, and measure them with the same definitions as our engine (granikv.metrics).

    hf_config.py   the model's Hugging Face ``config.json``, written from conf/model (dummy weights)
    server.py      launch / health / stop of an SGLang server for a RunConfig, reused across cells
    client.py      streaming replay of a request trace through /generate, one wall time per token
    sglang_log.py  SGLang's "Prefill batch" / "Decode batch" log lines as step records
    session.py     ServerEngine: an Engine-shaped object (``run(requests) -> RunResult``) over a server
"""
