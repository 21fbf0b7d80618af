"""Build the git-ignored files that runners/gpu/env.sh sets the engine's GPU environment up from.

    python runners/gpu/build_gpu_site.py        # -> .gpu_site/flashinfer-0.7.2.post1.tar.xz,
                                                #    .whl/apache_tvm_ffi-*.whl, .gpu_site/py/

The GPU host has no internet, torch, pandas and nvidia-ml-py but no FlashInfer or Hydra, so a device
call carries them with the checkout (64 MiB in all; these come to about 22 MiB):

- ``flashinfer-python`` (pinned in pyproject's ``gpu`` extra): its package tree, as one xz tarball
  that env.sh extracts into ``.gpu_site/site`` (the wheel's 62 MB becomes about 17 MB);
- ``apache-tvm-ffi``, the newest wheel within FlashInfer's requirement, for CPython 3.12 manylinux;
- Hydra, omegaconf, antlr4 runtime (omegaconf's pin is an sdist, built into a wheel here) and PyYAML,
  unpacked into ``.gpu_site/py`` (env.sh and sglang.sh put it on PYTHONPATH).

Every file's sha256 goes to ``.gpu_site/MANIFEST.txt``, which the cells' provenance does not need
(they record the imported versions) but which tells two builds apart.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLASHINFER = "0.7.2.post1"
TVM_FFI = "apache-tvm-ffi>=0.1.11,<0.2"      # flashinfer-python 0.7.2.post1's Requires-Dist
PURE = ("hydra-core==1.3.2", "omegaconf==2.3.0", "antlr4-python3-runtime==4.9.3")
BINARY = ("PyYAML==6.0.2",)                  # cp312 manylinux, like the host's python
HOST = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
        "--platform", "manylinux2014_x86_64", "--only-binary=:all:"]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=True)


def one(dest: Path, pattern: str) -> Path:
    got = sorted(dest.glob(pattern))
    if len(got) != 1:
        raise SystemExit(f"expected one file {pattern} in {dest}, found {[p.name for p in got]}")
    return got[0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(root: Path) -> list[Path]:
    site, whl = root / ".gpu_site", root / ".whl"
    site.mkdir(exist_ok=True)
    whl.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pip("download", "--no-deps", *HOST, "-d", str(tmp), f"flashinfer-python=={FLASHINFER}", TVM_FFI, *BINARY)
        # antlr4-python3-runtime 4.9.3 (omegaconf 2.3's pin) is published as an sdist only
        pip("wheel", "--no-deps", "-w", str(tmp), *PURE)
        tree = tmp / "tree"
        with zipfile.ZipFile(one(tmp, "flashinfer_python-*.whl")) as z:
            z.extractall(tree)
        fi_tar = site / f"flashinfer-{FLASHINFER}.tar.xz"
        with tarfile.open(fi_tar, "w:xz", preset=6) as tar:
            for member in ("flashinfer", f"flashinfer_python-{FLASHINFER}.dist-info"):
                tar.add(tree / member, arcname=member)
        for old in whl.glob("apache_tvm_ffi-*.whl"):
            old.unlink()
        tvm = whl / one(tmp, "apache_tvm_ffi-*.whl").name
        shutil.copy2(one(tmp, "apache_tvm_ffi-*.whl"), tvm)
        py = site / "py"
        shutil.rmtree(py, ignore_errors=True)
        wheels = [one(tmp, p) for p in ("hydra_core-*.whl", "omegaconf-*.whl", "antlr4_python3_runtime-*.whl",
                                        "PyYAML-*.whl" if list(tmp.glob("PyYAML-*.whl")) else "pyyaml-*.whl")]
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(py)
        made = [fi_tar, tvm]
        lines = [f"{sha256(p)}  {p.stat().st_size}  {p.relative_to(root)}" for p in made]
        lines += [f"{sha256(w)}  {w.stat().st_size}  .gpu_site/py <- {w.name}" for w in wheels]
    (site / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    return made + [py]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root to write into (default: this checkout)")
    args = ap.parse_args(argv)
    for p in build(args.root):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        print(f"{p.relative_to(args.root)}  {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
