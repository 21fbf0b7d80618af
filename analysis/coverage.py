"""``python -m analysis.coverage [--results DIR] [ITEM ...]``: what each campaign item has measured and misses,
with the command for the rest (the exhibit is analysis.exhibits.campaign.coverage)."""
from __future__ import annotations

import sys

from analysis.exhibits.campaign.coverage import main

if __name__ == "__main__":
    sys.exit(main())
