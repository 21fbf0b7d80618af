"""Analysis: raw results -> tidy frames (load), one module per paper table / figure, claims, report."""
