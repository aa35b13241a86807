"""What `LLM.generate` returns (field names as in vLLM's offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample's output. From `LLMEngine.step()` for a streamed request (`add_request(stream=True)`),
    the delta of one step: `text`, `token_ids` and `logprobs` hold only what it added (the texts join
    into the whole text), `cumulative_logprob` is the running sum."""

    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" (abort_request, or masks that left no token); None while unfinished
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    # One dict per generated token: token id -> Logprob (the sampled token plus the top `logprobs`).
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request went through the engine, as `time.monotonic()` values (vLLM's RequestMetrics):
    added to the engine, first scheduled (its prompt's first chunk sent to the workers), and its first
    token back on the host. None where that has not happened yet. The engine fills in the request's one
    object, which its outputs share."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival until first scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # False on a streamed request's outputs until its last one; `LLM.generate` returns finished outputs.
    finished: bool = True
    # With SamplingParams(prompt_logprobs=k): per prompt token, token id -> Logprob (the prompt token plus
    # the top k); None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens whose KV came from the prefix cache when the request started (0: none, or caching off).
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
