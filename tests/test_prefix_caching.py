"""Automatic prefix caching (engine/kv_cache.py, the scheduler's use of it).

- The block pool against a brute force: a random stream of requests through the scheduler, with every
  block's content written down as steps compute it; each hit hands a request only blocks holding exactly
  its prefix, reference counts equal the holders, and every block is free once all requests end.
- End to end against HF transformers (fp32, CPU): prompts sharing prefixes of several lengths (block
  multiples, one prompt another's prefix, duplicates), a cache that churns and preempts, n > 1, every
  family, TP 1 and 2; seeded sampling and prompt logprobs equal caching off; num_cached_tokens is what
  the hashes imply; reset_prefix_cache forgets.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import GEMMA2, GEMMA3, assert_same_tokens, hf_greedy, random_prompts

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
from tp_runtime.engine.kv_cache import _ROOT, KVCacheManager, block_hash
from tp_runtime.engine.scheduler import Request, Scheduler
from tp_runtime.errors import InvalidRequestError
from tp_runtime.messages import ModelRunnerOutput, RequestSampling


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(10, 21))  # two full blocks and 3 tokens
    hashes = kv._block_hashes(0, tokens[:6], tokens[6:])  # split between prompt and output anywhere
    assert hashes == [block_hash(_ROOT, tokens[:4]), block_hash(block_hash(_ROOT, tokens[:4]), tokens[4:8])]
    # The same block after a different prefix is a different block.
    assert kv._block_hashes(1, [9, 11, 12, 13, *tokens[4:8]], [])[1] != hashes[1]


def _scheduler(model_dir: Path, num_blocks: int, block_size: int) -> Scheduler:
    model = build_model_config(str(model_dir), dtype="float32", device="cpu", max_model_len=64,
                               load_format="auto")  # fmt: skip
    config = EngineConfig(
        model=model, cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),  # chunks end mid-block
    )  # fmt: skip
    return Scheduler(config, num_blocks)


def _token(req_id: int, position: int) -> int:
    """What the fake model samples at a position of a request: fixed, so any schedule gives the same."""
    return 3 + (req_id * 7919 + position * 104729) % 97


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_random_traffic_hits_only_exact_prefixes_and_frees_every_block(
    make_checkpoint: Callable[..., Path], async_steps: bool
) -> None:
    """Brute force: `content[block]` is what the steps wrote into it (token id by offset), written in step
    order as an in-order worker would, a step's writes before its reads; every position a step's request
    attends to must hold exactly that request's token, whether it came from the cache or from a request
    computed in the same step. `async_steps`: step N+1 is scheduled before step N's sampled ids are back."""
    rng = random.Random(3 + async_steps)
    bs, num_blocks = 4, 16
    sched = _scheduler(make_checkpoint("LlamaForCausalLM"), num_blocks, bs)
    kv = sched.kv
    content: dict[int, dict[int, int]] = {}
    stems = [[rng.randrange(3, 100) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    next_id, hits, same_step_hits = 0, 0, 0
    in_flight: ModelRunnerOutput | None = None

    def token_at(req: Request, pos: int) -> int:
        tokens = req.prompt_token_ids
        return tokens[pos] if pos < len(tokens) else _token(req.req_id, pos)

    def deliver(output: ModelRunnerOutput) -> None:
        sched.update(output)
        for req_id in output.req_ids:
            req = sched.requests.get(req_id)
            if req is not None and req.finish_reason is None and len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, "length")

    for _ in range(3000):
        # Arrivals in bursts: requests on one stem that start in the same step share what it computes.
        stem = rng.choice(stems)
        for _ in range(rng.choice([0, 0, 0, 1, 1, 3]) if next_id < 60 else 0):
            prompt = stem + [rng.randrange(3, 100) for _ in range(rng.randrange(0, 10))]
            params = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)
            sampling = RequestSampling(
                temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, min_tokens=0, stop_token_ids=[],
                num_logprobs=-1, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                num_prompt_logprobs=-1,
            )
            sched.add(Request(next_id, prompt, params, sampling))
            next_id += 1
        starts = {r.req_id: r.num_computed_tokens for r in sched.running}
        placeholders = {r.req_id: r.num_placeholders for r in sched.running}
        out = sched.schedule()
        written_this_step: set[tuple[int, int]] = set()
        for new in out.new_requests:
            starts[new.req_id] = new.num_computed_tokens
        for req_id, n in zip(out.scheduled_req_ids, out.num_scheduled_tokens, strict=True):
            req, blocks = sched.requests[req_id], kv.blocks[req_id]
            for pos in range(starts[req_id], starts[req_id] + n):
                content.setdefault(blocks[pos // bs], {})[pos % bs] = token_at(req, pos)
                written_this_step.add((blocks[pos // bs], pos % bs))
        for req_id, n in zip(out.scheduled_req_ids, out.num_scheduled_tokens, strict=True):
            req, blocks = sched.requests[req_id], kv.blocks[req_id]
            for pos in range(starts[req_id] + n):  # what its attention reads: every earlier key
                assert content[blocks[pos // bs]][pos % bs] == token_at(req, pos), "read other content"
        for new in out.new_requests:
            if new.num_computed_tokens:
                hits += 1
                blocks = new.block_ids
                same_step_hits += any((blocks[p // bs], p % bs) in written_this_step
                                      for p in range(new.num_computed_tokens))  # fmt: skip
        sampled = [r for r in out.scheduled_req_ids
                   if sched.requests[r].num_placeholders > placeholders.get(r, 0)]  # fmt: skip
        output = ModelRunnerOutput(
            step_id=out.step_id, req_ids=sampled,
            sampled_token_ids=[_token(r, sched.requests[r].num_tokens - 1) for r in sampled],
        )  # fmt: skip
        if async_steps:
            if in_flight is not None:
                deliver(in_flight)
            in_flight = output
        else:
            deliver(output)
        # Reference counts are the holders; cached blocks are registered under one hash each.
        holders = [0] * num_blocks
        for blocks in kv.blocks.values():
            for b in blocks:
                holders[b] += 1
        assert holders == kv.pool.ref_count
        assert all(kv.pool.hash_of[b] == h for h, b in kv.pool.cached.items())
        if next_id >= 60 and not sched.has_unfinished:
            break
    if in_flight is not None:
        deliver(in_flight)
    assert next_id >= 60 and not sched.has_unfinished
    assert hits > 10 and same_step_hits > 0, (hits, same_step_hits)
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == num_blocks and not kv.blocks
    assert kv.num_hit_tokens > 0 and kv.num_queried_tokens > kv.num_hit_tokens


def test_lookup_leaves_the_last_token_and_evicts_least_recent_first() -> None:
    bs = 4
    kv = KVCacheManager(6, bs, enable_prefix_caching=True)
    a = list(range(3, 11))  # exactly two blocks
    assert kv.allocate_slots(0, len(a), kv.find_cached_prefix(0, a, [])) == [0, 1]
    kv.cache_full_blocks(0, a, [], len(a))
    kv.forget(0)
    # The same prompt again: one block from the cache (its last token must be computed), then a new one.
    hit = kv.find_cached_prefix(1, a, [])
    assert hit == [0]
    # Freed tail first, block 1 went into the free queue before block 0, both after the never-used 2-5:
    # the new block is the queue's head, 2, and block 1 stays registered.
    assert kv.allocate_slots(1, len(a), hit) == [0, 2]
    assert kv.pool.hash_of[1] is not None and kv.pool.ref_count[:3] == [1, 0, 1]
    # Taking the queue's next four blocks evicts 3, 4, 5 and then block 1.
    assert kv.allocate_slots(2, 16) == [3, 4, 5, 1] and kv.pool.hash_of[1] is None
    kv.forget(2)
    kv.forget(1)
    assert kv.num_free_blocks == 6 and all(c == 0 for c in kv.pool.ref_count)
    # With caching off nothing is found.
    off = KVCacheManager(6, bs)
    off.allocate_slots(0, len(a))
    off.cache_full_blocks(0, a, [], len(a))
    off.forget(0)
    assert off.find_cached_prefix(1, a, []) == [] and off.pool.cached == {}


# ------------------------------------------------------------------------------------------- end to end

FAMILIES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama": ("LlamaForCausalLM", {}, None),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}, None),
    "gemma2": ("Gemma2ForCausalLM", GEMMA2, "eager"),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3, None),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}, None),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
}
BS = 4


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Prefixes of several lengths (block multiples among them), a prompt that is another's prefix, a
    duplicate, and unrelated prompts."""
    stem = random_prompts((23,), 300, seed=seed)[0]
    other = random_prompts((9, 14), 300, seed=seed + 1)
    return [
        stem[:12] + other[0][:5],  # 3 shared blocks, then its own
        stem[:12] + other[1],
        stem[:16],  # exactly 4 blocks: another's prefix
        stem,
        stem,  # a duplicate
        stem[:7] + other[0],  # a partial block shared: not a hit on it
        other[1],
    ]


def expected_cached(prompts: list[list[int]], done: list[list[int]]) -> list[int]:
    """num_cached_tokens from the hashes: the longest run of full blocks a request shares with the prompts
    computed before it (`done`), leaving its last token to compute."""
    got = []
    for p in prompts:
        best = 0
        for q in done:
            n = 0
            while n + BS <= min(len(p) - 1, len(q)) and p[n : n + BS] == q[n : n + BS]:
                n += BS
            best = max(best, n)
        got.append(best)
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prefixes_match_hf_with_caching(make_checkpoint: Callable[..., Path], family: str) -> None:
    arch, overrides, attn = FAMILIES[family]
    model_dir = make_checkpoint(arch, **overrides)
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = hf_greedy(model_dir, prompts, 6, attn_implementation=attn)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, max_num_seqs=2) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_kv_blocks
    for outs in (first, second):
        assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)
    assert any(o.num_cached_tokens for o in first)  # within the first pass, from prompts before
    # The second pass finds every prompt's full blocks (all computed in the first, the cache holds them).
    assert [o.num_cached_tokens for o in second] == expected_cached(prompts, prompts)


def test_churn_preemption_and_tp2_match_hf(make_checkpoint: Callable[..., Path]) -> None:
    """A cache of 14 blocks for requests of up to 9: blocks are evicted, reused and shared by preempted
    requests; at TP 1 and 2 the tokens equal HF's and every block ends free."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompts = shared_prefix_prompts(seed=5) * 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = hf_greedy(model_dir, prompts, 8)
    for tp in (1, 2):
        with LLM(model_dir, tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=BS,
                 num_kv_blocks=14, max_num_seqs=3, max_num_batched_tokens=12,
                 max_model_len=40) as llm:  # fmt: skip
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            sched = llm.engine.scheduler
            assert sched.num_preemptions > 0 and sched.kv.num_hit_tokens > 0
            assert sched.kv.num_free_blocks == 14
        assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)


def _generate(model_dir: Path, caching: bool, prompts: list[list[int]], params: Any, **engine: Any) -> Any:
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, enable_prefix_caching=caching,
             **engine) as llm:  # fmt: skip
        llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)  # warm the cache
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_seeded_sampling_n_and_prompt_logprobs_equal_caching_off(
    make_checkpoint: Callable[..., Path],
) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompts = shared_prefix_prompts(seed=2)
    params = SamplingParams(
        n=3, temperature=0.9, top_p=0.9, seed=11, max_tokens=6, logprobs=2, prompt_logprobs=1
    )
    on, off = (_generate(model_dir, caching, prompts, params, max_num_seqs=4) for caching in (True, False))
    plain = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, logprobs=1)
    on_plain, off_plain = (_generate(model_dir, c, prompts, plain, max_num_seqs=4) for c in (True, False))
    assert any(o.num_cached_tokens for o in on_plain), "the seeded run never hit the cache"
    assert all(o.num_cached_tokens == 0 for o in on)  # prompt logprobs: the prompt is computed whole
    for a_outs, b_outs in ((on, off), (on_plain, off_plain)):
        for a, b in zip(a_outs, b_outs, strict=True):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            for ca, cb in zip(a.outputs, b.outputs, strict=True):
                for x, y in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
            if a.prompt_logprobs is not None:
                for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                    assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_hits_through_the_graph_paths_equal_caching_off(make_checkpoint: Callable[..., Path]) -> None:
    """Hits that leave one token (a decode-shaped row), a short chunk (the decode graphs' rows) or a longer
    one (the mixed-step graphs), in padded mode, give the tokens and logprobs of caching off."""
    model_dir = make_checkpoint("MistralForCausalLM", sliding_window=8)
    stem = random_prompts((40,), 300, seed=12)[0]
    prompts = [stem[:33], stem[:33], stem[:36], stem, stem[:20] + random_prompts((30,), 300, seed=13)[0]]
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=6, logprobs=1, n=2)
    on, off = (
        _generate(model_dir, caching, prompts, params, cuda_graphs="padded", max_num_batched_tokens=24)
        for caching in (True, False)
    )
    assert sum(o.num_cached_tokens for o in on) >= 4 * 32
    for a, b in zip(on, off, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            for x, y in zip(ca.logprobs, cb.logprobs, strict=True):
                assert set(x) == set(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_reset_prefix_cache_and_caching_off(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompt = [{"prompt_token_ids": random_prompts((21,), 300, seed=8)[0]}]
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS) as llm:
        assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
        assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 20
        assert llm.reset_prefix_cache()
        assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
        kv = llm.engine.scheduler.kv
        assert (kv.num_queried_tokens, kv.num_hit_tokens) == (63, 20)
        # Refused while a request holds blocks (it would register them again), and nothing is forgotten.
        engine = llm.engine
        engine.add_request(prompt[0]["prompt_token_ids"], SamplingParams(max_tokens=3))
        engine.step()
        assert not llm.reset_prefix_cache() and kv.pool.cached
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.reset_prefix_cache() and not kv.pool.cached
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, enable_prefix_caching=False) as llm:
        llm.generate(prompt, params, use_tqdm=False)
        assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_cache_salt_shares_blocks_only_with_the_same_salt(make_checkpoint: Callable[..., Path]) -> None:
    """vLLM's cache_salt: a prompt's blocks are found only by prompts with the same salt (no salt is a salt
    of its own), so one tenant cannot time another's prompts through the cache; the tokens are the same
    whatever the cache gives. A salt that is no non-empty text is refused."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    ids = random_prompts((21,), 300, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS) as llm:

        def run(salt: str | None) -> tuple[int, list[int]]:
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if salt is not None:
                prompt["cache_salt"] = salt
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            return out.num_cached_tokens, list(out.outputs[0].token_ids)

        cached, tokens = zip(*(run(s) for s in (None, None, "a", "a", "b", None, "a")), strict=True)
        assert cached == (0, 20, 0, 20, 0, 20, 20)
        assert len(set(map(tuple, tokens))) == 1
        # The engine's own API takes it too.
        engine, kv = llm.engine, llm.engine.scheduler.kv
        assert kv.num_hit_tokens == 80
        engine.add_request(ids, params, cache_salt="b")
        while engine.has_unfinished_requests():
            engine.step()
        assert kv.num_hit_tokens == 100
        for salt in ("", 7, "x\ud800"):
            with pytest.raises(InvalidRequestError, match="cache_salt"):
                llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, params, use_tqdm=False)
