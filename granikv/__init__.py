"""GraniKV reproduction suite: asymmetric-granularity KV-cache paging for long shared prefixes."""

__version__ = "0.1.0"
