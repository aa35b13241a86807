"""One step's model inputs, built from the persistent batch with vectorised numpy.

A step runs one of three ways, chosen once when its inputs are built. A step the decode graphs can take
gets a `GraphDecodeBatch`: host arrays, one row per token, which `DecodeGraphs.run` packs into its static
buffer with one copy. Decoding sequences are a row each; a short prefill chunk becomes one row per token,
each row a query at its own position over its sequence's blocks (the chunk's keys are all in the cache
before attention runs, so this is causal attention). Another step of few enough tokens for the mixed-step
graphs gets a `MixedStepBatch`: host arrays of its tokens for their static buffer, and the attention
metadata that runs eagerly between their pieces (worker/mixed_graphs.py). Any other step gets an
`EagerBatch` (device tensors and the attention metadata). Tokens are laid out decodes first (attention
batches them), then one prefill chunk per sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tp_runtime.layers.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from tp_runtime.worker.sampler import SamplingBatch, token_seed

if TYPE_CHECKING:
    from tp_runtime.messages import SchedulerOutput
    from tp_runtime.worker.cuda_graphs import DecodeGraphs
    from tp_runtime.worker.mixed_graphs import MixedStepGraphs
    from tp_runtime.worker.persistent_batch import PersistentBatch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t
    # A pageable source is staged by the CUDA driver before the call returns, so the array is free to
    # reuse; pinning a fresh buffer per tensor would cost more than it saves. (Graph decode steps use the
    # graphs' pinned staging buffer instead.)
    return t.to(device, non_blocking=True)


def fed_input_ids(input_ids: torch.Tensor, feed: torch.Tensor, token_feed: torch.Tensor) -> torch.Tensor:
    """Input ids with each row whose `feed` is a batch row (>= 0) replaced by that row's last sampled
    token in `token_feed`, all on the device (the decode graphs use it too)."""
    return torch.where(feed >= 0, token_feed[feed.clamp(min=0)], input_ids)


@dataclass
class EagerBatch:
    """The forward's inputs on the device, one entry per token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # StepInputs.sample_rows on the device (where their sampled ids go)


@dataclass
class MixedStepBatch:
    """A step for the mixed-step graphs: its tokens as host arrays (packed into their static buffer), and
    the metadata of the attention that runs between the pieces (its slot_mapping is the buffer's)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    feed: np.ndarray  # the batch row whose token_feed entry is the input, or -1: input_ids holds it
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # StepInputs.sample_rows on the device


# A prefill chunk's rows on the decode graphs each read their context's keys, so a chunk goes there only
# while its tokens x (context + tokens) stay within this many keys (per KV head): a 128-token prompt, or
# 16 tokens after 1008. Such a chunk run eagerly is bound by the host's kernel launches (about 0.5 ms per
# layer); a longer one is bound by its matmuls either way, and its rows would re-read a long context.
GRAPH_PREFILL_MAX_KEYS = 16384
# And a step with chunks pads to at most this many rows, or to the bucket its decode rows take anyway: the
# graphs it captures are ones decode steps use too, each holding [rows, vocab] logits.
GRAPH_PREFILL_MAX_ROWS = 128


@dataclass
class GraphDecodeBatch:
    """A step for the decode graphs: host arrays, one entry per row, each row one query (a decoding
    sequence, or one token of a short prefill chunk)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray  # at least the blocks each row's sequence uses
    seq_lens: np.ndarray  # the keys each row attends to: its position + 1
    feed: np.ndarray  # the batch row whose token_feed entry is the input, or -1: input_ids holds it
    batch_rows: np.ndarray


@dataclass
class PromptLogprobPlan:
    """The prompt positions whose logprobs a step computes, for requests that asked for prompt_logprobs."""

    token_indices: torch.Tensor  # into the step's tokens (rows of the logits on the decode-graph path)
    targets: torch.Tensor  # the prompt token each of those positions predicts
    chunks: list[tuple[int, int, int, int]]  # per request: (req_id, first position, positions, k)
    max_k: int


@dataclass
class StepInputs:
    model: EagerBatch | GraphDecodeBatch | MixedStepBatch
    # Token index of each row that samples; None when every token samples (nothing to pick).
    logits_indices: torch.Tensor | None
    sample_rows: np.ndarray  # batch rows that sample, in output order
    sampling: SamplingBatch | None  # their sampling settings on the device; None: no row samples
    req_ids: list[int]  # their request ids
    scheduled_rows: np.ndarray  # every row that runs, in step order
    num_scheduled: np.ndarray  # and its number of tokens
    prompt_logprobs: PromptLogprobPlan | None  # None: no position of this step wants them


@dataclass
class _Layout:
    """Where each scheduled sequence's tokens sit in the step (decodes first), host arrays."""

    rows: np.ndarray  # batch row of each sequence
    n: np.ndarray  # its tokens this step
    num_decode: int  # the first num_decode sequences decode (one token each)
    computed: np.ndarray  # its tokens already in the KV cache
    seq_lens: np.ndarray  # computed + n
    starts: np.ndarray  # its token range in the step
    ends: np.ndarray
    token_rows: np.ndarray  # per token: its batch row
    positions: np.ndarray  # per token: its position in the sequence


class InputBuilder:
    """Builds each step's StepInputs from the persistent batch (see the module doc)."""

    def __init__(
        self, batch: PersistentBatch, block_size: int, attention: AttentionBackend,
        sliding_window: int | None, vocab_size: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.batch = batch
        self.block_size = block_size
        self.attention = attention
        self.sliding_window = sliding_window
        self.vocab_size = vocab_size
        self.device = device
        self.decode_graphs: DecodeGraphs | None = None  # set by the runner with the KV cache
        self.mixed_graphs: MixedStepGraphs | None = None  # likewise
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)  # no copy for nothing

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        batch, bs = self.batch, self.block_size
        t = self._layout(so)
        input_ids = batch.token_ids[t.token_rows, t.positions]
        # Tokens past what the host holds were sampled on the device: read them from token_feed there.
        feed = np.where(t.positions >= batch.num_host_tokens[t.token_rows], t.token_rows, -1)
        slots = batch.block_table[t.token_rows, t.positions // bs] * bs + t.positions % bs
        samples = t.seq_lens == batch.num_tokens[t.rows]
        sample_rows = t.rows[samples]
        logits_indices = t.ends[samples] - 1
        req_ids = [batch.req_at[r] for r in sample_rows.tolist()]
        every_token_samples = len(logits_indices) == len(input_ids)
        # Staged on the device before the forward, like everything below.
        sampling = self._sampling_batch(sample_rows, req_ids) if len(sample_rows) else None
        plan = self._plan_prompt_logprobs(t) if batch.prompt_logprob_reqs else None
        model: EagerBatch | GraphDecodeBatch | MixedStepBatch
        graphs, mixed = self.decode_graphs, self.mixed_graphs
        if graphs is not None and self._graphs_take(t, graphs):
            blocks = int(-(-t.seq_lens.max() // bs))
            model = GraphDecodeBatch(
                input_ids=input_ids, positions=t.positions, slots=slots,
                block_tables=batch.block_table[t.token_rows, :blocks], seq_lens=t.positions + 1, feed=feed,
                batch_rows=t.token_rows,
            )  # fmt: skip
        elif mixed is not None and mixed.takes(len(input_ids)):
            model = MixedStepBatch(
                input_ids=input_ids, positions=t.positions, slots=slots, feed=feed,
                meta=self._attention_metadata(t, mixed.slot_mapping(len(input_ids))),
                sample_rows=self._to_device(sample_rows) if len(sample_rows) else self._empty,
            )  # fmt: skip
        else:
            model = EagerBatch(
                meta=self._attention_metadata(t, self._to_device(slots)),
                input_ids=self._fed_input_ids(input_ids, feed),
                positions=self._to_device(t.positions),
                sample_rows=self._to_device(sample_rows) if len(sample_rows) else self._empty,
            )
        return StepInputs(
            model=model,
            logits_indices=None if every_token_samples else self._to_device(logits_indices),
            sample_rows=sample_rows,
            sampling=sampling,
            req_ids=req_ids,
            scheduled_rows=t.rows,
            num_scheduled=t.n,
            prompt_logprobs=plan,
        )

    def _layout(self, so: SchedulerOutput) -> _Layout:
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in so.scheduled_req_ids), dtype=np.int64,
                           count=len(so.scheduled_req_ids))  # fmt: skip
        n = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        if max(so.num_scheduled_tokens) == 1:
            # Pure decode, the common step: one token per sequence, no reordering needed.
            computed = batch.num_computed[rows]
            ends = np.arange(1, len(rows) + 1)
            return _Layout(
                rows=rows, n=n, num_decode=len(rows), computed=computed, seq_lens=computed + 1,
                starts=ends - 1, ends=ends, token_rows=rows, positions=computed,
            )  # fmt: skip
        order = np.argsort(n > 1, kind="stable")
        rows, n = rows[order], n[order]
        computed = batch.num_computed[rows]
        ends = np.cumsum(n)
        starts = ends - n
        token_seq = np.repeat(np.arange(len(rows)), n)
        return _Layout(
            rows=rows, n=n, num_decode=int(np.count_nonzero(n == 1)), computed=computed,
            seq_lens=computed + n, starts=starts, ends=ends, token_rows=rows[token_seq],
            positions=computed[token_seq] + (np.arange(int(ends[-1])) - starts[token_seq]),
        )  # fmt: skip

    def _graphs_take(self, t: _Layout, graphs: DecodeGraphs) -> bool:
        """Whether the step runs on the decode graphs: a pure decode step that fits them, or a step whose
        prefill chunks are short (GRAPH_PREFILL_MAX_KEYS), padded to a bucket that GRAPH_PREFILL_MAX_ROWS
        or its decode rows allow, that leaves its decode rows as many split-KV programs as alone."""
        num_rows = len(t.positions)
        if not graphs.supports(num_rows):
            return False
        if t.num_decode == len(t.rows):
            return True
        chunks = slice(t.num_decode, None)
        if not (t.n[chunks] * t.seq_lens[chunks] <= GRAPH_PREFILL_MAX_KEYS).all():
            return False
        rows, blocks = graphs.padded_shape(num_rows, int(t.seq_lens.max()))
        if not t.num_decode:
            return rows <= GRAPH_PREFILL_MAX_ROWS
        decode_rows, decode_blocks = graphs.padded_shape(t.num_decode, int(t.seq_lens[: t.num_decode].max()))
        if rows > max(GRAPH_PREFILL_MAX_ROWS, decode_rows):
            return False
        # More rows may cut each context into fewer splits: a long decode context would then run on
        # fewer programs than in a step of its own.
        splits = self.attention.num_decode_splits
        return splits(rows, blocks) >= splits(decode_rows, decode_blocks)

    def _attention_metadata(self, t: _Layout, slot_mapping: torch.Tensor) -> AttentionMetadata:
        bs = self.block_size
        prefills = []
        for i in range(t.num_decode, len(t.rows)):
            if t.computed[i] == 0 and self.sliding_window is None:
                table = self._empty  # a fresh prompt attends to its own keys only
            else:
                table = self._to_device(self.batch.block_table[t.rows[i], : -(-t.seq_lens[i] // bs)])
            prefills.append(PrefillChunk(
                start=int(t.starts[i]), end=int(t.ends[i]), context_len=int(t.computed[i]), block_table=table,
            ))  # fmt: skip
        meta = AttentionMetadata(
            backend=self.attention, slot_mapping=slot_mapping, num_decode_tokens=t.num_decode,
            prefills=prefills,
        )  # fmt: skip
        if t.num_decode:
            d_lens = t.seq_lens[: t.num_decode]
            blocks = int(-(-d_lens.max() // bs))
            tables = self.batch.block_table[t.rows[: t.num_decode], :blocks]
            meta.decode_block_tables = self._to_device(tables)
            meta.decode_seq_lens = self._to_device(d_lens)
            meta.decode_num_splits = self.attention.num_decode_splits(t.num_decode, blocks)
        return meta

    def _fed_input_ids(self, input_ids: np.ndarray, feed: np.ndarray) -> torch.Tensor:
        if (feed < 0).all():
            return self._to_device(input_ids)
        feed_np = self.batch.feed_np
        if feed_np is not None:
            return torch.from_numpy(np.where(feed >= 0, feed_np[np.maximum(feed, 0)], input_ids))
        both = self._to_device(np.stack([input_ids, feed]))  # one transfer
        return fed_input_ids(both[0], both[1], self.batch.token_feed)

    def _plan_prompt_logprobs(self, t: _Layout) -> PromptLogprobPlan | None:
        """Which of this step's tokens need prompt logprobs: positions before a prompt's last token (whose
        logits predict the first output) of requests that asked for them."""
        batch = self.batch
        last = batch.num_prompt[t.rows] - 1
        wanted = np.flatnonzero((batch.num_prompt_logprobs[t.rows] >= 0) & (t.computed < last))
        if not len(wanted):
            return None
        indices, targets, chunks = [], [], []
        for i in wanted.tolist():
            row, first = int(t.rows[i]), int(t.computed[i])
            count = min(int(t.n[i]), int(last[i]) - first)
            indices.append(np.arange(t.starts[i], t.starts[i] + count))
            targets.append(batch.token_ids[row, first + 1 : first + 1 + count])
            req_id = batch.req_at[row]
            chunks.append((req_id, first, count, int(batch.num_prompt_logprobs[row])))
            if first + count == last[i]:
                batch.prompt_logprob_reqs.discard(req_id)
        return PromptLogprobPlan(
            token_indices=self._to_device(np.concatenate(indices)),
            targets=self._to_device(np.concatenate(targets)),
            chunks=chunks,
            max_k=max(c[3] for c in chunks),
        )

    def _sampling_batch(self, rows: np.ndarray, req_ids: list[int]) -> SamplingBatch:
        """Sampling settings of `rows`; reused while the same requests sample (every decode step of a
        stable batch), except the per-token seeds, which change every step."""
        key = tuple(req_ids)
        cached = self._sampling_cache
        if cached is None or cached[0] != key:
            cached = self._sampling_cache = (key, self._build_sampling_batch(rows))
        sampling = cached[1]
        if not sampling.row_seeds:
            return sampling
        batch = self.batch
        seeds = {
            i: token_seed(int(batch.seed[rows[i]]), int(batch.num_output[rows[i]]))
            for i in sampling.row_seeds
        }
        return dataclasses.replace(sampling, row_seeds=seeds)

    def _build_sampling_batch(self, rows: np.ndarray) -> SamplingBatch:
        batch = self.batch
        greedy = batch.greedy[rows]
        all_greedy = bool(greedy.all())
        vocab = self.vocab_size

        def maybe(values: np.ndarray, active: np.ndarray) -> torch.Tensor | None:
            return self._to_device(values) if (active & ~greedy).any() else None

        top_k = batch.top_k[rows]
        top_k_used = (top_k > 0) & (top_k < vocab)
        top_p = batch.top_p[rows]
        min_p = batch.min_p[rows]
        seeded = np.flatnonzero(batch.has_seed[rows] & ~greedy)
        row_seeds = {
            int(i): token_seed(int(batch.seed[rows[i]]), int(batch.num_output[rows[i]])) for i in seeded
        }
        penalties: dict[str, torch.Tensor | None] = {}
        if batch.penalized[rows].any():
            for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                  ("frequency_penalty", 0.0)):  # fmt: skip
                values = getattr(batch, name)[rows]
                penalties[name] = self._to_device(values) if (values != neutral).any() else None
        return SamplingBatch(
            temperature=self._to_device(batch.temperature[rows]),
            greedy=self._to_device(greedy),
            all_greedy=all_greedy,
            top_k=None if all_greedy else maybe(np.where(top_k_used, top_k, vocab), top_k_used),
            top_p=None if all_greedy else maybe(top_p, top_p < 1.0),
            min_p=None if all_greedy else maybe(min_p, min_p > 0.0),
            row_seeds=row_seeds,
            max_num_logprobs=int(batch.num_logprobs[rows].max()) if len(rows) else -1,
            **penalties,
        )
