"""The committed tables and report are exactly what the committed raw results regenerate."""
from __future__ import annotations
from pathlib import Path
import pytest

from analysis.reproduce import run

ROOT = Path(__file__).resolve().parents[1]


def test_committed_tables_regenerate_byte_for_byte(tmp_path):
    committed = ROOT / "results" / "tables"
    if not committed.is_dir() or not any(committed.glob("*.csv")):
        pytest.skip("no committed results/tables yet: run `make reproduce` and commit results/ (lead)")
    run(ROOT / "results" / "raw", tmp_path, only="tables")
    for p in sorted(committed.glob("*")):
        new = tmp_path / "tables" / p.name
        assert new.exists(), f"{p.name} is committed but no module writes it any more"
        assert new.read_bytes() == p.read_bytes(), f"results/tables/{p.name} differs from what results/raw gives"
    for p in sorted((tmp_path / "tables").glob("*")):
        assert (committed / p.name).exists(), f"tables/{p.name} is generated but not committed"
    if (ROOT / "results" / "REPORT.md").exists():
        assert (tmp_path / "REPORT.md").read_text() == (ROOT / "results" / "REPORT.md").read_text()
