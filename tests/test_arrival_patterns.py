"""Scheduling under the arrival patterns users produce, against HF transformers' greedy tokens.

A seeded generator adds requests between steps at random times: prompts of 1 token, exactly a block,
a block +- 1, longer than max_num_batched_tokens (chunked), prompts sharing stems (prefix-cache hits while
the blocks they hit are being written), duplicates, prompts that are another request's prompt plus part of
its output (while that request may still run); max_tokens from 1 to max_model_len, stop tokens that may
fire on the first token, min_tokens; aborts at random points (waiting, mid-chunk, running, preempted, just
finished). The KV cache is small enough to preempt by recompute. Every finished request's tokens equal
HF's greedy tokens (cut at the first stop token past min_tokens), an aborted request's are a prefix of
them, every block is free at the end, nothing is left registered to a request, and the run ends within a
bounded number of steps. Prefix caching on and off, async scheduling on and off, TP 1 and 2.

Also: seeded sampling that no schedule changes; hits on blocks written in the same step and on a running
request's prompt plus output; aborting by `RequestOutput.request_id` (a str); and the scheduler alone
against a brute force of what each block holds, with aborts at every stage.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
from tp_runtime.engine.scheduler import Request, Scheduler
from tp_runtime.errors import InvalidRequestError
from tp_runtime.messages import ModelRunnerOutput, RequestSampling
from tp_runtime.outputs import RequestOutput

BS = 4


class Reference:
    """HF greedy continuations (EOS never stops them), computed once per prompt at the longest length
    asked for."""

    def __init__(self, model_dir: Path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        have = self._cache.get(tuple(prompt), [])
        if len(have) < n:
            ids = torch.tensor([prompt])
            gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(n, 8),
                                      do_sample=False, pad_token_id=0)  # fmt: skip
            have = self._cache[tuple(prompt)] = gen[0, len(prompt) :].tolist()
        return have[:n]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _check_no_leftovers(llm: LLM, num_blocks: int) -> None:
    sched = llm.engine.scheduler
    kv = sched.kv
    assert not sched.requests and not sched.running and not sched.waiting
    assert kv.num_free_blocks == num_blocks and not kv.blocks
    assert all(c == 0 for c in kv.pool.ref_count)
    assert not kv._hashes and not kv._registered  # nothing kept for requests that ended


def _random_arrivals(
    llm: LLM, reference: Reference, seed: int, num_requests: int, max_model_len: int, aborts: bool
) -> tuple[int, int]:
    """Drive `llm.engine` with a seeded arrival schedule; check every output against HF. Returns the
    number of aborted and of stopped requests."""
    rng = random.Random(seed)
    engine = llm.engine
    stems = [[rng.randrange(3, 300) for _ in range(n)] for n in (BS, 2 * BS + 1, 3 * BS - 1)]
    requests: dict[int, tuple[list[int], SamplingParams]] = {}
    outputs: dict[int, list[RequestOutput]] = {}
    aborted: set[int] = set()
    pending, steps = num_requests, 0
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.4:
            for _ in range(min(pending, rng.choice([1, 1, 2, 3]))):
                kind = rng.random()
                if kind < 0.25 and requests:  # an earlier prompt and part of its output (maybe running)
                    prompt, _ = requests[rng.choice(list(requests))]
                    prompt = prompt + reference(prompt, 8)[: rng.randrange(0, 9)]
                elif kind < 0.6:  # a shared stem and a tail of its own (maybe none: a duplicate)
                    tail = rng.choice([0, 0, 1, BS - 1, BS, BS + 1, 2 * BS])
                    prompt = rng.choice(stems) + [rng.randrange(3, 300) for _ in range(tail)]
                else:
                    length = rng.choice([1, BS - 1, BS, BS + 1, 2 * BS, 3 * BS + 1, 6 * BS])
                    prompt = [rng.randrange(3, 300) for _ in range(length)]
                prompt = prompt[: max_model_len - 1]
                max_tokens = rng.choice([1, 2, 5, 9, None])
                room = max_model_len - len(prompt)
                if max_tokens is not None:
                    room = min(room, max_tokens)
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                if rng.random() < 0.3:  # a stop token: HF's k-th token (the first, unless min_tokens)
                    want = reference(prompt, room)
                    k = rng.randrange(len(want))
                    min_tokens = rng.choice([0, k])
                    if want[k] in want[:min_tokens]:
                        min_tokens = 0  # min_tokens would mask a token HF generates: not comparable
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                            stop_token_ids=[want[k]], min_tokens=min_tokens)  # fmt: skip
                req_id = engine.add_request(prompt, params, stream=rng.random() < 0.3)
                requests[req_id] = (prompt, params)
                pending -= 1
        for out in engine.step():
            outputs.setdefault(int(out.request_id), []).append(out)
        steps += 1
        assert steps < 40 * num_requests, "a request starved"
        live = list(engine.scheduler.requests)
        if aborts and live and rng.random() < 0.08:
            victim = rng.choice(live)
            last = engine.abort_request(victim)
            assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"
            assert victim not in engine.scheduler.kv.blocks
            assert engine.abort_request(victim) is None  # already gone
            outputs.setdefault(victim, []).append(last)
            aborted.add(victim)
        elif aborts and outputs and rng.random() < 0.05:
            done = rng.choice(list(outputs))
            if outputs[done][-1].finished:
                assert engine.abort_request(done) is None  # just finished: nothing to abort
    stopped = 0
    for req_id, (prompt, params) in requests.items():
        outs = outputs[req_id]
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        limit = max_model_len - len(prompt) if params.max_tokens is None else params.max_tokens
        want = reference(prompt, min(limit, max_model_len - len(prompt)))
        reason = "length"
        for j, t in enumerate(want):
            if params.stop_token_ids and t in params.stop_token_ids and j >= params.min_tokens:
                want, reason = want[: j + 1], "stop"
                stopped += 1
                break
        if req_id in aborted:
            assert tokens == want[: len(tokens)], f"aborted request {req_id}, prompt {prompt}"
            continue
        assert tokens == want, f"request {req_id} (prompt of {len(prompt)}: {prompt}, {params})"
        assert outs[-1].outputs[0].finish_reason == reason
    return len(aborted), stopped


CASES = [(caching, async_s) for caching in (True, False) for async_s in (True, False)]


CASE_IDS = [f"{'cache' if c else 'nocache'}-{'async' if a else 'sync'}" for c, a in CASES]


@pytest.mark.parametrize(("caching", "async_scheduling"), CASES, ids=CASE_IDS)
def test_random_arrivals_with_preemption_match_hf(
    model_dir: Path, reference: Reference, caching: bool, async_scheduling: bool
) -> None:
    max_model_len, num_blocks = 32, 10  # two sequences of max_model_len overflow it: preemption
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, num_kv_blocks=num_blocks,
             max_model_len=max_model_len, max_num_seqs=3, max_num_batched_tokens=6,
             enable_prefix_caching=caching, async_scheduling=async_scheduling) as llm:  # fmt: skip
        num_aborted, stopped = 0, 0
        for seed in range(1, 7):
            a, s = _random_arrivals(llm, reference, seed, 24, max_model_len, aborts=seed % 2 == 0)
            num_aborted, stopped = num_aborted + a, stopped + s
            _check_no_leftovers(llm, num_blocks)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0, "the schedule never preempted"
        assert num_aborted > 0 and stopped > 0
        assert (sched.kv.num_hit_tokens > 0) == caching


def test_random_arrivals_tp2(model_dir: Path, reference: Reference) -> None:
    max_model_len, num_blocks = 32, 9
    with LLM(model_dir, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=BS,
             num_kv_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=3,
             max_num_batched_tokens=5) as llm:  # fmt: skip
        _random_arrivals(llm, reference, 7, 16, max_model_len, aborts=True)
        _check_no_leftovers(llm, num_blocks)
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def small_llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, num_kv_blocks=12, max_model_len=24,
             max_num_batched_tokens=5) as llm:  # fmt: skip
        yield llm


def _ids(prompts: list[list[int]]) -> list[Any]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_edge_lengths_and_limits(small_llm: LLM, reference: Reference) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, BS - 1, BS, BS + 1, 2 * BS, 11)]
    prompts += [prompts[2], prompts[3][:BS], prompts[4] + [7]]  # entirely cached, a prefix, an extension
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for params, n in ((greedy, 5), (SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), 1)):
        outs = small_llm.generate(_ids(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference(p, n) for p in prompts]
    # n > 1 with prefix caching: every sample of a greedy request is HF's.
    outs = small_llm.generate(_ids(prompts[:4]), SamplingParams(temperature=0, n=3, max_tokens=4,
                                                                ignore_eos=True), use_tqdm=False)  # fmt: skip
    for p, o in zip(prompts[:4], outs, strict=True):
        assert [c.token_ids for c in o.outputs] == [reference(p, 4)] * 3
    # max_model_len reached exactly: a prompt one token short of it gets one token.
    p = [rng.randrange(3, 300) for _ in range(23)]
    out = small_llm.generate(_ids([p]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == reference(p, 1) and out.finish_reason == "length"
    # A prompt of max_model_len tokens leaves no room: a clear error, and nothing is left behind.
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        small_llm.generate(_ids([[*p, 5]]), greedy, use_tqdm=False)
    # A stop token on the first token.
    for p in prompts[:4]:
        first = reference(p, 1)[0]
        stop_first = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[first])
        out = small_llm.generate(_ids([p]), stop_first, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == [first] and out.outputs[0].stop_reason == first
    _check_no_leftovers(small_llm, 12)


def test_hits_on_blocks_being_written(model_dir: Path, reference: Reference) -> None:
    """A prompt admitted in the step that computes the blocks it hits; a prompt that is a running request's
    prompt plus its output so far, added mid-flight; both equal HF and count their hits."""
    rng = random.Random(9)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, num_kv_blocks=24, max_model_len=40,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        engine = llm.engine
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompt = [rng.randrange(3, 300) for _ in range(2 * BS + 1)]
        first, same_step = engine.add_request(prompt, greedy), engine.add_request(prompt, greedy)
        outputs: dict[int, RequestOutput] = {}
        streamed: list[int] = []
        follower = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[int(out.request_id)] = out
            running = engine.scheduler.requests.get(first)
            if follower is None and running is not None and len(running.output_token_ids) >= 3:
                streamed = list(running.output_token_ids)
                follower = engine.add_request(prompt + streamed, greedy)
        assert follower is not None
        assert outputs[first].outputs[0].token_ids == outputs[same_step].outputs[0].token_ids
        assert outputs[first].outputs[0].token_ids == reference(prompt, 6)
        assert outputs[same_step].num_cached_tokens == 2 * BS  # found in the step that computed them
        assert outputs[follower].outputs[0].token_ids == reference(prompt + streamed, 6)
        assert outputs[follower].num_cached_tokens == (len(prompt) + len(streamed) - 1) // BS * BS
        _check_no_leftovers(llm, 24)


def _seeded_run(model_dir: Path, seed: int, **engine: Any) -> tuple[dict[int, Any], int]:
    """Seeded sampling (penalties, stop strings, logprobs, prompt logprobs, streams) under a seeded arrival
    schedule: each request's tokens, text, finish and logprobs, and the number of preemptions."""
    rng = random.Random(seed)
    with LLM(model_dir, device="cpu", dtype="float32", block_size=BS, max_model_len=32, **engine) as llm:
        eng = llm.engine
        stems = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, BS, 2 * BS + 3)]
        outputs: dict[int, list[RequestOutput]] = {}
        pending = 16
        while pending or eng.has_unfinished_requests():
            if pending and rng.random() < 0.4:
                prompt = rng.choice(stems) + [rng.randrange(3, 300) for _ in range(rng.choice([0, 1, BS, 9]))]
                params = SamplingParams(
                    temperature=rng.choice([0.5, 1.0]),
                    top_k=rng.choice([-1, 5]),
                    seed=rng.randrange(100),
                    max_tokens=rng.choice([1, 3, 8, None]),
                    logprobs=rng.choice([None, 1]),
                    prompt_logprobs=rng.choice([None, None, 1]),
                    stop=rng.choice([None, ["a"], ["e", "x"]]),
                    ignore_eos=rng.random() < 0.5,
                    min_tokens=rng.choice([0, 0, 1]),
                    presence_penalty=rng.choice([0.0, 0.5]),
                )
                outputs[eng.add_request(prompt, params, stream=rng.random() < 0.5)] = []
                pending -= 1
            for out in eng.step():
                outputs[int(out.request_id)].append(out)
        num_preemptions = eng.scheduler.num_preemptions
        _check_no_leftovers(llm, eng.num_kv_blocks)

    def rounded(entries: Any) -> Any:
        return [None if d is None else sorted((t, v.logprob) for t, v in d.items()) for d in entries]

    summary = {}
    for req_id, outs in outputs.items():
        last = outs[-1].outputs[0]
        summary[req_id] = (
            [t for o in outs for t in o.outputs[0].token_ids],
            "".join(o.outputs[0].text for o in outs),
            last.finish_reason,
            last.stop_reason,
            rounded(outs[0].prompt_logprobs or []),
            rounded([d for o in outs for d in o.outputs[0].logprobs or []]),
        )
    return summary, num_preemptions


def test_seeded_sampling_is_independent_of_the_schedule(model_dir: Path) -> None:
    """A seeded request samples the same tokens (text, logprobs, prompt logprobs, stop) whatever the
    schedule: under preemption and chunking, with caching and async scheduling on or off, as with all the
    memory it wants one step at a time."""
    for seed in (3, 4):
        want, _ = _seeded_run(model_dir, seed, num_kv_blocks=100, enable_prefix_caching=False,
                              async_scheduling=False)  # fmt: skip
        for caching, async_scheduling in CASES:
            got, preemptions = _seeded_run(model_dir, seed, num_kv_blocks=9, max_num_seqs=3,
                                           max_num_batched_tokens=6, enable_prefix_caching=caching,
                                           async_scheduling=async_scheduling)  # fmt: skip
            assert preemptions > 0
            assert got.keys() == want.keys()
            for req_id, (tokens, text, finish, stop, prompt_lps, lps) in got.items():
                w_tokens, w_text, w_finish, w_stop, w_prompt_lps, w_lps = want[req_id]
                assert (tokens, text, finish, stop) == (w_tokens, w_text, w_finish, w_stop), (seed, req_id)
                # Logprobs to float32 rounding: a batch of other rows may sum a matmul in another order.
                assert _same_logprobs(prompt_lps, w_prompt_lps), (seed, caching, async_scheduling, req_id)
                assert _same_logprobs(lps, w_lps), (seed, caching, async_scheduling, req_id)


def _same_logprobs(got: list[Any], want: list[Any]) -> bool:
    """Per position the same token ids, their logprobs within 1e-3."""
    if len(got) != len(want):
        return False
    for x, y in zip(got, want, strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif [t for t, _ in x] != [t for t, _ in y] or any(
            abs(u - v) >= 1e-3 for (_, u), (_, v) in zip(x, y, strict=True)
        ):
            return False
    return True


def test_abort_by_the_id_the_outputs_carry(small_llm: LLM, reference: Reference) -> None:
    """`RequestOutput.request_id` is the str of the id add_request returned: aborting by it ends the request
    (it used to be looked up as given, found nothing and left the request running). An id that names no
    request, or one already finished, gives None; so does another spelling of an id ("07" for 7)."""
    engine = small_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    keep = engine.add_request([5, 6, 7], greedy, stream=True)
    doomed = engine.add_request([8, 9], greedy, stream=True)
    assert engine.abort_request(f"0{keep}") is None and engine.abort_request(f"+{keep}") is None
    outputs: dict[str, list[RequestOutput]] = {}
    aborted = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if aborted is None and str(doomed) in outputs:
            aborted = engine.abort_request(outputs[str(doomed)][-1].request_id)
            assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
            assert doomed not in engine.scheduler.requests and doomed not in engine.scheduler.kv.blocks
    assert aborted is not None
    assert [t for o in outputs[str(keep)] for t in o.outputs[0].token_ids] == reference([5, 6, 7], 8)
    assert engine.abort_request(str(keep)) is None and engine.abort_request("no such request") is None
    assert engine.abort_request("9" * 5000) is None  # past int()'s digit limit: no ValueError
    _check_no_leftovers(small_llm, 12)


# ------------------------------------------------------------------------- block accounting, brute force


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_aborts_at_any_stage_keep_block_accounting_exact(model_dir: Path, async_steps: bool) -> None:
    """The scheduler alone under random arrivals on shared stems and aborts at any stage (waiting, mid-chunk,
    running, preempted with a token in flight), against a brute force: `content[block]` is what the steps
    wrote (in step order, a step's writes before its reads); every position a scheduled request attends to
    holds its own token, reference counts equal the holders, free + held = all, and at the end every block is
    free and nothing is kept for any request."""
    rng = random.Random(11 + async_steps)
    num_blocks = 16
    model = build_model_config(str(model_dir), dtype="float32", device="cpu", max_model_len=64,
                               load_format="auto")  # fmt: skip
    config = EngineConfig(
        model=model, cache=CacheConfig(block_size=BS, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7),
    )  # fmt: skip
    sched = Scheduler(config, num_blocks)
    kv = sched.kv
    content: dict[int, dict[int, int]] = {}
    stems = [[rng.randrange(3, 100) for _ in range(n)] for n in (1, BS, BS + 1, 3 * BS - 1)]
    sampling = RequestSampling(
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, min_tokens=0, stop_token_ids=[],
        num_logprobs=-1, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
        num_prompt_logprobs=-1,
    )  # fmt: skip

    def sampled_token(req_id: int, position: int) -> int:
        return 3 + (req_id * 7919 + position * 104729) % 97

    def token_at(req: Request, pos: int) -> int:
        prompt = req.prompt_token_ids
        return prompt[pos] if pos < len(prompt) else sampled_token(req.req_id, pos)

    def deliver(output: ModelRunnerOutput) -> None:
        sched.update(output)
        for req_id in output.req_ids:
            req = sched.requests.get(req_id)
            if req is not None and len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, "length")

    next_id, aborts, in_flight = 0, 0, None
    for _ in range(3000):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 3]) if next_id < 80 else 0):
            prompt = rng.choice(stems) + [rng.randrange(3, 100) for _ in range(rng.randrange(0, 10))]
            params = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)
            sched.add(Request(next_id, prompt, params, sampling))
            next_id += 1
        starts = {r.req_id: r.num_computed_tokens for r in sched.running}
        placeholders = {r.req_id: r.num_placeholders for r in sched.running}
        out = sched.schedule()
        for new in out.new_requests:
            starts[new.req_id] = new.num_computed_tokens
        scheduled = list(zip(out.scheduled_req_ids, out.num_scheduled_tokens, strict=True))
        for req_id, n in scheduled:
            req, blocks = sched.requests[req_id], kv.blocks[req_id]
            for pos in range(starts[req_id], starts[req_id] + n):
                content.setdefault(blocks[pos // BS], {})[pos % BS] = token_at(req, pos)
        for req_id, n in scheduled:
            req, blocks = sched.requests[req_id], kv.blocks[req_id]
            for pos in range(starts[req_id] + n):
                assert content[blocks[pos // BS]][pos % BS] == token_at(req, pos), "read other content"
        sampled = [r for r, _ in scheduled if sched.requests[r].num_placeholders > placeholders.get(r, 0)]
        output = ModelRunnerOutput(
            step_id=out.step_id, req_ids=sampled,
            sampled_token_ids=[sampled_token(r, sched.requests[r].num_tokens - 1) for r in sampled],
        )  # fmt: skip
        if async_steps:
            if in_flight is not None:
                deliver(in_flight)
            in_flight = output
        else:
            deliver(output)
        if sched.requests and rng.random() < 0.1:  # an abort, wherever the request is
            sched.finish(sched.requests[rng.choice(list(sched.requests))], "abort")
            aborts += 1
        holders = [0] * num_blocks
        for blocks in kv.blocks.values():
            for b in blocks:
                holders[b] += 1
        assert holders == kv.pool.ref_count
        assert kv.num_free_blocks == holders.count(0)
        assert all(kv.pool.hash_of[b] == h for h, b in kv.pool.cached.items())
        if next_id >= 80 and not sched.has_unfinished:
            break
    if in_flight is not None:
        deliver(in_flight)
    assert next_id >= 80 and not sched.has_unfinished and aborts > 10
    assert sched.num_preemptions > 0 and kv.num_hit_tokens > 0
    assert kv.num_free_blocks == num_blocks and not kv.blocks and not kv._hashes and not kv._registered
