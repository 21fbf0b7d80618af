"""Several shared prefixes (B.8): uniform and heterogeneous."""
