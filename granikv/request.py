"""A request to serve (what workloads produce) and its record after serving (what the engine returns)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """One request of a workload trace.

    ``prompt_ids`` = shared prefix (its first ``shared_len`` tokens) + the request's own
    suffix; ``prefix_class`` names which shared prefix it carries (-1 = none); the engine
    generates exactly ``output_len`` tokens (no EOS: weights are random).
    """

    rid: int
    prompt_ids: list[int]
    output_len: int
    arrival_s: float = 0.0
    shared_len: int = 0
    prefix_class: int = -1

    def __post_init__(self):
        if self.output_len < 1:
            raise ValueError(f"request {self.rid}: output_len must be >= 1, got {self.output_len}")
        if not (0 <= self.shared_len <= len(self.prompt_ids)):
            raise ValueError(f"request {self.rid}: shared_len={self.shared_len} outside [0, {len(self.prompt_ids)}]")


@dataclass
class RequestRecord:
    """What serving one request produced: one timestamp per output token (streaming)."""

    rid: int
    arrival_s: float
    prompt_len: int
    output_ids: list[int]
    token_times_s: list[float]       # wall time each output token was produced (engine clock)
    cached_len: int = 0              # prompt tokens served from the prefix index (not recomputed)
    prefix_class: int = -1
    prefix_where: str = "none"       # hot | cold | hit | none (admission placement)
    warmup: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def first_token_s(self) -> float:
        return self.token_times_s[0]

    @property
    def finish_s(self) -> float:
        return self.token_times_s[-1]


@dataclass
class RunResult:
    """What one ``run()`` of an engine or a server session produced (warm-up excluded)."""

    records: list[RequestRecord]
    steps: list[dict]
    stats: dict = field(default_factory=dict)
