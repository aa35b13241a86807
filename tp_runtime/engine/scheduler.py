"""Continuous batching over the paged KV cache.

Every request has `num_tokens` tokens (prompt + generated + placeholders, below) of which
`num_computed_tokens` are in the KV cache; each step gives it min(remaining, budget) tokens. A request
samples a new token in the step that computes its last token, so decode, chunked prefill and resumption
after preemption are one rule.
Running requests go first (oldest first), then waiting ones, under `max_num_batched_tokens` and
`max_num_seqs`. When blocks run out the newest running request is preempted: its blocks are freed and it
is recomputed later from its prompt and the tokens generated so far.

A step that samples for a request adds a placeholder token at once, so the next step can be scheduled
before the sampled id is known (async scheduling); `update` fills the placeholder in. A request whose
placeholders already reach max_tokens or max_model_len is not scheduled again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tp_runtime.config import EngineConfig
from tp_runtime.engine.kv_cache import KVCacheManager
from tp_runtime.errors import ProtocolError
from tp_runtime.messages import (
    CachedRequests,
    ModelRunnerOutput,
    NewRequest,
    PromptLogprobs,
    RequestSampling,
    SchedulerOutput,
)
from tp_runtime.outputs import RequestMetrics
from tp_runtime.sampling_params import SamplingParams


@dataclass
class Request:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: RequestSampling
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    stop_text: str | None = None  # output text cut before the stop string
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when it first started (RequestOutput.num_cached_tokens).
    num_cached_tokens: int = 0
    # Logprobs per generated token: (token ids, logprobs, rank of the sampled token).
    logprobs: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    # With prompt_logprobs: one slot per prompt token after the first, filled as prefill chunks compute
    # them (by position: a chunk recomputed after a preemption overwrites its slots).
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None

    # Prompt + generated + placeholders (tokens being sampled in steps not yet answered); a field because
    # the scheduler reads it every step.
    num_tokens: int = 0
    num_placeholders: int = 0
    # Token ids that end the request once min_tokens outputs exist (EOS unless ignore_eos, stop ids).
    stop_ids: frozenset[int] = frozenset()
    # The prompt tokens its output text is decoded after (llm_engine.decode_context).
    decode_context: list[int] = field(default_factory=list)
    # Structured outputs: where the request is in its grammar (engine/structured_output.GrammarState).
    grammar: Any = None
    # What its sampled tokens may not be, where its masks could leave none (llm_engine.TokenMasks).
    masks: Any = None
    # vLLM's cache_salt: its prefix-cache blocks are shared only with requests of the same salt.
    cache_salt: str | None = None
    # When it was added, first scheduled, and got its first token back; its outputs share the object.
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int | float:
        """Outputs after which the request ends (max_tokens=None: none; max_model_len ends it)."""
        limit = self.params.max_tokens
        return math.inf if limit is None else limit


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = config.model.max_model_len
        self.kv = KVCacheManager(num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._freed_since_last_step: list[int] = []
        self._step_id = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.cache_salt is not None:
            self.kv.set_cache_salt(request.req_id, request.cache_salt)
        self.requests[request.req_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.req_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        new_requests: list[NewRequest] = []
        cached_ids: list[int] = []
        cached_blocks: list[list[int]] = []
        freed = self._freed_since_last_step
        self._freed_since_last_step = []
        preempted_now = False

        kv = self.kv
        kv.begin_step()
        block_size = kv.block_size
        held_blocks = kv.blocks
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_placeholders and (
                len(req.output_token_ids) + req.num_placeholders >= req.max_tokens
                or req.num_tokens >= self.max_model_len
            ):
                i += 1  # its last token is being sampled; the request ends when it arrives
                continue
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                n = budget
            target = req.num_computed_tokens + n
            # Most decode steps need no new block: skip the allocator then.
            if target <= len(held_blocks[req.req_id]) * block_size:
                new_blocks: list[int] | None = []
            else:
                new_blocks = kv.allocate_slots(req.req_id, target)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                freed.append(victim.req_id)
                preempted_now = True
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req.req_id, target)
            if new_blocks is None:
                break
            scheduled.append((req, n))
            cached_ids.append(req.req_id)
            cached_blocks.append(new_blocks)
            kv.cache_full_blocks(req.req_id, req.prompt_token_ids, req.output_token_ids, target)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted while a step sampling for it is in flight: resume once its token is in
            # It starts from nothing (new, or preempted): its longest cached prefix, unless it wants the
            # prompt's logprobs, which only computing the prompt gives.
            hit = [] if req.prompt_logprobs is not None else kv.find_cached_prefix(
                req.req_id, req.prompt_token_ids, req.output_token_ids
            )  # fmt: skip
            start = len(hit) * block_size
            n = min(req.num_tokens - start, budget)
            if kv.allocate_slots(req.req_id, start + n, hit) is None:
                break
            req.num_computed_tokens = start
            if not req.num_preemptions:  # the metrics count prompts looked up, once each
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = start
                if req.prompt_logprobs is None:
                    kv.count_lookup(req.num_tokens, start)
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append((req, n))
            new_requests.append(
                NewRequest(
                    req_id=req.req_id,
                    token_ids=req.all_token_ids,
                    num_output_tokens=len(req.output_token_ids),
                    sampling=req.sampling,
                    block_ids=list(kv.blocks[req.req_id]),
                    num_computed_tokens=start,
                )
            )
            # Registered now, so a request admitted after it in this step can share what it computes: in a
            # step every token's keys and values are written before any attends.
            kv.cache_full_blocks(req.req_id, req.prompt_token_ids, req.output_token_ids, start + n)
            budget -= n

        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:  # computes its last token: samples the next
                req.num_tokens += 1
                req.num_placeholders += 1
        self._step_id += 1
        return SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_requests,
            cached_requests=CachedRequests(req_ids=cached_ids, new_block_ids=cached_blocks),
            scheduled_req_ids=[req.req_id for req, _ in scheduled],
            num_scheduled_tokens=[n for _, n in scheduled],
            freed_req_ids=freed,
        )

    def step_failed(self, so: SchedulerOutput) -> None:
        """`so`, the step schedule() gave last, was not sent, or its forward failed: the prefix cache forgets
        the blocks it registered (their keys and values may never have been written), and the requests it
        freed go out again with the next step (a rank that never saw it still holds their rows; freeing an
        id a rank does not hold is a no-op)."""
        self.kv.drop_step_registrations()
        self.return_freed(so.freed_req_ids)

    def return_freed(self, req_ids: list[int]) -> None:
        """Freed ids of a step that was not sent (nothing to run): they go out with the next one."""
        self._freed_since_last_step[:0] = req_ids

    def update(self, output: ModelRunnerOutput) -> list[Request]:
        """Fill each sampled token into its request's placeholder; returns the requests that got one."""
        updated = []
        lp = output.logprobs
        requests = self.requests
        for i, (req_id, token) in enumerate(zip(output.req_ids, output.sampled_token_ids, strict=True)):
            req = requests.get(req_id)
            if req is None:
                continue  # finished (a stop in the step before) while this step was in flight
            req.output_token_ids.append(token)
            req.num_placeholders -= 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.monotonic()
            if lp is not None and req.sampling.num_logprobs >= 0:
                k = req.sampling.num_logprobs
                req.logprobs.append((lp.token_ids[i][: 1 + k], lp.logprobs[i][: 1 + k], lp.sampled_ranks[i]))
            updated.append(req)
        if output.prompt_logprobs:
            for chunk in output.prompt_logprobs:
                self._store_prompt_logprobs(chunk)
        return updated

    def _store_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        req = self.requests.get(chunk.req_id)
        if req is None:
            return  # aborted while the step was in flight
        slots = req.prompt_logprobs
        count = len(chunk.ranks)
        if (
            slots is None
            or not 0 <= chunk.start <= chunk.start + count <= len(slots)
            or not len(chunk.token_ids) == len(chunk.logprobs) == count
        ):
            raise ProtocolError(
                f"prompt logprobs for request {chunk.req_id} at positions {chunk.start}..+{count} do not fit "
                "its prompt"
            )
        for i, (ids, lps, rank) in enumerate(zip(chunk.token_ids, chunk.logprobs, chunk.ranks, strict=True)):
            slots[chunk.start + i] = (ids, lps, rank)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        kv = self.kv
        kv.cache_full_blocks(
            request.req_id, request.prompt_token_ids, request.output_token_ids, request.num_computed_tokens
        )
        kv.forget(request.req_id)
        self.requests.pop(request.req_id, None)
        if request in self.running:
            self.running.remove(request)
            self._freed_since_last_step.append(request.req_id)
        elif request in self.waiting:
            self.waiting.remove(request)
