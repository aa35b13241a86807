"""Typed messages that cross process boundaries (msgspec Structs, msgpack on the wire).

Decode steps carry only a diff: a new request's prompt, sampling settings and block ids travel once; after
that a request is named by its integer id and only new block ids and token counts are sent. Workers keep
the sampled tokens themselves, on the device (every rank samples the same tokens).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec
import msgspec.inspect


def first_outside(values: list[int], low: int, end: int) -> int | None:
    """The first of `values` outside [low, end), if any: the id check of a message's contents on either
    side (builtin min/max: C speed for the common case, where all are inside)."""
    if values and (min(values) < low or max(values) >= end):
        return next(v for v in values if not low <= v < end)
    return None


def sampling_ids_limit(vocab_size: int) -> int:
    """The most numbers a request's sampling lists (RequestSampling's stop, logit_bias, allowed and
    bad_words ids) may hold: a whole vocabulary in each of stop, allowed and logit_bias (ids and values),
    and some bad words beside them. Requests over it are refused, and the workers' message limit counts
    it for every new request (ipc.message_limits), so no step outgrows what a worker takes."""
    return 4 * vocab_size + 4096


class RequestSampling(msgspec.Struct, array_like=True, frozen=True):
    """What a worker needs of SamplingParams to sample one request."""

    temperature: float
    top_p: float
    top_k: int  # 0: disabled
    min_p: float
    seed: int | None
    min_tokens: int
    # Token ids masked out until min_tokens outputs exist (EOS and stop_token_ids).
    stop_token_ids: list[int]
    num_logprobs: int  # -1: none
    # Neutral values (1, 0, 0) switch a penalty off; workers keep token-count state only while a live
    # request uses one.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_prompt_logprobs: int = -1  # -1: none
    # logit_bias as sorted token ids and their biases, and allowed_token_ids (sorted); empty: none.
    logit_bias_ids: list[int] = []
    logit_bias_values: list[float] = []
    allowed_token_ids: list[int] = []
    # bad_words as token sequences: the last id of each is masked where the outputs end with the rest.
    bad_words: list[list[int]] = []


class NewRequest(msgspec.Struct, array_like=True):
    req_id: int
    # Prompt, plus the tokens generated before a preemption when a request is resumed.
    token_ids: list[int]
    num_output_tokens: int
    sampling: RequestSampling
    block_ids: list[int]
    # Tokens already in its blocks (a prefix-cache hit): computing starts after them.
    num_computed_tokens: int = 0


class CachedRequests(msgspec.Struct, array_like=True):
    req_ids: list[int]
    new_block_ids: list[list[int]]


class SchedulerOutput(msgspec.Struct, array_like=True):
    step_id: int
    new_requests: list[NewRequest]
    cached_requests: CachedRequests
    # Every request that runs this step, in batch order, and how many tokens each computes.
    scheduled_req_ids: list[int]
    num_scheduled_tokens: list[int]
    # Requests whose state the workers drop (finished, aborted or preempted) before this step runs.
    freed_req_ids: list[int]
    # Structured outputs: the constrained requests that sample this step and, row by row in that order,
    # the tokens each may sample (int32 little-endian words; bit i of word j allows token 32 j + i).
    structured_req_ids: list[int] = []
    grammar_bitmask: bytes = b""
    # With async scheduling the bitmask is not known when the step is sent (it needs the previous step's
    # tokens): the ranks run the forward and wait for the step's GrammarMask before sampling.
    grammar_mask_follows: bool = False


class Logprobs(msgspec.Struct, array_like=True):
    """Per sampled token: the sampled token first, then the top-k; logprobs of the raw model output."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """One request's prompt logprobs from one prefill chunk: entry i is for prompt token start + 1 + i,
    predicted from position start + i; the prompt token first, then the top-k (raw model output)."""

    req_id: int
    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the prompt token (1 = most likely)


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    step_id: int
    # Requests that produced a token this step (a partial prefill chunk produces none).
    req_ids: list[int]
    sampled_token_ids: list[int]
    logprobs: Logprobs | None = None
    # Optional per-step timings from rank 0 (seconds), filled when timing is enabled.
    timings: dict[str, float] | None = None
    # Only for requests that asked for prompt_logprobs, in steps that computed some of their prompt.
    prompt_logprobs: list[PromptLogprobs] | None = None
    # The step had finished when its output was first asked for, which rank 0 does once the next step is
    # queued: the device may have run out of work in between (engine/pacing.py).
    ready_before_asked: bool = False


# Driver -> workers (broadcast).
class ExecuteModel(msgspec.Struct, tag="exec", array_like=True):
    scheduler_output: SchedulerOutput


class GrammarMask(msgspec.Struct, tag="mask", array_like=True):
    """The bitmask of a step sent with grammar_mask_follows (its structured_req_ids' rows, in the
    SchedulerOutput's layout), sent once the previous step's tokens have advanced the grammars."""

    step_id: int
    bitmask: bytes


class ControlCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    args: list[Any]
    # False: only rank 0 replies (like execute_model); True: every rank replies.
    all_ranks: bool = True


class Flush(msgspec.Struct, tag="flush", array_like=True):
    """No further step follows for now: rank 0 answers the step it holds back (async scheduling)."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """Start-up: the driver repeats it until every rank has answered READY. A rank answers the first one
    that reaches it, so its subscription to the broadcast is then known to work."""


DriverMessage = ExecuteModel | GrammarMask | ControlCall | Flush | Shutdown | Hello


# Workers -> driver. (Heartbeats are empty frames on a socket of their own, not replies.)
ReplyKind = Literal["output", "result", "error", "ready"]


class WorkerReply(msgspec.Struct, array_like=True):
    rank: int
    # step_id for execute_model, call_id for control calls, -1 for unsolicited messages.
    call_id: int
    kind: ReplyKind
    output: ModelRunnerOutput | None = None
    result: Any = None
    error: str | None = None
    # A ConfigError's message (a checkpoint or config the user must fix): the driver raises it as one.
    config_error: str | None = None


def _layout_digest() -> str:
    """A digest of the layout of every message above (each field, its type and place): msgpack arrays carry
    no field names, so a driver and a worker of different code would read each other's fields wrongly
    without a word. They compare it at start-up (SpawnArgs, and under torchrun across the ranks)."""
    # msgspec's own description of the types: each struct's name, its fields' names, types, defaults and
    # order, its tag and encoding (docstrings left out, so `python -OO` gives the same digest).
    layout = repr(msgspec.inspect.multi_type_info([DriverMessage, WorkerReply]))
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


PROTOCOL = _layout_digest()
