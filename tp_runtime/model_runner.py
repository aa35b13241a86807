"""One worker's model runner: persistent batch, input preparation, forward, sampling, bookkeeping.

Per step, top to bottom:
  apply the scheduler's diff to the persistent batch -> build inputs with vectorised numpy ->
  forward (TP layers) -> sample -> bookkeeping that needs no token values (counts) -> start the ONE
  device->host copy of the sampled ids (rank 0 only, pinned, non-blocking, with an event).
Penalties and prompt logprobs add work only to steps where a request uses them: per-row token counts
kept on the device (updated from the sampled ids there), and log-softmax over the prompt positions of
prefill chunks, sent back with the sampled ids.
`execute_model` returns a PendingOutput without waiting for the device; `PendingOutput.resolve()` waits for
the copy. Sampled ids also stay on the device (`token_feed`, one slot per batch row) and the next step
reads its input tokens from there, so no rank needs the values on the host to launch the next step: the
host can queue step N+1 while step N still runs (async scheduling), and ranks > 0 never wait at all.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tp_runtime.config import EngineConfig
from tp_runtime.decode_graphs import DecodeGraphs, fed_input_ids
from tp_runtime.layers.attention import AttentionMetadata, PrefillChunk, make_attention_backend
from tp_runtime.messages import (
    Logprobs,
    ModelRunnerOutput,
    NewRequest,
    PromptLogprobs,
    RequestSampling,
    SchedulerOutput,
)
from tp_runtime.sampler import Sampler, SamplerOutput, SamplingBatch, token_seed
from tp_runtime.sampling_params import GREEDY_EPS

if TYPE_CHECKING:  # any model class behind the interface; the runner knows no architecture
    from tp_runtime.models.interface import CausalLM


class PersistentBatch:
    """Per-request state kept on the worker between steps, one row per live request (numpy arrays)."""

    def __init__(self, max_rows: int, max_model_len: int, max_blocks: int) -> None:
        self.row_of: dict[int, int] = {}
        self.req_at: list[int] = []
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)
        # Tokens whose values the host holds (those sent in NewRequest). Only the last sampled token is
        # ever read again (as the next input), and that one is in token_feed.
        self.num_host_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_computed = np.zeros(max_rows, dtype=np.int64)
        self.num_output = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.temperature = np.ones(max_rows, dtype=np.float32)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.top_k = np.zeros(max_rows, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.seed = np.zeros(max_rows, dtype=np.int64)
        self.has_seed = np.zeros(max_rows, dtype=bool)
        self.min_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.num_prompt = np.zeros(max_rows, dtype=np.int64)
        # -1 also for a request resumed with outputs: its prompt logprobs were sent in its first pass.
        self.num_prompt_logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.penalized = np.zeros(max_rows, dtype=bool)
        self.repetition_penalty = np.ones(max_rows, dtype=np.float32)
        self.presence_penalty = np.zeros(max_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_rows, dtype=np.float32)
        self.stop_token_ids: list[list[int]] = [[] for _ in range(max_rows)]
        self._row_arrays: list[np.ndarray] = [
            self.token_ids, self.num_tokens, self.num_host_tokens, self.num_computed, self.num_output,
            self.block_table, self.num_blocks, self.temperature, self.greedy, self.top_k, self.top_p,
            self.min_p, self.seed, self.has_seed, self.min_tokens, self.num_logprobs, self.num_prompt,
            self.num_prompt_logprobs, self.penalized, self.repetition_penalty, self.presence_penalty,
            self.frequency_penalty,
        ]  # fmt: skip

    def add(self, req: NewRequest) -> int:
        row = len(self.req_at)
        self.row_of[req.req_id] = row
        self.req_at.append(req.req_id)
        n = len(req.token_ids)
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_host_tokens[row] = n
        self.num_computed[row] = 0
        self.num_output[row] = req.num_output_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, req.block_ids)
        s: RequestSampling = req.sampling
        self.greedy[row] = s.temperature < GREEDY_EPS
        self.temperature[row] = 1.0 if self.greedy[row] else s.temperature
        self.top_k[row] = s.top_k
        self.top_p[row] = s.top_p
        self.min_p[row] = s.min_p
        self.has_seed[row] = s.seed is not None
        self.seed[row] = s.seed or 0
        self.min_tokens[row] = s.min_tokens
        self.num_logprobs[row] = s.num_logprobs
        self.num_prompt[row] = n - req.num_output_tokens
        self.num_prompt_logprobs[row] = s.num_prompt_logprobs if req.num_output_tokens == 0 else -1
        self.repetition_penalty[row] = s.repetition_penalty
        self.presence_penalty[row] = s.presence_penalty
        self.frequency_penalty[row] = s.frequency_penalty
        self.penalized[row] = (
            s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
        )
        self.stop_token_ids[row] = s.stop_token_ids
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: int) -> tuple[int, int] | None:
        """Swap-remove: the last row moves into the hole so rows stay dense. Returns (to, from) rows of
        the move, if any, so the caller can move its device-side row state too."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        last = len(self.req_at) - 1
        move = None
        if row != last:
            moved = self.req_at[last]
            for arr in self._row_arrays:
                arr[row] = arr[last]
            self.stop_token_ids[row] = self.stop_token_ids[last]
            self.req_at[row] = moved
            self.row_of[moved] = row
            move = (row, last)
        self.req_at.pop()
        return move


@dataclass
class StepInputs:
    # Eager path: device tensors and attention metadata. Decode-graph path: the host arrays instead.
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    graph_inputs: tuple[np.ndarray, ...] | None
    # Token index of each row that samples; None when every token samples (pure decode, nothing to pick).
    logits_indices: torch.Tensor | None
    sample_rows: np.ndarray  # batch rows that sample, in output order
    sampling: SamplingBatch | None  # their sampling settings, staged on the device before the forward
    req_ids: list[int]  # their request ids
    scheduled_rows: np.ndarray
    num_scheduled: np.ndarray
    prompt_logprobs: PromptLogprobPlan | None = None


@dataclass
class PromptLogprobPlan:
    """The prompt positions whose logprobs a step computes, for requests that asked for prompt_logprobs."""

    token_indices: torch.Tensor  # into the step's tokens (rows of the logits on the decode-graph path)
    targets: torch.Tensor  # the prompt token each of those positions predicts
    chunks: list[tuple[int, int, int, int]]  # per request: (req_id, first position, positions, k)
    max_k: int


def pick_kernels(backend: str, device: torch.device) -> str:
    """ "torch" or "triton" for a kernel choice; "auto" is Triton on CUDA when it is installed."""
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    import importlib.util

    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device, rank: int) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.rank = rank
        self.block_size = config.cache.block_size
        mc = config.model
        self.max_blocks = -(-mc.max_model_len // self.block_size)
        self.batch = PersistentBatch(config.scheduler.max_num_seqs, mc.max_model_len, self.max_blocks)
        self.sampler = Sampler(device, config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.sliding_window = mc.sliding_window
        # Benchmark switch (set by a control call): wait for the sampled ids before the bookkeeping, the
        # order this runner replaced.
        self.sync_first = False
        self.collect_timings = False
        self.attention = make_attention_backend(
            config.attention_backend, device, model.num_local_kv_heads, self.block_size
        )
        self._use_cuda = device.type == "cuda"
        # The last token sampled for each batch row, on the device: the next step's input for that row.
        self.token_feed = torch.zeros(config.scheduler.max_num_seqs, dtype=torch.int64, device=device)
        # On CPU the same buffer as a numpy view: small torch ops cost ~20 us each there, numpy ~1 us.
        # cuda_graphs="padded" keeps the device-side feed ops, so CPU tests run the GPU's code path.
        numpy_feed = device.type == "cpu" and config.cuda_graphs != "padded"
        self._feed_np = self.token_feed.numpy() if numpy_feed else None
        self._last_forward_end: torch.cuda.Event | float | None = None
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        self._no_blocks = torch.zeros(0, dtype=torch.int64, device=device)
        # Penalty state per batch row, on the device; allocated when the first request that uses a
        # penalty arrives and touched only in steps where one samples: counts of output tokens (updated
        # from the sampled ids on the device, so no host sync) and a mask of prompt tokens.
        self._output_counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._count_ones: torch.Tensor | None = None
        # Requests whose prompt logprobs are not all computed yet: empty means no step looks for any.
        self._prompt_logprob_reqs: set[int] = set()

    # ----------------------------------------------------------------- KV cache
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        per_layer = 2 * self.block_size * self.model.num_local_kv_heads * self.config.model.head_dim * elem
        return per_layer * self.config.model.num_layers

    def decode_gather_bytes(self) -> int:
        """Keys and values one layer gathers for a full decode batch at max_model_len."""
        per_block_layer = self.kv_bytes_per_block() // self.config.model.num_layers
        return self.config.scheduler.max_num_seqs * self.max_blocks * per_block_layer

    def allocate_kv_cache(self, num_blocks: int) -> None:
        dtype = self.model.dtype
        # One block more than the scheduler owns: the decode graphs' padding rows write into it.
        shape = (num_blocks + 1, self.block_size, self.model.num_local_kv_heads, self.config.model.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(self.config.model.num_layers)
        ]
        mode = self.config.cuda_graphs
        if mode == "auto":
            mode = "capture" if self.device.type == "cuda" else "off"
        self.decode_graphs = None
        if mode != "off":
            self.decode_graphs = DecodeGraphs(
                self._graph_forward, self.block_size, self.config.scheduler.max_num_seqs, self.max_blocks,
                trash_slot=num_blocks * self.block_size,
                device=self.device, capture=mode == "capture", token_feed=self.token_feed,
                attention=self.attention,
            )  # fmt: skip

    def _graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Run the largest prefill a step can hold once and return the peak device memory in bytes."""
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        self.kv_caches = [
            (torch.zeros(1, self.block_size, self.model.num_local_kv_heads, self.config.model.head_dim,
                         dtype=self.model.dtype, device=self.device),) * 2
            for _ in range(self.config.model.num_layers)
        ]  # fmt: skip

        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        slots = positions % self.block_size
        meta = AttentionMetadata(
            backend=self.attention, slot_mapping=slots, num_decode_tokens=0,
            prefills=[PrefillChunk(0, num_tokens, 0, self._no_blocks)],
        )  # fmt: skip
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak)

    # ----------------------------------------------------------------- step
    def _update_batch(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.freed_req_ids:
            self._prompt_logprob_reqs.discard(req_id)
            move = batch.remove(req_id)
            if move is not None:
                to, frm = move
                if self._feed_np is not None:
                    self._feed_np[to] = self._feed_np[frm]
                else:
                    self.token_feed[to] = self.token_feed[frm]
                if batch.penalized[to]:
                    assert self._output_counts is not None and self._prompt_mask is not None
                    self._output_counts[to] = self._output_counts[frm]
                    self._prompt_mask[to] = self._prompt_mask[frm]
        for req in so.new_requests:
            row = batch.add(req)
            if batch.penalized[row]:
                self._init_penalty_row(row, req)
            if batch.num_prompt_logprobs[row] >= 0:
                self._prompt_logprob_reqs.add(req.req_id)
        cached = so.cached_requests
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if block_ids:
                batch.append_blocks(batch.row_of[req_id], block_ids)

    def _init_penalty_row(self, row: int, req: NewRequest) -> None:
        """Penalty state of a request joining the batch, from its tokens: a resumed request (preempted,
        now recomputed) brings the outputs it already has. Device ops only, no host sync."""
        vocab = self.config.model.vocab_size
        if self._output_counts is None:
            rows = self.config.scheduler.max_num_seqs
            self._output_counts = torch.zeros((rows, vocab), dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros((rows, vocab), dtype=torch.bool, device=self.device)
            self._count_ones = torch.ones(rows, dtype=torch.int32, device=self.device)
        assert self._prompt_mask is not None
        tokens = self._to_device(np.asarray(req.token_ids, dtype=np.int64))
        num_prompt = len(req.token_ids) - req.num_output_tokens
        self._prompt_mask[row].zero_().index_fill_(0, tokens[:num_prompt], True)
        outputs = tokens[num_prompt:]
        ones = torch.ones_like(outputs, dtype=torch.int32)
        self._output_counts[row].zero_().index_add_(0, outputs, ones)

    def _with_penalty_state(self, sampling: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
        assert self._output_counts is not None and self._prompt_mask is not None
        prompt_mask = None if sampling.repetition_penalty is None else self._prompt_mask[rows]
        return dataclasses.replace(sampling, output_counts=self._output_counts[rows], prompt_mask=prompt_mask)

    def _count_outputs(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add this step's sampled ids to their rows' counts, on the device: the ids never go to the host
        for this, so async scheduling keeps running ahead."""
        assert self._output_counts is not None and self._count_ones is not None
        self._output_counts.index_put_((rows, token_ids), self._count_ones[: len(token_ids)], accumulate=True)

    def _plan_prompt_logprobs(
        self, rows: np.ndarray, n: np.ndarray, computed: np.ndarray, starts: np.ndarray
    ) -> PromptLogprobPlan | None:
        """Which of this step's tokens need prompt logprobs: positions before a prompt's last token (whose
        logits predict the first output) of requests that asked for them."""
        batch = self.batch
        last = batch.num_prompt[rows] - 1
        wanted = np.flatnonzero((batch.num_prompt_logprobs[rows] >= 0) & (computed < last))
        if not len(wanted):
            return None
        indices, targets, chunks = [], [], []
        for i in wanted.tolist():
            row, first = int(rows[i]), int(computed[i])
            count = min(int(n[i]), int(last[i]) - first)
            indices.append(np.arange(starts[i], starts[i] + count))
            targets.append(batch.token_ids[row, first + 1 : first + 1 + count])
            req_id = batch.req_at[row]
            chunks.append((req_id, first, count, int(batch.num_prompt_logprobs[row])))
            if first + count == last[i]:
                self._prompt_logprob_reqs.discard(req_id)
        return PromptLogprobPlan(
            token_indices=self._to_device(np.concatenate(indices)),
            targets=self._to_device(np.concatenate(targets)),
            chunks=chunks,
            max_k=max(c[3] for c in chunks),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if not self._use_cuda:
            return t
        # Eager-path inputs (graph decode steps use the pinned staging buffer). A pageable source is staged
        # by the CUDA driver before the call returns, so the array is free to reuse; pinning a fresh
        # buffer per tensor would cost more than it saves.
        return t.to(self.device, non_blocking=True)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.batch
        bs = self.block_size
        rows = np.fromiter((batch.row_of[r] for r in so.scheduled_req_ids), dtype=np.int64,
                           count=len(so.scheduled_req_ids))  # fmt: skip
        n = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        if max(so.num_scheduled_tokens) == 1:
            # Pure decode, the common step: one token per sequence, no reordering needed.
            num_decode = len(rows)
            computed = positions = batch.num_computed[rows]
            seq_lens = positions + 1
            ends = np.arange(1, num_decode + 1)
            starts = ends - 1
            token_rows = rows
        else:
            # Decodes first so attention can batch them; prefill chunks follow, one per sequence.
            order = np.argsort(n > 1, kind="stable")
            rows, n = rows[order], n[order]
            num_decode = int(np.count_nonzero(n == 1))
            computed = batch.num_computed[rows]
            seq_lens = computed + n
            ends = np.cumsum(n)
            starts = ends - n
            token_req = np.repeat(np.arange(len(rows)), n)
            positions = computed[token_req] + (np.arange(int(ends[-1])) - starts[token_req])
            token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        # Tokens past what the host holds were sampled on the device: read them from token_feed there.
        feed = np.where(positions >= batch.num_host_tokens[token_rows], token_rows, -1)
        slots = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        samples = seq_lens == batch.num_tokens[rows]
        sample_rows = rows[samples]
        logits_indices = ends[samples] - 1

        req_ids = [batch.req_at[r] for r in sample_rows.tolist()]
        common = dict(
            logits_indices=None if len(logits_indices) == len(input_ids) else self._to_device(logits_indices),
            sample_rows=sample_rows,
            sampling=self._sampling_batch(sample_rows, req_ids) if len(sample_rows) else None,
            req_ids=req_ids,
            scheduled_rows=rows,
            num_scheduled=n,
            prompt_logprobs=(
                self._plan_prompt_logprobs(rows, n, computed, starts) if self._prompt_logprob_reqs else None
            ),
        )
        graphs = self.decode_graphs
        if graphs is not None and num_decode == len(rows) and graphs.supports(num_decode):
            blocks = int(-(-seq_lens.max() // bs))
            return StepInputs(
                input_ids=None, positions=None, meta=None,
                graph_inputs=(
                    input_ids, positions, slots, batch.block_table[rows, :blocks], seq_lens, feed, rows
                ),
                **common,
            )  # fmt: skip
        meta = AttentionMetadata(
            backend=self.attention, slot_mapping=self._to_device(slots), num_decode_tokens=num_decode,
        )  # fmt: skip
        if num_decode:
            d_lens = seq_lens[:num_decode]
            blocks = int(-(-d_lens.max() // bs))
            meta.decode_block_tables = self._to_device(batch.block_table[rows[:num_decode], :blocks])
            meta.decode_seq_lens = self._to_device(d_lens)
            meta.decode_num_splits = self.attention.num_decode_splits(num_decode, blocks)
        for i in range(num_decode, len(rows)):
            if computed[i] == 0 and self.sliding_window is None:
                table = self._no_blocks  # a fresh prompt attends to its own keys only
            else:
                table = self._to_device(batch.block_table[rows[i], : -(-seq_lens[i] // bs)])
            meta.prefills.append(PrefillChunk(int(starts[i]), int(ends[i]), int(computed[i]), table))
        return StepInputs(
            input_ids=self._fed_input_ids(input_ids, feed),
            positions=self._to_device(positions),
            meta=meta,
            graph_inputs=None,
            **common,
        )

    def _fed_input_ids(self, input_ids: np.ndarray, feed: np.ndarray) -> torch.Tensor:
        if (feed < 0).all():
            return self._to_device(input_ids)
        if self._feed_np is not None:
            return torch.from_numpy(np.where(feed >= 0, self._feed_np[np.maximum(feed, 0)], input_ids))
        both = self._to_device(np.stack([input_ids, feed]))  # one transfer
        return fed_input_ids(both[0], both[1], self.token_feed)

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
        vocab = self.config.model.vocab_size

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

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: np.ndarray) -> None:
        """Before min_tokens outputs exist, EOS and stop_token_ids cannot be sampled."""
        batch = self.batch
        pending = np.flatnonzero(batch.num_output[rows] < batch.min_tokens[rows])
        for i in pending.tolist():
            stop_ids = batch.stop_token_ids[rows[i]]
            if stop_ids:
                logits[i, stop_ids] = float("-inf")

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> PendingOutput:
        """Queue one step (inputs, forward, sampling) and return without waiting for the device."""
        timings: dict[str, float] | None = {} if self.collect_timings else None
        t0 = time.perf_counter()
        self._update_batch(so)
        if not so.scheduled_req_ids:
            return PendingOutput(so.step_id, [], None, 0, None, None)
        inputs = self._prepare_inputs(so)
        t_prep = time.perf_counter()
        forward_start = self._now_event(timings)
        rows = inputs.sample_rows
        sampled = None
        plan = inputs.prompt_logprobs
        prompt_logits = None
        if inputs.graph_inputs is not None:
            assert self.decode_graphs is not None
            all_logits = self.decode_graphs.run(*inputs.graph_inputs)
            if plan is not None:  # 1-token prefill chunks ride along as decode rows
                prompt_logits = all_logits[plan.token_indices]
            logits = all_logits if inputs.logits_indices is None else all_logits[inputs.logits_indices]
            graph_rows = self.decode_graphs.batch_rows(len(inputs.scheduled_rows))
            # A 1-token prefill chunk rides along as a decode row but does not sample.
            sample_rows_dev: torch.Tensor | None = (
                graph_rows if inputs.logits_indices is None else graph_rows[inputs.logits_indices]
            )
        else:
            assert inputs.input_ids is not None and inputs.positions is not None and inputs.meta is not None
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if plan is not None:  # every rank: the vocab-parallel head all-gathers
                prompt_logits = self.model.compute_logits(hidden.index_select(0, plan.token_indices))
            if inputs.logits_indices is not None:
                hidden = hidden.index_select(0, inputs.logits_indices)
            logits = self.model.compute_logits(hidden)
            sample_rows_dev = self._to_device(rows) if len(rows) and self._feed_np is None else None
        if len(rows):
            logits = logits.float()
            self._mask_stop_tokens(logits, rows)
            sampling = inputs.sampling
            assert sampling is not None
            penalty_rows = None
            if sampling.penalized:
                penalty_rows = sample_rows_dev if sample_rows_dev is not None else torch.from_numpy(rows)
                sampling = self._with_penalty_state(sampling, penalty_rows)
            sampled = self.sampler(logits, sampling)
            if penalty_rows is not None:
                self._count_outputs(penalty_rows, sampled.token_ids)
            if self._feed_np is not None:
                self._feed_np[rows] = sampled.token_ids.numpy()
            else:
                assert sample_rows_dev is not None
                self.token_feed.index_copy_(0, sample_rows_dev, sampled.token_ids)
        prompt = None
        if plan is not None and self.rank == 0:
            assert prompt_logits is not None
            prompt = (_pack_prompt_logprobs(prompt_logits, plan), plan)
        forward_end = self._now_event(timings)
        t_dispatch = time.perf_counter()

        if self.sync_first:
            # The order this project replaced: wait for the values, then do all bookkeeping.
            transfer = self._start_transfer(sampled, prompt, every_rank=True)
            if transfer is not None:
                transfer.wait()
            t_sync = time.perf_counter()
            self._bookkeeping(inputs)
            t_book = time.perf_counter()
            phases = {"sync_wait": t_sync - t_dispatch, "bookkeeping": t_book - t_sync}
        else:
            # Nothing here needs the sampled values, so it runs while the device computes; only rank 0
            # copies them to the host (the other ranks feed them to the next step on the device).
            self._bookkeeping(inputs)
            t_book = time.perf_counter()
            transfer = self._start_transfer(sampled, prompt, every_rank=False)
            phases = {"bookkeeping": t_book - t_dispatch}
        if timings is not None:
            timings["prepare_inputs"] = t_prep - t0
            timings["forward_dispatch"] = t_dispatch - t_prep
            timings.update(phases)
        pending = PendingOutput(so.step_id, inputs.req_ids, transfer, len(rows), timings, None)
        if timings is not None:
            pending.device_marks = (self._last_forward_end, forward_start, forward_end)
            self._last_forward_end = forward_end
        return pending

    def _now_event(self, timings: dict[str, float] | None) -> torch.cuda.Event | float | None:
        """A point in the step's device timeline: a CUDA event on GPU, wall time on CPU (where the
        forward runs synchronously). None when timings are off."""
        if timings is None:
            return None
        if self._use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _bookkeeping(self, inputs: StepInputs) -> None:
        batch = self.batch
        batch.num_computed[inputs.scheduled_rows] += inputs.num_scheduled
        rows = inputs.sample_rows
        batch.num_tokens[rows] += 1
        batch.num_output[rows] += 1

    def _start_transfer(
        self,
        sampled: SamplerOutput | None,
        prompt: tuple[torch.Tensor, PromptLogprobPlan] | None,
        every_rank: bool,
    ) -> HostTransfer | None:
        """Start the step's device->host copies (one sync): ids, plus logprobs and prompt logprobs on rank
        0 when asked for."""
        if (sampled is None and prompt is None) or (self.rank != 0 and not every_rank):
            return None
        num_logprobs = 0
        values: torch.Tensor | None
        if sampled is None:
            values = None
        elif sampled.logprobs is None or self.rank != 0:
            values = sampled.token_ids
        else:
            assert sampled.logprob_token_ids is not None and sampled.sampled_ranks is not None
            num_logprobs = sampled.logprobs.shape[1]
            # float64 holds every token id exactly, so one packed tensor keeps it to one transfer.
            values = torch.cat(
                [sampled.token_ids.double().unsqueeze(1), sampled.sampled_ranks.double().unsqueeze(1),
                 sampled.logprob_token_ids.double(), sampled.logprobs.double()], dim=1,
            )  # fmt: skip
        prompt_values, plan = prompt if prompt is not None else (None, None)
        if not self._use_cuda:
            return HostTransfer(values, None, num_logprobs, prompt_values, plan)

        def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
            # Pinned memory from torch's caching host allocator: the copy is truly asynchronous, and the
            # block is not reused until the copy that wrote it has completed.
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        host, prompt_host = to_host(values), to_host(prompt_values)
        done = torch.cuda.Event()
        done.record()
        return HostTransfer(host, done, num_logprobs, prompt_host, plan)


def _pack_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobPlan) -> torch.Tensor:
    """Raw-logit logprobs of the planned prompt positions, packed for one copy (float64 holds every id
    exactly): [prompt token, its rank, its logprob, top-k ids, top-k logprobs]."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = plan.targets.unsqueeze(1)
    target_lp = logprobs.gather(1, targets)
    ranks = (logprobs > target_lp).sum(dim=-1, keepdim=True) + 1
    columns = [targets, ranks, target_lp]
    if plan.max_k:
        top_lp, top_ids = logprobs.topk(plan.max_k, dim=-1)
        columns += [top_ids, top_lp]
    return torch.cat([c.double() for c in columns], dim=1)


@dataclass
class HostTransfer:
    """Sampled values on their way to host memory; `done` is None when they are already there (CPU)."""

    host: torch.Tensor | None  # None when nothing sampled (a step of partial prefill chunks)
    done: torch.cuda.Event | None
    num_logprobs: int  # 1 + k columns of logprobs in a packed transfer; 0 for ids only
    prompt: torch.Tensor | None = None  # packed by _pack_prompt_logprobs
    prompt_plan: PromptLogprobPlan | None = None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None

    def ready(self) -> bool:
        return self.done is None or bool(self.done.query())

    def values(self) -> tuple[list[int], Logprobs | None]:
        self.wait()
        if self.host is None:
            return [], None
        if not self.num_logprobs:
            return self.host.tolist(), None
        k = self.num_logprobs
        packed = self.host.tolist()
        return [int(r[0]) for r in packed], Logprobs(
            token_ids=[[int(x) for x in r[2 : 2 + k]] for r in packed],
            logprobs=[r[2 + k :] for r in packed],
            sampled_ranks=[int(r[1]) for r in packed],
        )

    def prompt_logprobs(self) -> list[PromptLogprobs] | None:
        """Per request, trimmed to the k it asked for."""
        if self.prompt is None or self.prompt_plan is None:
            return None
        self.wait()
        packed = self.prompt.tolist()
        width = self.prompt_plan.max_k
        out, i = [], 0
        for req_id, first, count, k in self.prompt_plan.chunks:
            part, i = packed[i : i + count], i + count
            out.append(PromptLogprobs(
                req_id=req_id, start=first,
                token_ids=[[int(r[0]), *(int(x) for x in r[3 : 3 + k])] for r in part],
                logprobs=[[r[2], *r[3 + width : 3 + width + k]] for r in part],
                ranks=[int(r[1]) for r in part],
            ))  # fmt: skip
        return out


@dataclass
class PendingOutput:
    """A queued step's output: `resolve()` waits for its sampled ids (rank 0) and builds the reply."""

    step_id: int
    req_ids: list[int]
    transfer: HostTransfer | None
    num_sampled: int
    timings: dict[str, float] | None
    # (previous step's forward end, this forward's start, its end): CUDA events or wall times.
    device_marks: tuple[Any, Any, Any] | None

    def ready(self) -> bool:
        """True when resolve() would not wait for the device."""
        return self.transfer is None or self.transfer.ready()

    def resolve(self) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        prompt_logprobs = None
        if self.transfer is None:
            if self.num_sampled:
                raise RuntimeError("internal: only rank 0 (or sync_first) copies sampled ids to the host")
            token_ids: list[int] = []
            logprobs = None
        else:
            token_ids, logprobs = self.transfer.values()
            prompt_logprobs = self.transfer.prompt_logprobs()
        timings = self.timings
        if timings is not None:
            timings.setdefault("sync_wait", time.perf_counter() - t0)
            self._device_timings(timings)
        return ModelRunnerOutput(
            step_id=self.step_id,
            req_ids=self.req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            timings=timings,
            prompt_logprobs=prompt_logprobs,
        )

    def _device_timings(self, timings: dict[str, float]) -> None:
        if self.device_marks is None:
            return
        prev_end, start, end = self.device_marks
        if isinstance(start, float):
            # On CPU the forward ran synchronously between the two marks.
            timings["forward_device"] = end - start
            if isinstance(prev_end, float):
                timings["host_gap"] = start - prev_end
            return
        end.synchronize()
        timings["forward_device"] = start.elapsed_time(end) / 1e3
        if prev_end is not None:
            timings["host_gap"] = prev_end.elapsed_time(start) / 1e3
