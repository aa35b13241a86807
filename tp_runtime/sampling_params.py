"""User-facing sampling parameters (shaped like vLLM's), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tp_runtime.errors import InvalidRequestError

# Temperatures below this are treated as greedy (avoids dividing logits by ~0).
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token
    n: int = 1

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return (is_int(v) or isinstance(v, float)) and math.isfinite(v)  # type: ignore[arg-type]

        if not is_real(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1 or 0 (disabled) or a positive int, got {self.top_k!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise bad(f"seed must be None or an int that fits in 64 bits (signed), got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if not is_int(self.n) or self.n < 1:
            raise bad(f"n must be an int >= 1, got {self.n!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
