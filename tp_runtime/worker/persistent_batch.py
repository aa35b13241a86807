"""The persistent batch: per-request state kept across steps, one row per live request, on the host (numpy)
and on the device.

Each host column is declared once, as a `Column` attribute of `PersistentBatch` with the value a new
request's row takes; `add()` fills every one of them and `remove()` moves every one, so a new column cannot
be left out of either. The device columns (the token feed, the penalty state) are listed in
`device_columns()` and move in the same place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tp_runtime.messages import NewRequest, RequestSampling, SchedulerOutput
from tp_runtime.sampling_params import GREEDY_EPS
from tp_runtime.worker.inputs import to_device
from tp_runtime.worker.sampler import SamplingBatch


class Column:
    """A per-row array of PersistentBatch, declared as a class attribute: its dtype (`object`: one Python
    value per row) and `value(req)`, what a new request's row holds. A 2-D column also names its row length
    ("max_model_len", "max_blocks") and the column counting the values a row holds from its start (the rest
    is stale: add() writes only the request's values). Each batch's own array, set in __init__, shadows the
    declaration (a descriptor without __set__)."""

    def __init__(
        self,
        dtype: Any,
        value: Callable[[NewRequest], Any],
        width: str | None = None,
        length: str | None = None,
    ) -> None:
        self.dtype = dtype
        self.value = value
        self.width = width
        self.length = length
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: object, owner: type | None = None) -> np.ndarray:
        raise AttributeError(f"PersistentBatch.{self.name} is a column declaration, not an array")


def _greedy(s: RequestSampling) -> bool:
    return s.temperature < GREEDY_EPS


def _penalized(s: RequestSampling) -> bool:
    return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


class PersistentBatch:
    """Per-request state kept on the worker between steps, one row per live request; rows stay dense."""

    token_ids = Column(np.int64, lambda r: r.token_ids, width="max_model_len", length="num_host_tokens")
    num_tokens = Column(np.int64, lambda r: len(r.token_ids))
    # Tokens whose values the host holds (those sent in NewRequest). Only the last sampled token is ever
    # read again (as the next input), and that one is in token_feed.
    num_host_tokens = Column(np.int64, lambda r: len(r.token_ids))
    num_computed = Column(np.int64, lambda r: r.num_computed_tokens)
    num_output = Column(np.int64, lambda r: r.num_output_tokens)
    num_prompt = Column(np.int64, lambda r: len(r.token_ids) - r.num_output_tokens)
    block_table = Column(np.int64, lambda r: r.block_ids, width="max_blocks", length="num_blocks")
    num_blocks = Column(np.int64, lambda r: len(r.block_ids))
    greedy = Column(np.bool_, lambda r: _greedy(r.sampling))
    # A greedy row holds 1.0: never a division by ~0.
    temperature = Column(np.float32, lambda r: 1.0 if _greedy(r.sampling) else r.sampling.temperature)
    top_k = Column(np.int64, lambda r: r.sampling.top_k)
    top_p = Column(np.float32, lambda r: r.sampling.top_p)
    min_p = Column(np.float32, lambda r: r.sampling.min_p)
    has_seed = Column(np.bool_, lambda r: r.sampling.seed is not None)
    seed = Column(np.int64, lambda r: r.sampling.seed or 0)
    min_tokens = Column(np.int64, lambda r: r.sampling.min_tokens)
    stop_tokens = Column(object, lambda r: StopTokens.of(r.sampling))  # None: no stop ids to hold back
    num_logprobs = Column(np.int64, lambda r: r.sampling.num_logprobs)
    # -1 also for a request resumed with outputs: its prompt logprobs were sent in its first pass.
    num_prompt_logprobs = Column(
        np.int64, lambda r: r.sampling.num_prompt_logprobs if r.num_output_tokens == 0 else -1
    )
    penalized = Column(np.bool_, lambda r: _penalized(r.sampling))
    repetition_penalty = Column(np.float32, lambda r: r.sampling.repetition_penalty)
    presence_penalty = Column(np.float32, lambda r: r.sampling.presence_penalty)
    frequency_penalty = Column(np.float32, lambda r: r.sampling.frequency_penalty)
    # logit_bias / allowed_token_ids: None for a request without either.
    token_bias = Column(object, lambda r: TokenBias.of(r.sampling))
    has_token_bias = Column(np.bool_, lambda r: TokenBias.of(r.sampling) is not None)
    bad_words = Column(object, lambda r: BadWords(r.sampling.bad_words) if r.sampling.bad_words else None)
    has_bad_words = Column(np.bool_, lambda r: bool(r.sampling.bad_words))

    @classmethod
    def columns(cls) -> list[Column]:
        return [c for c in vars(cls).values() if isinstance(c, Column)]

    def __init__(
        self, max_rows: int, max_model_len: int, max_blocks: int, vocab_size: int, device: torch.device,
        numpy_feed: bool,
    ) -> None:  # fmt: skip
        self.row_of: dict[int, int] = {}
        self.req_at: list[int] = []
        widths = {"max_model_len": max_model_len, "max_blocks": max_blocks}
        self._columns = self.columns()
        self._object_columns = [c for c in self._columns if c.dtype is object]
        for col in self._columns:
            shape = (max_rows,) if col.width is None else (max_rows, widths[col.width])
            setattr(self, col.name, np.zeros(shape, dtype=col.dtype))
        self.device = device
        self.vocab_size = vocab_size
        # The last token sampled for each row, on the device: the row's next input, so no rank needs its
        # value on the host to launch the next step.
        self.token_feed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # On CPU the same buffer as a numpy view: small torch ops cost ~20 us each there, numpy ~1 us.
        self.feed_np = self.token_feed.numpy() if numpy_feed else None
        # Allocated when the first request that uses a penalty arrives; None until then.
        self.penalties: PenaltyState | None = None
        # Each row's last sampled ids, kept once a request's bad_words need them (multi-token ones).
        self.recent: RecentOutputs | None = None
        # Requests whose prompt logprobs are not all computed yet: empty means no step looks for any.
        self.prompt_logprob_reqs: set[int] = set()

    def update(self, so: SchedulerOutput) -> None:
        """Apply a step's diff: drop freed requests, add new ones, extend block tables."""
        for req_id in so.freed_req_ids:
            self.remove(req_id)
        for req in so.new_requests:
            self.add(req)
        cached = so.cached_requests
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if block_ids:
                self.append_blocks(self.row_of[req_id], block_ids)

    def add(self, req: NewRequest) -> int:
        row = len(self.req_at)
        self.row_of[req.req_id] = row
        self.req_at.append(req.req_id)
        for col in self._columns:
            value = col.value(req)
            if col.width is None:
                getattr(self, col.name)[row] = value
            else:
                getattr(self, col.name)[row, : len(value)] = value
        if self.penalized[row]:
            if self.penalties is None:
                self.penalties = PenaltyState(len(self.token_feed), self.vocab_size, self.device)
            self.penalties.reset_row(row, req, self.device)
        if self.num_prompt_logprobs[row] >= 0:
            self.prompt_logprob_reqs.add(req.req_id)
        words = self.bad_words[row]
        if words is not None and words.width:
            if self.recent is None or self.recent.width < words.width:
                rows = len(self.token_feed)
                self.recent = RecentOutputs.widened(self.recent, rows, words.width, self.device)
            outputs = req.token_ids[len(req.token_ids) - req.num_output_tokens :]
            self.recent.reset_row(row, outputs, self.device)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: int) -> None:
        """Swap-remove: the last row moves into the hole, every column of it, host and device."""
        self.prompt_logprob_reqs.discard(req_id)
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_at) - 1
        if row != last:
            for col in self._columns:
                array = getattr(self, col.name)
                array[row] = array[last]
            for array in self.device_columns(last):
                array[row] = array[last]
            moved = self.req_at[last]
            self.req_at[row] = moved
            self.row_of[moved] = row
        for col in self._object_columns:  # the vacated row lets go of its objects (and their device copies)
            getattr(self, col.name)[last] = None
        self.req_at.pop()
        if self.recent is not None and not self.has_bad_words[: len(self.req_at)].any():
            self.recent = None  # (its width, set by the longest bad word, goes with the last one)

    def device_columns(self, row: int) -> list[np.ndarray | torch.Tensor]:
        """The device arrays whose row `row` holds state, moved with the host columns: the token feed once
        the row has sampled, the penalty state while its request uses a penalty (add() resets it)."""
        columns: list[np.ndarray | torch.Tensor] = []
        if self.num_tokens[row] > self.num_host_tokens[row]:
            columns.append(self.feed_np if self.feed_np is not None else self.token_feed)
        if self.penalties is not None and self.penalized[row]:
            columns += [self.penalties.output_counts, self.penalties.prompt_mask]
        if self.recent is not None and self.has_bad_words[row]:
            columns.append(self.recent.tokens)
        return columns

    def advance(self, scheduled_rows: np.ndarray, num_scheduled: np.ndarray, sample_rows: np.ndarray) -> None:
        """A step's bookkeeping: it needs no sampled value, so it runs while the device computes."""
        self.num_computed[scheduled_rows] += num_scheduled
        self.num_tokens[sample_rows] += 1
        self.num_output[sample_rows] += 1

    def feed(self, rows: np.ndarray, rows_dev: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Keep each row's sampled id on the device, as its next input."""
        if self.feed_np is not None:
            self.feed_np[rows] = token_ids.numpy()
        else:
            self.token_feed.index_copy_(0, rows_dev, token_ids)
        if self.recent is not None:
            self.recent.push(rows_dev, token_ids)


def _device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return to_device(np.asarray(ids, dtype=np.int64), device)


class StopTokens:
    """The ids min_tokens holds back (EOS and stop_token_ids), as a device tensor made on first use and
    kept: the object moves with its row, so steps add no blocking host-to-device copy (which would wait
    for the step's queued forward)."""

    __slots__ = ("_device", "_ids")

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids
        self._device: torch.Tensor | None = None

    @classmethod
    def of(cls, s: RequestSampling) -> StopTokens | None:
        return cls(s.stop_token_ids) if s.stop_token_ids else None

    def __eq__(self, other: object) -> bool:  # by the ids held (the device copy is a cache)
        return isinstance(other, StopTokens) and other._ids == self._ids

    def mask(self, row: torch.Tensor) -> None:
        """In place on one row of float32 logits."""
        if self._device is None:
            self._device = _device_ids(self._ids, row.device)
        row.index_fill_(0, self._device, float("-inf"))


class TokenBias:
    """A request's logit_bias and allowed_token_ids (`apply_token_biases` applies a step's at once). Its
    device tensors are made on first use and kept: the object moves with its row."""

    __slots__ = ("device", "host")

    def __init__(self, ids: list[int], values: list[float], allowed: list[int]) -> None:
        self.host = (ids, values, allowed)
        self.device: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, s: RequestSampling) -> TokenBias | None:
        if not s.logit_bias_ids and not s.allowed_token_ids:
            return None
        return cls(s.logit_bias_ids, s.logit_bias_values, s.allowed_token_ids)

    def __eq__(self, other: object) -> bool:  # by the ids and values held (the device copies are a cache)
        return isinstance(other, TokenBias) and other.host == self.host

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bias ids, their biases, allowed ids) on `device`; empty tensors for what the request lacks."""
        if self.device is None:
            ids, values, allowed = self.host
            biases = to_device(np.asarray(values, dtype=np.float32), device)
            self.device = (_device_ids(ids, device), biases, _device_ids(allowed, device))
        return self.device


class BadWords:
    """A request's bad_words as token sequences, grouped by length: for each length, on the device, the
    sequences' tokens before their last (what the outputs must end with) and their last tokens (what is
    then masked). Made on first use and kept: the object moves with its row."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.host = sequences
        self.width = max(len(ids) for ids in sequences) - 1  # the longest prefix
        self.device: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __eq__(self, other: object) -> bool:  # by the sequences held (the device copies are a cache)
        return isinstance(other, BadWords) and other.host == self.host

    def on(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(prefixes [n, length - 1], last tokens [n]) for each length."""
        if self.device is None:
            by_length: dict[int, list[list[int]]] = {}
            for ids in self.host:
                by_length.setdefault(len(ids), []).append(ids)
            self.device = [
                (to_device(np.asarray([ids[:-1] for ids in group], dtype=np.int64).reshape(len(group), n - 1),
                           device),
                 to_device(np.asarray([ids[-1] for ids in group], dtype=np.int64), device))
                for n, group in sorted(by_length.items())
            ]  # fmt: skip
        return self.device


class RecentOutputs:
    """The last `width` ids each row sampled (-1 before its first ones), on the device, updated from the
    sampled ids there (no host sync): what a request's bad_words prefixes are matched against."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self.width = tokens.shape[1]

    @classmethod
    def widened(
        cls, old: RecentOutputs | None, max_rows: int, width: int, device: torch.device
    ) -> RecentOutputs:
        tokens = torch.full((max_rows, width), -1, dtype=torch.int64, device=device)
        if old is not None:
            tokens[:, width - old.width :] = old.tokens
        return cls(tokens)

    def reset_row(self, row: int, outputs: list[int], device: torch.device) -> None:
        """A request joining the batch: a resumed one (preempted, now recomputed) brings its outputs."""
        values = np.full(self.width, -1, dtype=np.int64)
        kept = outputs[len(outputs) - self.width :] if len(outputs) > self.width else outputs
        if kept:
            values[self.width - len(kept) :] = kept
        self.tokens[row] = to_device(values, device)

    def push(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.tokens[rows] = torch.cat([self.tokens[rows, 1:], token_ids.unsqueeze(1)], dim=1)


def apply_bad_words(
    logits: torch.Tensor, rows: np.ndarray, words: list[BadWords], batch_rows: np.ndarray,
    recent: RecentOutputs | None,
) -> None:  # fmt: skip
    """In place on float32 logits: logits row `rows[i]` (the batch's row `batch_rows[i]`) gets -inf at the
    last token of each of words[i]'s sequences whose other tokens the row's outputs end with (vLLM's
    rule; RecentOutputs holds -1 where a row has no output yet, which no token id matches); no host
    sync."""
    device = logits.device
    row_of, last_ids, penalties = [], [], []
    for row, batch_row, bad in zip(rows.tolist(), batch_rows.tolist(), words, strict=True):
        for prefixes, last in bad.on(device):
            width = prefixes.shape[1]
            blocked = torch.full(last.shape, float("-inf"), dtype=logits.dtype, device=device)
            if width:
                assert recent is not None  # made when the request joined
                outputs = recent.tokens[batch_row, recent.width - width :]
                blocked = blocked.masked_fill(~(prefixes == outputs).all(dim=1), 0.0)
            row_of.append(np.full(len(last), row, dtype=np.int64))
            last_ids.append(last)
            penalties.append(blocked)
    logits.index_put_(
        (to_device(np.concatenate(row_of), device), _joined(last_ids)), _joined(penalties), accumulate=True
    )


def apply_token_biases(logits: torch.Tensor, rows: np.ndarray, biases: list[TokenBias]) -> None:
    """In place on float32 logits, before the penalties (vLLM's order): logits row `rows[i]` keeps only
    biases[i]'s allowed tokens, then gets its logit_bias. A few kernels for the whole step, however many
    rows, and no host sync."""
    device = logits.device
    held = [(row, *bias.on(device)) for row, bias in zip(rows.tolist(), biases, strict=True)]
    allowed = [(row, ids) for row, _, _, ids in held if ids.numel()]
    if allowed:
        row_of, ids = _flattened(allowed, device)
        kept = logits[row_of, ids]
        whole_rows = to_device(np.asarray([row for row, _ in allowed], dtype=np.int64), device)
        logits.index_fill_(0, whole_rows, float("-inf"))
        logits.index_put_((row_of, ids), kept)
    biased = [(row, ids, values) for row, ids, values, _ in held if ids.numel()]
    if biased:
        row_of, ids = _flattened([(row, ids) for row, ids, _ in biased], device)
        values = _joined([values for _, _, values in biased])
        logits.index_put_((row_of, ids), values, accumulate=True)


def _flattened(
    rows_ids: list[tuple[int, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row of each id, the ids) of several rows' id lists, as two flat device tensors."""
    counts = [ids.numel() for _, ids in rows_ids]
    row_of = np.repeat(np.asarray([row for row, _ in rows_ids], dtype=np.int64), counts)
    return to_device(row_of, device), _joined([ids for _, ids in rows_ids])


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class PenaltyState:
    """Per-row token state for penalties, on the device, touched only in steps where a penalized request
    samples: counts of output tokens (updated from the sampled ids on the device, so no host sync) and a
    mask of prompt tokens."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.output_counts = torch.zeros((max_rows, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((max_rows, vocab_size), dtype=torch.bool, device=device)
        self._ones = torch.ones(max_rows, dtype=torch.int32, device=device)

    def reset_row(self, row: int, req: NewRequest, device: torch.device) -> None:
        """The state of a request joining the batch, from its tokens: a resumed request (preempted, now
        recomputed) brings the outputs it already has. Device ops only, no host sync."""
        tokens = to_device(np.asarray(req.token_ids, dtype=np.int64), device)
        num_prompt = len(req.token_ids) - req.num_output_tokens
        self.prompt_mask[row].zero_().index_fill_(0, tokens[:num_prompt], True)
        outputs = tokens[num_prompt:]
        self.output_counts[row].zero_().index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    def for_rows(self, sampling: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
        prompt_mask = None if sampling.repetition_penalty is None else self.prompt_mask[rows]
        return dataclasses.replace(sampling, output_counts=self.output_counts[rows], prompt_mask=prompt_mask)

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add a step's sampled ids to their rows' counts, on the device: the ids never go to the host for
        this, so async scheduling keeps running ahead."""
        self.output_counts.index_put_((rows, token_ids), self._ones[: len(token_ids)], accumulate=True)
