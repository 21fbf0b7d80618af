"""``python -m analysis.reproduce [--results results/raw] [--out results] [--only tables|figures]``

Loads every cell under ``--results`` (schema-checked), builds every registered exhibit (analysis.registry) into
``--out``/tables and ``--out``/figures, writes the campaign's coverage (``analysis.exhibits.campaign.coverage``) and
``--out``/REPORT.md (claim by claim).
Only the folders of ``--results`` that conf/campaign.yaml names (its items' sweep folders and its ``benches``:
runners.campaign.named_folders) are read; the REPORT lists any other folder as ignored. ``--every-folder`` reads
them all (a scratch results folder of your own).
``--only tables``: tables and the report, no figures; ``--only figures``: the modules with their
figures (and the tables they are drawn from), no report. The claim map (``analysis.exhibits.campaign.claim_map``) is
written with the report.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis.clean import prefer_clean, prefer_rerun
from analysis.load import load_results
from analysis.exhibits import exhibits
from analysis.report.claims import primary_rows
from analysis.report.write import write_report
from granikv.rawio import SchemaError
from runners.campaign import named_folders

EXHIBITS = exhibits("paper")


NAMED = "named"


def run(results: str | Path = "results/raw", out: str | Path = "results", only: str | None = None,
        folders=NAMED) -> dict:
    """Regenerate everything; returns {"tables": [...], "figures": [...], "claims": DataFrame | None}.
    ``folders``: the top-level folders of ``results`` read (NAMED: those conf/campaign.yaml names; None: all)."""
    out = Path(out)
    res = prefer_clean(prefer_rerun(load_results(results, named_folders() if folders == NAMED else folders)))
    for e in EXHIBITS:
        e.build(res, out, figures=only != "tables")
    books = exhibits("bookkeeping")   # not paper tables: the campaign's cells and reruns against the raw results
    for e in books:
        e.build(res, out)
    tables = [t for e in EXHIBITS + books for t in e.tables]
    figs = [f for e in EXHIBITS for f in e.figures]
    ev = None
    if only != "figures":
        after = exhibits("claims")      # claim -> experiment -> command -> GPUs -> time -> output
        tables += [t for e in after for t in e.tables]
        ev = write_report(res, out, tables + ["claims"], figs)
        for e in after:
            e.build(res, out, ev=ev)
    return {"tables": tables, "figures": figs, "claims": ev, "results": res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.reproduce", description=__doc__.split("\n\n")[1])
    ap.add_argument("--results", default="results/raw", help="raw results folder (default results/raw)")
    ap.add_argument("--out", default="results", help="where tables/, figures/ and REPORT.md go (default results)")
    ap.add_argument("--only", choices=("tables", "figures"), default=None)
    ap.add_argument("--every-folder", action="store_true",
                    help="read every folder of --results, not only those conf/campaign.yaml names")
    a = ap.parse_args(argv)
    if Path(a.results).exists() and not Path(a.results).is_dir():
        ap.error(f"--results {a.results} is not a folder (give the raw results root, e.g. results/raw)")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        ap.error(f"--out {a.out} is not a folder")
    if not Path(a.results).exists():
        print(f"note: {a.results} does not exist yet: every cell is reported as not measured", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        r = run(a.results, a.out, a.only, None if a.every_folder else NAMED)
    except SchemaError as e:   # a raw file that does not match the schema: the message names it and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = r["results"]
    print(f"analysis: {len(res.cells) + len(res.set_aside)} cells ({len(res.set_aside)} set aside, "
          f"{len(res.ignored)} folders ignored), "
          f"{len(res.failures)} failed/unfinished, {len(res.kernels)} kernel rows from {a.results}")
    print(f"wrote {len(r['tables'])} tables to {Path(a.out) / 'tables'}" +
          (f", {len(r['figures'])} figures to {Path(a.out) / 'figures'}" if a.only != "tables" else ""))
    if r["claims"] is not None:
        v = primary_rows(r["claims"])["verdict"].value_counts()
        print(f"wrote {Path(a.out) / 'REPORT.md'}: " + ", ".join(f"{n} {k}" for k, n in sorted(v.items())))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
