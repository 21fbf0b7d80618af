"""When, and by how much, a dynamic split moves the HOT/COLD boundary (integers in, integers out).

The KV buffer has ``capacity`` rows: HOT ``[0, b)``, COLD ``[b, capacity)``; ``b`` is the boundary.
A cached slab never moves, so the boundary moves only over free rows: HOT grows into the free
COLD rows just above ``b``, and shrinks by giving back the free rows at its own end (its
``tail_free``). The policy, for ``hot_min <= b <= hot_max`` and a COLD watermark of ``w`` rows:

- **Grow, on a HOT miss.** When a prefix tail of ``need`` rows finds no free HOT extent (HOT too
  full or too fragmented), grow by exactly the deficit ``d = need - tail_free``, so that the
  extent at HOT's end becomes ``need`` rows long (first fit then takes it: no other extent fits),
  if all of: ``b + d <= hot_max``; the ``d`` lowest COLD rows are free; and COLD keeps at least
  ``2 w`` free rows afterwards. It is tried before stale HOT slabs are evicted (growing keeps
  them cached); when it is refused the admission goes on as with the static split (evict a HOT
  window, else the COLD fallback).
- **Shrink, on COLD pressure.** When a COLD allocation of ``need`` rows (a request's own rows, or
  a prefix's COLD fallback) would leave fewer than ``w`` COLD rows free, give back
  ``min(need + w - cold_free, tail_free, b - hot_min)`` rows (when positive): just enough to make
  the allocation and keep the watermark, never a row in use, never below ``hot_min``. It is tried
  before cached COLD prefixes are evicted (free HOT rows cost nothing to give up), and it stays
  done when the allocation still fails (COLD was short; the request waits as with the static split).

Growth leaves at least ``2 w`` COLD rows free, a shrink starts only below ``w``: the band in
between keeps the two rules from undoing each other at once. Nothing else moves the boundary (no
timers, no background work), so a run is as deterministic as its admissions. Since unlocked
cached slabs can hold HOT up to ``hot_max`` while the engine is idle, the engine accepts only
requests that fit the smallest COLD region, ``capacity - hot_max`` (``min_cold``; the scheduler's
``check_fits``): an idle engine can then make room for any request it accepted, wherever the
boundary was left, as the static split's check guarantees for its fixed boundary.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitPolicy:
    """Bounds of a dynamic split over ``capacity`` rows, in rows, and its two rules.

    ``hot_min <= initial <= hot_max < capacity``: the HOT region's smallest and largest size and
    its size at reset; ``watermark``: the COLD free rows a shrink restores (growth keeps twice that).
    """

    capacity: int
    initial: int
    hot_min: int
    hot_max: int
    watermark: int

    def __post_init__(self):
        for name in ("capacity", "initial", "hot_min", "hot_max", "watermark"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"SplitPolicy.{name} must be an int >= 0, got {v!r}")
        if not self.hot_min <= self.initial <= self.hot_max < self.capacity:
            raise ValueError(f"SplitPolicy: need hot_min <= initial <= hot_max < capacity, got {self.hot_min}, "
                             f"{self.initial}, {self.hot_max}, {self.capacity}")

    @classmethod
    def from_fractions(cls, capacity: int, hot_fraction: float, hot_min_fraction: float,
                       hot_max_fraction: float, cold_watermark: float) -> "SplitPolicy":
        """Rows from the fractions of ``capacity`` (``int()`` rounding, as KVCache's HOT rows)."""
        return cls(capacity, int(capacity * hot_fraction), int(capacity * hot_min_fraction),
                   int(capacity * hot_max_fraction), int(capacity * cold_watermark))

    @classmethod
    def from_system(cls, system, capacity: int) -> "SplitPolicy":
        """The policy of a ``SystemConfig`` with ``hot_split="dynamic"`` over ``capacity`` rows."""
        return cls.from_fractions(capacity, system.hot_fraction, system.hot_min_fraction,
                                  system.hot_max_fraction, system.cold_watermark)

    def grow_by(self, need: int, boundary: int, hot_tail_free: int, cold_free: int, cold_head_free: int) -> int:
        """Rows to move from COLD to HOT so that a HOT extent of ``need`` rows fits at HOT's end;
        0 when a rule refuses (or nothing is missing). ``cold_head_free``: free COLD rows from the
        boundary up to the first allocated one."""
        d = need - hot_tail_free
        if d <= 0 or boundary + d > self.hot_max or cold_head_free < d or cold_free - d < 2 * self.watermark:
            return 0
        return d

    def shrink_by(self, need: int, boundary: int, hot_tail_free: int, cold_free: int) -> int:
        """Rows to move from HOT to COLD before a COLD allocation of ``need`` rows (0: none)."""
        short = need + self.watermark - cold_free
        if short <= 0:
            return 0
        return max(0, min(short, hot_tail_free, boundary - self.hot_min))

    # bounds every boundary the rules can reach respects (engine admission checks use them)
    @property
    def min_cold(self) -> int:
        """The fewest COLD rows there can ever be: ``capacity - hot_max``."""
        return self.capacity - self.hot_max
