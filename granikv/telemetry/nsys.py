"""nsys wrapping: re-run one cell under ``nsys profile`` (CUDA, NVTX, OS runtime; the B.5
capture) when ``nsys`` is on PATH; the report lands in the cell folder as profile.nsys-rep."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional


def nsys_path() -> Optional[str]:
    """Path of the nsys binary, or None."""
    return shutil.which("nsys")


ENV_GUARD = "GRANIKV_IN_NSYS"  # set in the child: run the cell, do not wrap again


def nsys_command(cell_dir: str | Path, overrides: list[str], nsys: str = "nsys") -> list[str]:
    """argv that re-runs this cell with the same overrides (so the same cell id and config)
    under nsys; run it with ``ENV_GUARD=1`` in the environment."""
    out = Path(cell_dir) / "profile"
    return [nsys, "profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--force-overwrite=true",
            f"--output={out}", sys.executable, "-m", "runners.run", *overrides]
