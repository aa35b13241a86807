"""Token sampling: penalties, greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs.

Penalties (vLLM's semantics) apply to the raw logits first: repetition (tokens of the prompt or the output
so far: positive logits divided, others multiplied), then frequency (minus penalty x count in the output)
and presence (minus penalty if in the output). Logprobs are always those of the raw logits.
Filters then apply in this order, each to the distribution left by the previous one:
temperature -> min_p (drop tokens with p < min_p * p_max) -> top_k (keep the k most likely, and any tied
with the k-th) -> top_p (keep the shortest most-likely-first prefix whose probability mass reaches top_p).

A draw uses the exponential race: argmax p_i / E_i with E_i = -log U_i ~ Exp(1), which samples exactly
from p, computed as argmax s_i - log E_i over the scores s = log p + const (logits / temperature, or the
filtered scores), so no softmax is needed. A seeded request draws its noise from a generator seeded by
(seed, index of the token being generated), so its samples depend on nothing else in the batch, on
preemption, or on the TP size. Every rank holds the same full logits and runs the same ops, so every rank
samples the same tokens. With the fused kernels the two argmaxes are Triton kernels (sampling_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK_62 = (1 << 62) - 1


def token_seed(seed: int, output_index: int) -> int:
    """A per-(request seed, token index) generator seed; mixing keeps nearby seeds uncorrelated."""
    h = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK_62
    h ^= h >> 31
    return (h * 0xD6E8FEB86659FD93) & _MASK_62


@dataclass
class SamplingBatch:
    """Per-row sampling settings for the rows that sample this step (tensors on the logits' device)."""

    temperature: torch.Tensor  # [rows] float32; greedy rows hold 1.0 and are listed in greedy
    greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [rows] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [rows] float32, 0.0 where disabled
    # row -> generator seed for this token (seeded requests); other rows use the engine's generator.
    row_seeds: dict[int, int]
    max_num_logprobs: int  # -1: no row wants logprobs
    # Penalties: [rows] float32, neutral where a row does not use one; None when no row does.
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    # The rows' token state for this step, set by the runner when penalties are on: [rows, vocab] int32
    # counts of output tokens, and (for repetition) a bool mask of prompt tokens.
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None

    @property
    def penalized(self) -> bool:
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        return any(p is not None for p in penalties)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    # Only when some row asked for logprobs: [rows, 1 + k] ids and logprobs (sampled token first), ranks.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's repetition, frequency and presence penalties (see the module doc); out of place."""
    counts = batch.output_counts
    assert counts is not None
    in_output = counts > 0
    if batch.repetition_penalty is not None:
        assert batch.prompt_mask is not None
        seen = in_output | batch.prompt_mask
        rep = torch.where(seen, batch.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty.unsqueeze(1) * in_output
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature and min-p/top-k/top-p filtering; removed tokens get -inf. logits: [rows, vocab] fp32."""
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if batch.top_k is not None:
        # Keep every token at least as likely as the k-th (HF's and vLLM's rule): of tokens tied with it,
        # the sort's order would otherwise pick some, by accident of its implementation.
        kth = sorted_logits.gather(1, (batch.top_k.unsqueeze(1) - 1).clamp(max=logits.shape[1] - 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if batch.top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = batch.top_p.unsqueeze(1)
        # Rows with top_p=1 keep everything, even where float cumsum reaches 1 before the tail.
        remove = (mass_before >= top_p) & (top_p < 1.0)
        remove[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def race_argmax(
    logits: torch.Tensor,
    greedy: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens: argmax(logits) per row, or with uniform `noise` the race winners argmax(s - log(-log U))
    (s: `scores`, or logits / `temperature`) except in `greedy` rows. PyTorch ops; sampling_triton.py has
    the same as two Triton kernels (same signature)."""
    greedy_ids = logits.argmax(dim=-1)
    if noise is None:
        return greedy_ids
    assert greedy is not None
    if scores is None:
        assert temperature is not None
        scores = logits / temperature.unsqueeze(1)
    sampled = (scores - noise.log_().neg_().log_()).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


class Sampler:
    def __init__(self, device: torch.device, seed: int, fused: bool = False) -> None:
        """`fused`: the final argmaxes as Triton kernels (CUDA)."""
        self._device = device
        self._engine_generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)
        self._race_argmax = race_argmax
        if fused:
            from tp_runtime.worker import sampling_triton

            self._race_argmax = sampling_triton.race_argmax

    def warm_up(self, vocab_size: int) -> None:
        """Run each variant of the final argmax once (greedy, temperature, filtered scores): as Triton
        kernels each is compiled on first use, which the first requests would otherwise wait for."""
        logits = torch.zeros((2, vocab_size), dtype=torch.float32, device=self._device)
        noise = torch.full_like(logits, 0.5)
        greedy = torch.tensor([True, False], device=self._device)
        temperature = torch.ones(2, dtype=torch.float32, device=self._device)
        self._race_argmax(logits)
        self._race_argmax(logits, greedy, noise, temperature, None)
        self._race_argmax(logits, greedy, noise, temperature, logits.clone())

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, raw: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample from `logits`; logprobs are those of `raw` (the model's logits before any masking; by
        default `logits`)."""
        logits = logits.float()
        raw = logits if raw is None else raw.float()
        if batch.output_counts is not None:
            logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            token_ids = self._race_argmax(logits)
        else:
            filtered = batch.min_p is not None or batch.top_k is not None or batch.top_p is not None
            # Uniform noise; E = -log(U) is Exp(1), the same law as exponential_(), and faster on CPU.
            # float32 whatever the host's default dtype (rank 0 may run in the host program's process).
            shape, device = logits.shape, logits.device
            noise = torch.rand(shape, generator=self._engine_generator, device=device, dtype=torch.float32)
            for row, seed in batch.row_seeds.items():
                self._row_generator.manual_seed(seed)
                noise[row] = torch.rand(
                    shape[1], generator=self._row_generator, device=device, dtype=torch.float32
                )
            scores = filter_logits(logits, batch) if filtered else None  # else logits / temperature
            token_ids = self._race_argmax(logits, batch.greedy, noise, batch.temperature, scores)
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_num_logprobs >= 0:
            # Logprobs of the raw model distribution (before temperature and filtering), as vLLM returns.
            logprobs = raw.log_softmax(dim=-1)
            sampled_lp = logprobs.gather(1, token_ids.unsqueeze(1))
            top_lp, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
            out.logprob_token_ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
            # vLLM's rank: the tokens at least as likely (ties rank the sampled token last among them,
            # after the top-k entries it ties with, which take ranks 1..k in order).
            out.sampled_ranks = (logprobs >= sampled_lp).sum(dim=-1)
        return out
