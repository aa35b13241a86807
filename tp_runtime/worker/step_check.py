"""What a worker checks of a step that arrived over the socket before running it.

A frame must carry the engine's MAC to get this far, so only a broken driver sends a bad step; but every
id a step carries becomes an index on the device (block ids into the KV cache, token ids into the
embedding, positions into block tables), where a wrong one is an out-of-bounds write on a GPU or a silent
write into another request's blocks. So a rank refuses such a step (ProtocolError) before any of it
touches its batch or its cache; the socket-fed ranks hold the same state and run the same checks, so they
all refuse the same step before any collective. In-process ranks (TP 1, torchrun's rank 0) take their
steps from the driver's own objects and skip it: under torchrun the other ranks refuse and exit, and rank 0
learns of it from the watchdog or the step timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tp_runtime.config import EngineConfig
from tp_runtime.errors import ProtocolError
from tp_runtime.messages import NewRequest, RequestSampling, SchedulerOutput, first_outside
from tp_runtime.worker.persistent_batch import PersistentBatch

_INT64_MIN, _INT64_END = -(2**63), 2**63


def check_step(
    so: SchedulerOutput, config: EngineConfig, batch: PersistentBatch, num_kv_blocks: int | None
) -> None:
    """ProtocolError naming the step and what is wrong, for a step this rank cannot run safely (see the
    module's doc): ids outside the vocabulary or the cache, requests computing tokens or blocks they do not
    hold, unknown or repeated requests, budgets and sampling values out of range."""
    step = so.step_id

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"step {step} from the driver is refused: {what}")

    if num_kv_blocks is None:
        raise bad("it arrived before the KV cache was allocated")
    model = config.model
    vocab, max_len, block_size = model.vocab_size, model.max_model_len, config.cache.block_size
    max_blocks = -(-max_len // block_size)
    max_logprobs = min(vocab, config.max_logprobs)
    live = batch.row_of
    freed = {r for r in so.freed_req_ids if r in live}
    new: dict[int, NewRequest] = {}
    for req in so.new_requests:
        rid = req.req_id
        if rid in new or (rid in live and rid not in freed):
            raise bad(f"new request {rid} is already on this rank")
        new[rid] = req
        n = len(req.token_ids)
        if not 0 < n <= max_len:
            raise bad(f"new request {rid} has {n} tokens (1 to max_model_len={max_len})")
        token = first_outside(req.token_ids, 0, vocab)
        if token is not None:
            raise bad(f"new request {rid} has token id {token}, outside the vocabulary [0, {vocab})")
        if not 0 <= req.num_output_tokens < n or not 0 <= req.num_computed_tokens <= n:
            raise bad(
                f"new request {rid} has {n} tokens, {req.num_output_tokens} of them outputs and "
                f"{req.num_computed_tokens} computed"
            )
        _check_blocks(bad, rid, req.block_ids, 0, num_kv_blocks, max_blocks)
        _check_sampling(bad, rid, req.sampling, vocab, max_logprobs)
    if len(live) - len(freed) + len(new) > len(batch.token_feed):
        raise bad(f"it would hold more than max_num_seqs={len(batch.token_feed)} requests")

    # Set and numpy operations over the running requests: a decode step of hundreds of them costs tens of
    # microseconds.
    running = live.keys() - freed if freed else live.keys()
    cached = so.cached_requests
    cached_ids, cached_blocks = cached.req_ids, cached.new_block_ids
    if len(cached_ids) != len(cached_blocks):
        raise bad(f"{len(cached_ids)} cached request ids but {len(cached_blocks)} block lists")
    cached_set = set(cached_ids)
    if not cached_set <= running:
        raise bad(f"cached request {min(cached_set - running)} is not running on this rank")
    if len(cached_set) != len(cached_ids):
        raise bad("a cached request is listed twice")
    extra_blocks: dict[int, int] = {}
    if any(cached_blocks):
        for rid, block_ids in zip(cached_ids, cached_blocks, strict=True):
            if block_ids:
                held = int(batch.num_blocks[live[rid]])
                _check_blocks(bad, rid, block_ids, held, num_kv_blocks, max_blocks)
                extra_blocks[rid] = len(block_ids)
    ids, counts = so.scheduled_req_ids, so.num_scheduled_tokens
    if len(ids) != len(counts):
        raise bad(f"{len(ids)} scheduled request ids but {len(counts)} token counts")
    id_set = set(ids)
    if len(id_set) != len(ids):
        raise bad("a request is scheduled twice")
    if counts and (min(counts) < 1 or sum(counts) > config.scheduler.max_num_batched_tokens):
        raise bad(
            f"token counts {counts[:8]} (each at least 1, at most max_num_batched_tokens="
            f"{config.scheduler.max_num_batched_tokens} in all)"
        )
    old_ids, old_counts = ids, counts
    if new and not id_set.isdisjoint(new):
        old_ids, old_counts = [], []
        for rid, count in zip(ids, counts, strict=True):
            if rid in new:
                r = new[rid]
                _check_extent(bad, rid, count, r.num_computed_tokens, len(r.token_ids), len(r.block_ids),
                              block_size)  # fmt: skip
            else:
                old_ids.append(rid)
                old_counts.append(count)
        id_set = set(old_ids)
    if not id_set <= running:
        raise bad(f"scheduled request {min(id_set - running)} is not running on this rank")
    if old_ids:
        rows = np.fromiter(map(live.__getitem__, old_ids), dtype=np.int64, count=len(old_ids))
        blocks = batch.num_blocks[rows]
        if extra_blocks:
            blocks = blocks + np.fromiter((extra_blocks.get(r, 0) for r in old_ids), np.int64, len(old_ids))
        ends = batch.num_computed[rows] + np.asarray(old_counts, dtype=np.int64)
        over = np.flatnonzero(ends > np.minimum(batch.num_tokens[rows], blocks * block_size))
        if len(over):
            i, row = int(over[0]), int(rows[over[0]])
            _check_extent(bad, old_ids[i], old_counts[i], int(batch.num_computed[row]),
                          int(batch.num_tokens[row]), int(blocks[i]), block_size)  # fmt: skip
    structured = so.structured_req_ids
    if len(set(structured)) != len(structured) or not set(structured) <= set(ids):
        raise bad(f"constrained requests {structured[:8]} are not distinct requests of the step")


def _check_extent(
    bad: Callable[[str], ProtocolError], rid: int, count: int, computed: int, tokens: int, blocks: int,
    block_size: int,
) -> None:  # fmt: skip
    """A request computes tokens it holds, in blocks it holds."""
    if computed + count > min(tokens, blocks * block_size):
        raise bad(
            f"request {rid} is to compute {count} tokens after {computed}, past its {tokens} tokens or its "
            f"{blocks} blocks of {block_size}"
        )


def _check_blocks(
    bad: Callable[[str], ProtocolError], rid: int, block_ids: list[int], held: int, num_kv_blocks: int,
    max_blocks: int,
) -> None:  # fmt: skip
    block = first_outside(block_ids, 0, num_kv_blocks)
    if block is not None:
        raise bad(f"request {rid} has block id {block}, outside the KV cache [0, {num_kv_blocks})")
    if held + len(block_ids) > max_blocks:
        total = held + len(block_ids)
        raise bad(f"request {rid} would hold {total} blocks (max_model_len needs at most {max_blocks})")


def _check_sampling(
    bad: Callable[[str], ProtocolError], rid: int, s: RequestSampling, vocab: int, max_logprobs: int
) -> None:
    floats = (s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
    problem = None
    if not all(math.isfinite(v) for v in floats):
        problem = "a sampling setting that is not a finite number"
    elif s.temperature < 0 or not 0 < s.top_p <= 1 or not 0 <= s.min_p <= 1 or s.repetition_penalty <= 0:
        problem = "a sampling setting out of its range"
    elif not 0 <= s.top_k <= vocab:
        problem = f"top_k {s.top_k} (0 to the vocabulary's {vocab})"
    elif not -1 <= s.num_logprobs <= max_logprobs or not -1 <= s.num_prompt_logprobs <= max_logprobs:
        problem = f"logprobs {s.num_logprobs}, prompt logprobs {s.num_prompt_logprobs} (-1 to {max_logprobs})"
    elif not 0 <= s.min_tokens < _INT64_END or (s.seed is not None and not _INT64_MIN <= s.seed < _INT64_END):
        problem = "a seed or min_tokens that does not fit in 64 bits"
    elif (stop := first_outside(s.stop_token_ids, 0, vocab)) is not None:
        problem = f"stop token id {stop}, outside the vocabulary [0, {vocab})"
    elif (token := first_outside(s.logit_bias_ids + s.allowed_token_ids, 0, vocab)) is not None:
        problem = f"logit_bias or allowed token id {token}, outside the vocabulary [0, {vocab})"
    elif len(s.logit_bias_values) != len(s.logit_bias_ids) or not all(
        -100 <= v <= 100 for v in s.logit_bias_values
    ):
        problem = "logit_bias values that do not match its ids or lie outside [-100, 100]"
    elif not all(s.bad_words) or first_outside([t for w in s.bad_words for t in w], 0, vocab) is not None:
        problem = f"bad_words sequences that are empty or hold ids outside the vocabulary [0, {vocab})"
    if problem is not None:
        raise bad(f"new request {rid} has {problem}")
