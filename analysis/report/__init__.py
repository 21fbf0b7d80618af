"""results/REPORT.md: the claims table, the verdict rule, the close calls, one section per claim with the
explanations measured for it, the chapters the exhibits register (analysis.registry), coverage and
provenance. ``analysis.report.write.write_report`` writes it."""
