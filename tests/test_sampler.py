"""The sampler against an independent float64 brute-force reference.

`filter_logits` must keep exactly the token set of the documented rule:
temperature -> min_p (drop p < min_p * p_max) -> top_k (keep the k most likely) -> top_p (keep the shortest
most-likely-first prefix whose mass reaches top_p, on the distribution left after top_k; the top token is
always kept). Test rows are drawn so that no probability lies within a relative 1e-4 of any threshold, so
float32 (engine) vs float64 (reference) rounding cannot flip a decision.

`Sampler` draws are checked with a chi-square goodness-of-fit test (fixed seeds, p-value threshold 1e-4).
scipy is not a dependency, so the chi-square survival function is computed in closed form (exact for the
integer degrees of freedom used), checked against textbook quantiles, the Wilson–Hilferty approximation
and, when scipy happens to be installed, scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tp_runtime.worker.sampler import Sampler, SamplingBatch, filter_logits, token_seed

CPU = torch.device("cpu")
MARGIN = 1e-4  # relative distance every probability keeps from every filter threshold


@dataclass(frozen=True)
class Setting:
    temperature: float = 1.0
    min_p: float = 0.0  # 0: disabled
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0  # 1: disabled


# ----------------------------------------------------------------------------- reference (float64)
def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_keep(logits: np.ndarray, s: Setting) -> tuple[np.ndarray, float]:
    """The kept-token mask of the documented rule, and the smallest relative margin to any threshold."""
    v = logits.shape[0]
    p = _softmax(logits.astype(np.float64) / s.temperature)
    order = sorted(range(v), key=lambda i: -p[i])  # most likely first
    keep = np.ones(v, dtype=bool)
    margin = math.inf
    if s.min_p > 0:
        threshold = s.min_p * p.max()
        keep &= p >= threshold
        margin = min(margin, float(np.min(np.abs(p - threshold))) / p.max())
    if 0 < s.top_k < v:
        ranked = [i for i in order if keep[i]]
        if len(ranked) > s.top_k:
            # The k-th and (k+1)-th most likely must not (nearly) tie.
            margin = min(margin, (p[ranked[s.top_k - 1]] - p[ranked[s.top_k]]) / p.max())
        for i in ranked[s.top_k :]:
            keep[i] = False
    if s.top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        ranked = [i for i in order if keep[i]]
        kept = np.zeros(v, dtype=bool)
        mass_before = 0.0
        for n, i in enumerate(ranked):
            if n > 0:  # the first token is always kept; every later one decides on mass_before
                margin = min(margin, abs(mass_before - s.top_p))
                if mass_before >= s.top_p:
                    break
            kept[i] = True
            mass_before += q[i]
        keep = kept
    return keep, margin


def reference_probs(logits: np.ndarray, s: Setting) -> tuple[np.ndarray, np.ndarray]:
    keep, _ = reference_keep(logits, s)
    p = _softmax(logits.astype(np.float64) / s.temperature)
    p = np.where(keep, p, 0.0)
    return p / p.sum(), keep


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), integer df, in closed form (no scipy needed):
    even df = 2m: exp(-x/2) * sum_{i<m} (x/2)^i / i!;
    odd df = 2m+1: erfc(sqrt(x/2)) + exp(-x/2) * sum_{i=1..m} (x/2)^(i-1/2) / Gamma(i+1/2)."""
    h = x / 2.0
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(
        h ** (i - 0.5) / math.gamma(i + 0.5) for i in range(1, (df - 1) // 2 + 1)
    )


def wilson_hilferty_sf(x: float, df: int) -> float:
    a = 2.0 / (9.0 * df)
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - a)) / math.sqrt(a)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def test_chi2_sf_is_sound() -> None:
    # Textbook upper-tail quantiles: (df, x, tail probability).
    for df, x, tail in [(1, 3.841, 0.05), (2, 5.991, 0.05), (10, 18.307, 0.05), (10, 35.564, 1e-4),
                        (19, 30.144, 0.05), (19, 43.820, 1e-3), (5, 25.745, 1e-4)]:  # fmt: skip
        assert chi2_sf(x, df) == pytest.approx(tail, rel=2e-3), (df, x)
        assert wilson_hilferty_sf(x, df) == pytest.approx(tail, rel=0.35), (df, x)  # rough cross-check
    try:
        from scipy.stats import chi2  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return
    for df in range(1, 25):
        for x in (0.5, 3.0, 10.0, 30.0, 60.0):
            assert chi2_sf(x, df) == pytest.approx(float(chi2.sf(x, df)), rel=1e-9, abs=1e-15)


# ----------------------------------------------------------------------------- batch helpers
def make_batch(
    settings: list[Setting],
    vocab: int,
    greedy: list[bool] | None = None,
    row_seeds: dict[int, int] | None = None,
    force_filters: bool = False,
) -> SamplingBatch:
    """A SamplingBatch shaped as the model runner builds it: a filter tensor only if some row uses it
    (or always, with force_filters), with the 'disabled' value (vocab / 1.0 / 0.0) in other rows."""
    rows = len(settings)
    greedy = greedy or [False] * rows
    top_k_used = any(0 < s.top_k < vocab for s in settings) or force_filters
    top_p_used = any(s.top_p < 1.0 for s in settings) or force_filters
    min_p_used = any(s.min_p > 0.0 for s in settings) or force_filters
    return SamplingBatch(
        temperature=torch.tensor(
            [1.0 if g else s.temperature for s, g in zip(settings, greedy, strict=True)]
        ),
        greedy=torch.tensor(greedy, dtype=torch.bool),
        all_greedy=all(greedy),
        top_k=torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in settings], dtype=torch.int64)
        if top_k_used
        else None,
        top_p=torch.tensor([s.top_p for s in settings], dtype=torch.float32) if top_p_used else None,
        min_p=torch.tensor([s.min_p for s in settings], dtype=torch.float32) if min_p_used else None,
        row_seeds=dict(row_seeds or {}),
        max_num_logprobs=-1,
    )


def logits_with_margin(s: Setting, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random float32 logits whose reference decisions are all at least MARGIN from a threshold."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(1000):
        row = torch.randn(vocab, generator=g) * scale
        _, margin = reference_keep(row.numpy(), s)
        if margin > MARGIN:
            return row
    raise AssertionError(f"no logits with margin for {s}")


FILTER_SETTINGS = [
    Setting(),
    Setting(temperature=0.5),
    Setting(temperature=1.7),
    Setting(min_p=0.05),
    Setting(min_p=0.3, temperature=0.8),
    Setting(top_k=1),
    Setting(top_k=5),
    Setting(top_k=17, temperature=1.3),
    Setting(top_p=0.1),
    Setting(top_p=0.5),
    Setting(top_p=0.9, temperature=0.7),
    Setting(min_p=0.1, top_k=8),
    Setting(min_p=0.02, top_p=0.6),
    Setting(top_k=10, top_p=0.7),
    Setting(min_p=0.05, top_k=12, top_p=0.8, temperature=1.4),
    Setting(min_p=0.5, top_k=3, top_p=0.95, temperature=0.6),
    Setting(min_p=0.2, top_k=30, top_p=0.99),  # top_k larger than what min_p leaves
]


def check_filtered(logits: torch.Tensor, settings: list[Setting], batch: SamplingBatch) -> None:
    out = filter_logits(logits.clone(), batch)
    assert out.shape == logits.shape and out.dtype == torch.float32
    for r, s in enumerate(settings):
        want, _ = reference_keep(logits[r].numpy(), s)
        got = torch.isfinite(out[r]).numpy()
        assert (got == want).all(), (
            f"row {r} {s}: kept {np.flatnonzero(got).tolist()}, rule keeps {np.flatnonzero(want).tolist()}"
        )
        assert (out[r][~torch.from_numpy(want)] == float("-inf")).all()
        # Kept tokens carry the temperature-scaled logits unchanged.
        torch.testing.assert_close(out[r][torch.from_numpy(want)], (logits[r] / s.temperature)[want])


@pytest.mark.parametrize("vocab", [7, 50])
def test_filter_logits_matches_reference_mixed_batch(vocab: int) -> None:
    """Every setting as a row of one batch (each filter tensor present, 'disabled' in other rows)."""
    settings = [s for s in FILTER_SETTINGS for _ in range(4)]
    logits = torch.stack(
        [logits_with_margin(s, vocab, seed=1000 * vocab + i) for i, s in enumerate(settings)]
    )
    check_filtered(logits, settings, make_batch(settings, vocab))


@pytest.mark.parametrize("setting", FILTER_SETTINGS, ids=str)
def test_filter_logits_matches_reference_single_setting(setting: Setting) -> None:
    """Each setting alone: only the filter tensors that setting uses exist (the others are None)."""
    vocab = 40
    settings = [setting] * 6
    logits = torch.stack([logits_with_margin(setting, vocab, seed=77 + i) for i in range(6)])
    check_filtered(logits, settings, make_batch(settings, vocab))


def test_filter_logits_keeps_top_token_and_exact_prefix() -> None:
    """Hand-computed cases: p = [0.5, 0.3, 0.15, 0.05]."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(5, 1)
    settings = [
        Setting(top_p=0.01),  # only the top token, however small top_p is
        Setting(top_p=0.49),  # the top token's 0.5 already reaches it
        Setting(top_p=0.79),  # 0.5 + 0.3 = 0.8 >= 0.79 -> two tokens
        Setting(top_p=0.81),  # needs the third token
        Setting(min_p=0.2, top_p=0.9),  # min_p drops 0.05 (< 0.1); renormalised, 0.5/0.95 + 0.3/0.95 < 0.9
    ]
    out = filter_logits(logits, make_batch(settings, 4))
    kept = [torch.isfinite(row).nonzero().flatten().tolist() for row in out]
    assert kept == [[0], [0], [0, 1], [0, 1, 2], [0, 1, 2]]


def test_filter_logits_exact_ties_follow_the_rule() -> None:
    """Uniform logits give probabilities that are exact in float32 (0.25 each), so the rule's boundary
    cases are well defined: min_p drops only p < min_p * p_max (equality is kept), and top_p keeps the
    shortest prefix whose mass reaches top_p (mass exactly top_p is enough)."""
    logits = torch.zeros(4, 4)
    settings = [Setting(min_p=1.0), Setting(top_p=0.5), Setting(top_p=0.75), Setting(top_p=0.25, top_k=3)]
    out = filter_logits(logits, make_batch(settings, 4))
    assert torch.isfinite(out).sum(-1).tolist() == [4, 2, 3, 1]


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """Tokens tied with the k-th most likely are all kept, as HF's TopKLogitsWarper and vLLM keep them (a
    tie is common with bf16 logits): "the k most likely" names no one of them, and which one a sort puts
    first is an accident of its implementation. The reference is HF's warper."""
    from transformers import TopKLogitsWarper

    logits = torch.tensor([
        [3.0, 1.0, 3.0, 0.5, 2.0, 2.0],  # tie at the top: k=1 keeps both
        [0.0, 2.0, 1.0, 1.0, 1.0, -1.0],  # three-way tie for 2nd-4th: k=2 and k=3 keep all four
        [0.0, 2.0, 1.0, 1.0, 1.0, -1.0],
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # no tie: exactly k
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all tied, with a top_p row beside (the sort path)
    ])
    settings = [Setting(top_k=1), Setting(top_k=2), Setting(top_k=3, temperature=0.5), Setting(top_k=2),
                Setting(top_k=2)]  # fmt: skip
    for batch in (make_batch(settings, 6), make_batch(settings, 6, force_filters=True)):
        out = filter_logits(logits.clone(), batch)
        for r, s in enumerate(settings):
            want = TopKLogitsWarper(top_k=s.top_k)(None, logits[r : r + 1] / s.temperature)[0]
            assert torch.isfinite(out[r]).tolist() == torch.isfinite(want).tolist(), f"row {r}: {out[r]}"
            torch.testing.assert_close(out[r], want)


def test_top_p_one_is_a_no_op_in_a_mixed_batch() -> None:
    """A row with top_p=1.0 (disabled; the runner fills 1.0 when another row in the batch uses top_p)
    must keep every token: the rule's shortest prefix reaching mass 1.0 is the whole vocabulary.

    Large vocabularies with a long low-probability tail make the float32 cumsum reach 1.0 before the tail
    ends, and the sampler then drops tail tokens from a request that never asked for top_p."""
    vocab = 32000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 4.0
    settings = [Setting(), Setting(temperature=0.9), Setting(), Setting(top_p=0.5)]
    out = filter_logits(logits, make_batch(settings, vocab))
    for r in range(3):
        dropped = (~torch.isfinite(out[r])).sum().item()
        mass = (
            (logits[r].double() / settings[r].temperature).softmax(-1)[~torch.isfinite(out[r])].sum().item()
        )
        assert dropped == 0, f"row {r} (top_p=1.0) lost {dropped} tokens carrying probability {mass:.3g}"


def test_all_filters_disabled_returns_scaled_logits() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(5))
    settings = [Setting(temperature=t) for t in (0.5, 1.0, 2.0)]
    batch = make_batch(settings, 11)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    out = filter_logits(logits, batch)
    torch.testing.assert_close(out, logits / torch.tensor([[0.5], [1.0], [2.0]]))


# ----------------------------------------------------------------------------- sampling statistics
VOCAB = 20
ROWS = 20000
P_MIN = 1e-4

STAT_SETTINGS = [
    Setting(),
    Setting(temperature=0.8, top_k=6),
    Setting(temperature=1.5, min_p=0.1, top_p=0.7),
    Setting(temperature=1.2, min_p=0.02, top_k=10, top_p=0.9),
    Setting(temperature=0.6, top_p=0.95),
]


def stat_logits(s: Setting, seed: int) -> torch.Tensor:
    row = logits_with_margin(s, VOCAB, seed=seed)
    probs, keep = reference_probs(row.numpy(), s)
    assert keep.sum() >= 3, "pick logits that leave several tokens, so the test has power"
    assert probs[keep].min() * ROWS >= 20, "every kept token needs a sizeable expected count"
    return row


def assert_matches(tokens: torch.Tensor, row: torch.Tensor, s: Setting) -> None:
    probs, keep = reference_probs(row.numpy(), s)
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    outside = np.flatnonzero((counts > 0) & ~keep)
    assert outside.size == 0, f"{s}: sampled filtered-out tokens {outside.tolist()}"
    expected = probs[keep] * len(tokens)
    observed = counts[keep]
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    p_value = chi2_sf(stat, df)
    assert p_value > P_MIN, (
        f"{s}: chi2={stat:.1f} df={df} p={p_value:.2e}; observed {observed}, expected {expected}"
    )


@pytest.mark.parametrize("setting", STAT_SETTINGS, ids=str)
def test_sampler_frequencies_match_filtered_distribution(setting: Setting) -> None:
    row = stat_logits(setting, seed=4242)
    logits = row.unsqueeze(0).repeat(ROWS, 1)
    sampler = Sampler(CPU, seed=1234)
    out = sampler(logits, make_batch([setting] * ROWS, VOCAB))
    assert out.token_ids.shape == (ROWS,) and out.token_ids.dtype == torch.int64
    assert_matches(out.token_ids, row, setting)


def test_seeded_rows_follow_the_filtered_distribution() -> None:
    """Per-request seeded rows (one seed per row, as token_seed gives them) draw from the same law."""
    setting = Setting(temperature=1.1, min_p=0.03, top_k=12, top_p=0.85)
    row = stat_logits(setting, seed=99)
    logits = row.unsqueeze(0).repeat(ROWS, 1)
    seeds = {i: token_seed(7, i) for i in range(ROWS)}
    out = Sampler(CPU, seed=0)(logits, make_batch([setting] * ROWS, VOCAB, row_seeds=seeds))
    assert_matches(out.token_ids, row, setting)


def test_greedy_rows_return_argmax() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, VOCAB, generator=g) * 3
    settings = [Setting(temperature=1.5, top_k=5, top_p=0.5, min_p=0.2) for _ in range(64)]
    greedy = [i % 3 == 0 for i in range(64)]
    out = Sampler(CPU, seed=0)(logits, make_batch(settings, VOCAB, greedy=greedy, row_seeds={0: 5, 1: 6}))
    argmax = logits.argmax(-1)
    mask = torch.tensor(greedy)
    assert torch.equal(out.token_ids[mask], argmax[mask])
    # The non-greedy rows do sample (with these settings some differ from argmax).
    assert not torch.equal(out.token_ids[~mask], argmax[~mask])

    all_greedy = make_batch([Setting()] * 64, VOCAB, greedy=[True] * 64)
    assert all_greedy.all_greedy
    assert torch.equal(Sampler(CPU, seed=1)(logits, all_greedy).token_ids, argmax)


def test_same_row_seed_draws_same_token_whatever_else_is_in_the_batch() -> None:
    g = torch.Generator().manual_seed(11)
    target = torch.randn(VOCAB, generator=g)
    s = Setting(temperature=1.3)  # wide distribution: a draw depends strongly on the noise
    for k, seed_value in enumerate([token_seed(123, 0), token_seed(123, 1), token_seed(9, 40), 0, 2**61]):
        draws = []
        for layout in range(4):
            other = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(100 * k + layout)) * 2
            pos = layout  # the seeded row sits at a different position each time
            logits = torch.cat([other[:pos], target.unsqueeze(0), other[pos:]])
            others = [
                Setting(temperature=0.7, top_k=4),
                Setting(top_p=0.5),
                Setting(min_p=0.2),
                Setting(),
                Setting(temperature=2.0),
            ]
            settings = [*others[:pos], s, *others[pos:]]
            seeds = {pos: seed_value}
            if layout % 2:  # other seeded rows, and a different engine seed, must not matter either
                seeds[(pos + 1) % 6] = token_seed(555, layout)
            sampler = Sampler(CPU, seed=layout * 1000)
            sampler(torch.randn(3, VOCAB), make_batch([Setting()] * 3, VOCAB))  # advance the engine generator
            draws.append(int(sampler(logits, make_batch(settings, VOCAB, row_seeds=seeds)).token_ids[pos]))
        assert len(set(draws)) == 1, f"seed {seed_value}: draws {draws} depend on the rest of the batch"


def test_different_row_seeds_give_varied_draws() -> None:
    target = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    logits = target.unsqueeze(0).repeat(200, 1)
    seeds = {i: token_seed(42, i) for i in range(200)}
    out = Sampler(CPU, seed=0)(logits, make_batch([Setting(temperature=1.5)] * 200, VOCAB, row_seeds=seeds))
    assert len(set(out.token_ids.tolist())) > 5


def test_token_seed_differs_across_indices_and_seeds() -> None:
    for seed in (0, 1, 42, 2**31 - 1, 2**40, -3):
        values = [token_seed(seed, i) for i in range(5000)]
        assert len(set(values)) == len(values), f"seed {seed}: repeated generator seeds across token indices"
        assert all(0 <= v < 2**62 for v in values)
    # Nearby request seeds do not share streams.
    assert len({token_seed(s, i) for s in range(100) for i in range(100)}) == 100 * 100
    assert token_seed(5, 3) == token_seed(5, 3)


def test_logprobs_are_of_the_raw_distribution() -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(16, VOCAB, generator=g)
    batch = make_batch([Setting(temperature=0.5, top_k=3)] * 16, VOCAB)
    batch.max_num_logprobs = 4
    out = Sampler(CPU, seed=0)(logits, batch)
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_ranks is not None
    raw = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    top_lp, top_ids = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_lp)
    order = raw.argsort(dim=-1, descending=True)
    want_rank = (order == out.token_ids.unsqueeze(1)).float().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, want_rank)
    assert (out.sampled_ranks <= 3).all()  # top_k=3 only ever samples the three most likely


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_draws_do_not_follow_the_host_programs_default_dtype(default: torch.dtype) -> None:
    """Rank 0 samples in the host program's process (TP=1, torchrun's rank 0, the server): its noise is
    float32 whatever torch.set_default_dtype says there, so seeded and unseeded draws are those of a
    worker process, and the other ranks' (they differed, and bfloat16 noise biased the draws)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, VOCAB, generator=g) * 2
    batch = make_batch(
        [Setting(temperature=1.2)] * 64, VOCAB, row_seeds={i: token_seed(3, i) for i in range(0, 64, 2)}
    )
    want = Sampler(CPU, seed=9)(logits, batch).token_ids
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = Sampler(CPU, seed=9)(logits, batch).token_ids
    finally:
        torch.set_default_dtype(before)
    assert torch.equal(got, want)
