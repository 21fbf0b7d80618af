"""The synthetic grid (B.1) and the ShareGPT Lp x B matrix (B.2)."""
