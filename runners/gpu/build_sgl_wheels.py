"""Build the SGLang wheel set that runners/gpu/sglang.sh installs on a GPU host without internet.

    python runners/gpu/build_sgl_wheels.py            # -> .sgl_wheels/whl/*.whl, MANIFEST.txt, parts/

For every file named in runners/gpu/sglang_wheels.txt: ``pip download --no-deps --only-binary=:all:
--python-version 3.12 --implementation cp`` with the platform tags the file name carries. Then
``sglang_kernel`` is rebuilt without its FA3, sm100, infllm and flashmla libraries (342 MB of its
383 MB; the server then runs ``--attention-backend flashinfer``) and their RECORD lines; every wheel's
sha256 and size go to ``MANIFEST.txt``; and the set is packed as one tar split into parts of at most
``--part-mib`` (a device call carries 64 MiB with the checkout).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("sglang_wheels.txt")
SLIM = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
        "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so", "sgl_kernel/flashmla_ops.abi3.so")
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def wheel_files(path: Path = LIST) -> list[str]:
    return [ln.split()[0] for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def download(fname: str, dest: Path) -> Path:
    m = WHEEL.match(fname)
    if m is None:
        raise SystemExit(f"{LIST}: '{fname}' is not a wheel file name (name-version-python-abi-platform.whl)")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest), f"{m['name'].replace('_', '-')}=={m['version']}"]
    if m["plat"] != "any":
        cmd += [a for p in m["plat"].split(".") for a in ("--platform", p)]
    subprocess.run(cmd, check=True)
    got = dest / fname
    if not got.exists():
        raise SystemExit(f"pip did not download {fname} (got {sorted(p.name for p in dest.glob('*.whl'))[-3:]})")
    return got


def slim(whl: Path) -> None:
    """Rewrite ``whl`` without the SLIM members and their RECORD lines (entries keep their metadata)."""
    tmp = whl.with_suffix(".slim")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in SLIM:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(ln for ln in data.splitlines(keepends=True) if ln.split(b",")[0].decode() not in SLIM)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(whl)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".sgl_wheels"))
    ap.add_argument("--part-mib", type=int, default=40)
    a = ap.parse_args(argv)
    out = Path(a.out)
    whl_dir, parts = out / "whl", out / "parts"
    shutil.rmtree(whl_dir, ignore_errors=True)
    shutil.rmtree(parts, ignore_errors=True)
    whl_dir.mkdir(parents=True)
    parts.mkdir()
    lines = []
    for fname in wheel_files():
        w = download(fname, whl_dir)
        note = ""
        if fname.startswith("sglang_kernel-"):
            slim(w)
            note = "  (slimmed: FA3, sm100, infllm, flashmla members removed)"
        lines.append((fname, f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.stat().st_size}  {fname}{note}"))
    (whl_dir / "MANIFEST.txt").write_text("".join(ln + "\n" for _, ln in sorted(lines)))
    tar = out / "sgl_wheels.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        t.add(whl_dir, arcname="whl")
    size, step = tar.stat().st_size, a.part_mib << 20
    with open(tar, "rb") as f:
        for i in range((size + step - 1) // step):
            suffix = chr(ord("a") + i // 26) + chr(ord("a") + i % 26)
            (parts / f"sgl_wheels.tar.part-{suffix}").write_bytes(f.read(step))
    tar.unlink()
    print(f"{len(lines)} wheels, {size / 2**20:.1f} MiB, {len(list(parts.iterdir()))} part(s) in {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
