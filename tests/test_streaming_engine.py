"""The streaming engine API: `LLMEngine.add_request(stream=True)` / `step()` deltas / `abort_request`, and
the engine thread of `AsyncLLMEngine`.

Most tests drive the real LLMEngine and Scheduler against a scripted worker (the executor is replaced),
so they can choose the tokens: multi-byte characters split across byte-level tokens, stop strings,
aborts at any point of a request's life. One test runs the real model at TP=1 against LLM.generate.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
from tp_runtime.engine.async_engine import AsyncLLMEngine, describe_failure
from tp_runtime.engine.llm_engine import LLMEngine
from tp_runtime.errors import EngineClosedError, WorkerDiedError, WorkerError
from tp_runtime.messages import Logprobs, ModelRunnerOutput, SchedulerOutput
from tp_runtime.outputs import CompletionOutput, RequestOutput
from tp_runtime.presets import build_preset_tokenizer

VOCAB = 300
NUM_BLOCKS = 24
# Multi-byte characters (2, 3 and 4 bytes in UTF-8), which the byte-level tokenizer splits across tokens.
TEXT = "Grüße aus Köln: 3 € für ein 🥨, naïve café — 日本語 ok. Ünïcödé ✓ 🎉 done."


class ScriptedExecutor:
    """Stands in for the executor: 'samples' `script(req_id, position)`, and checks each step against a
    worker's view of its live requests (a freed request is never scheduled again, nor a request twice).
    With `gate`, each step waits until the test releases it (one `release()` per step). From step
    `fail_at_step` on, a step raises `failure`, once `fail_after_requests` requests have arrived (a
    failure that waits for an observed event, not for the engine thread to lose a race). With `hold_until`,
    the first output waits until that predicate holds (e.g. every request of a test was added), so no
    request can finish before the others arrive. `check_alive` (what an idle engine thread calls) raises
    `dead` once set, and calls `on_check_alive` first."""

    def __init__(self, script: Callable[[int, int], int], gate: threading.Semaphore | None = None) -> None:
        self.script = script
        self.gate = gate
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.outputs: dict[int, ModelRunnerOutput] = {}
        self.last_step_timings: dict[str, float] = {}
        self.fail_at_step: int | None = None
        self.fail_after_requests = 0
        self.requests_seen = 0
        self.hold_until: Callable[[], bool] | None = None
        self.failure: BaseException = WorkerDiedError(1, "killed by the test")
        self.dead: BaseException | None = None
        self.on_check_alive: Callable[[], None] | None = None
        self.steps = 0
        self.shut_down = False

    def initialize(self) -> int:
        return NUM_BLOCKS

    def submit(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            assert req_id in self.tokens, f"freed request {req_id} the worker does not hold"
            del self.tokens[req_id], self.computed[req_id]
        for new in so.new_requests:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens  # a prefix-cache hit starts later
            self.requests_seen += 1
        req_ids, sampled = [], []
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens, strict=True):
            tokens = self.tokens[req_id]
            assert self.computed[req_id] + n <= len(tokens)
            self.computed[req_id] += n
            if self.computed[req_id] == len(tokens):
                tokens.append(self.script(req_id, len(tokens)))
                req_ids.append(req_id)
                sampled.append(tokens[-1])
        # Every token 'sampled' with certainty, alone in its top-k (the engine keeps it when asked).
        logprobs = Logprobs([[t] for t in sampled], [[0.0] for _ in sampled], [1] * len(sampled))
        self.outputs[so.step_id] = ModelRunnerOutput(so.step_id, req_ids, sampled, logprobs)

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        if self.gate is not None:
            self.gate.acquire()
        if self.hold_until is not None:
            deadline = time.monotonic() + 60  # a guard against a test that never adds them: fail, not hang
            while not self.hold_until():
                assert time.monotonic() < deadline, "hold_until never held"
                time.sleep(0.001)
            self.hold_until = None
        self.steps += 1
        failing = self.fail_at_step is not None and self.steps >= self.fail_at_step
        if failing and self.requests_seen >= self.fail_after_requests:
            raise self.failure
        return self.outputs.pop(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        return [None]

    def check_alive(self) -> None:
        if self.on_check_alive is not None:
            self.on_check_alive()
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture(scope="module")
def model_config(make_checkpoint: Callable[..., Path]) -> Any:
    return build_model_config(make_checkpoint(seed=3), max_model_len=128)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_preset_tokenizer(VOCAB)


def make_engine(
    model_config: Any, tokenizer: Any, executor: ScriptedExecutor, async_scheduling: bool = True
) -> LLMEngine:
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size=8, num_kv_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        async_scheduling=async_scheduling,
    )
    return LLMEngine(config, tokenizer, executor=executor)


def text_script(ids: list[int], prompt_len: int) -> Callable[[int, int], int]:
    """Every request generates `ids` in order (then repeats them)."""
    return lambda req_id, position: ids[(position - prompt_len) % len(ids)]


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def joined(deltas: list[RequestOutput]) -> tuple[str, list[int]]:
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    text = "".join(d.outputs[0].text for d in deltas)
    return text, [t for d in deltas for t in d.outputs[0].token_ids]


PROMPT = [1, 40, 50, 60]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_deltas_join_into_the_decoded_text(model_config: Any, tokenizer: Any, async_scheduling: bool) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT.encode()) // 2, "the tokenizer should split the multi-byte characters"
    engine = make_engine(
        model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))), async_scheduling
    )
    # The whole text, and a prefix that ends inside a character.
    cut = next(i for i in range(10, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (len(ids), cut)]
    streamed = [engine.add_request(PROMPT, p, stream=True) for p in params]
    whole = [engine.add_request(PROMPT, p) for p in params]
    outputs = run_all(engine)
    for s, w, p in zip(streamed, whole, params, strict=True):
        text, token_ids = joined(outputs[str(s)])
        assert token_ids == ids[: p.max_tokens]
        assert text == tokenizer.decode(ids[: p.max_tokens], skip_special_tokens=True)
        [final] = outputs[str(w)]
        assert final.finished and final.outputs[0].text == text and final.outputs[0].token_ids == token_ids
    # No piece ends in the middle of a character: the text arrives only once its bytes are complete.
    pieces = [d.outputs[0].text for d in outputs[str(streamed[0])]]
    assert not any("\ufffd" in piece for piece in pieces), pieces
    assert sum(1 for piece in pieces if not piece) > 0, "the script should hold some text back"
    # The second request stops inside a character: its last piece carries the replacement character.
    assert outputs[str(streamed[1])][-1].outputs[0].text.endswith("\ufffd")
    assert engine.scheduler.kv.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_and_stop_tokens_stream_the_same_text(
    model_config: Any, tokenizer: Any, include: bool
) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stop_token = tokenizer("✓", add_special_tokens=False)["input_ids"][0]
    engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))))
    cases = [
        SamplingParams(
            temperature=0, max_tokens=80, stop=["日本", "xyz"], include_stop_str_in_output=include
        ),
        SamplingParams(temperature=0, max_tokens=80, stop="€ f", include_stop_str_in_output=include),
        SamplingParams(
            temperature=0, max_tokens=80, stop_token_ids=[stop_token], include_stop_str_in_output=include
        ),
    ]
    pairs = [(engine.add_request(PROMPT, p, stream=True), engine.add_request(PROMPT, p)) for p in cases]
    outputs = run_all(engine)
    expected = [TEXT[: TEXT.index("日本")], TEXT[: TEXT.index("€ f")]]
    if include:
        expected = [TEXT[: TEXT.index("日本") + 2], TEXT[: TEXT.index("€ f") + 3]]
    for i, (s, w) in enumerate(pairs):
        text, token_ids = joined(outputs[str(s)])
        [final] = outputs[str(w)]
        assert text == final.outputs[0].text and token_ids == final.outputs[0].token_ids
        assert final.outputs[0].finish_reason == "stop"
        if i < 2:
            assert text == expected[i]
            # Streamed text never ran past the stop string's start, even before the stop was seen.
            sent = ""
            for d in outputs[str(s)][:-1]:
                sent += d.outputs[0].text
                assert expected[i].startswith(sent) and len(sent) <= TEXT.index(cases[i].stop_strings[0])
        else:
            decoded = tokenizer.decode(token_ids if include else token_ids[:-1], skip_special_tokens=True)
            assert token_ids[-1] == stop_token and text == decoded


def byte_level_tokenizer(extra: list[bytes]) -> Any:
    """A byte-level BPE tokenizer: one token per byte (id 3 + byte), then the multi-byte tokens `extra`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> character map: printable bytes stand for themselves, the others move past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chars[b]: 3 + b for b in range(256)})
    for token in extra:
        vocab["".join(chars[b] for b in token)] = len(vocab)
    vocab.update({f"<pad{i}>": i for i in range(len(vocab), VOCAB)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def streamed_and_whole(
    engine: LLMEngine, params: SamplingParams
) -> tuple[list[tuple[str, CompletionOutput]], list[int]]:
    """One request streamed and one not, with the same params, run to the end: each one's (text, last
    output) (the streamed text joined from its pieces), and the streamed token ids."""
    streamed, whole = engine.add_request(PROMPT, params, stream=True), engine.add_request(PROMPT, params)
    outputs = run_all(engine)
    text, token_ids = joined(outputs[str(streamed)])
    [final] = outputs[str(whole)]
    last = outputs[str(streamed)][-1].outputs[0]
    return [(text, last), (final.outputs[0].text, final.outputs[0])], token_ids


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_whose_last_token_begins_a_character(model_config: Any, include: bool) -> None:
    """The token that completes "STOP" also holds the first two bytes of "€": the incremental text holds
    it back, so the stop string is found only once the request ends (by max_tokens, by EOS, or when the
    next token completes the character); the text must stop there in every case, streamed or not."""
    tokenizer = byte_level_tokenizer([b"P\xe2\x82"])
    p_euro = 259
    eos = tokenizer.eos_token_id
    head = [3 + b for b in b"ab STO"] + [p_euro]
    assert tokenizer.decode(head) == "ab STO" + "P\ufffd"  # the character is incomplete
    z = 3 + ord("z")
    cases = [  # (generated ids, max_tokens, allowed_token_ids)
        (head, len(head), None),  # max_tokens ends the request on the stop string's last token
        ([*head, eos], 20, None),  # EOS right after it
        ([*head, 3 + 0xAC, z, z], 20, None),  # the next token completes the "€"
        # the next token breaks the masks (they left none): the output ends before it, on the stop string
        ([*head, z], 20, sorted(set(head) | {eos})),
    ]
    for ids, max_tokens, allowed in cases:
        full = tokenizer.decode(ids, skip_special_tokens=True)
        want = full[: full.index("STOP") + (4 if include else 0)]  # brute force over the whole text
        engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))))
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, stop="STOP", include_stop_str_in_output=include,
            allowed_token_ids=allowed,
        )  # fmt: skip
        ends, token_ids = streamed_and_whole(engine, params)
        for got_text, out in ends:
            assert got_text == want, (ids, got_text)
            assert (out.finish_reason, out.stop_reason) == ("stop", "STOP"), ids
        assert token_ids == ends[1][1].token_ids == ids[: len(token_ids)]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_whose_text_completes_a_stop_string(model_config: Any, include: bool) -> None:
    """A stop token's text is part of the output with include_stop_str_in_output, so a stop string it
    completes is found there, as vLLM searches it: the string is the stop reason and the text ends with
    it. Without it the token's text is left out, and the token is the reason."""
    tokenizer = byte_level_tokenizer([b" stop"])
    stop_token = 259
    ids = [*(3 + b for b in b"Hello"), stop_token]
    engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))))
    params = SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_token], stop=["lo st"],
        include_stop_str_in_output=include,
    )  # fmt: skip
    ends, token_ids = streamed_and_whole(engine, params)
    want = ("Hello st", "lo st") if include else ("Hello", stop_token)
    for got_text, out in ends:
        assert (got_text, out.finish_reason, out.stop_reason) == (want[0], "stop", want[1])
    assert token_ids == ends[1][1].token_ids == ids


def test_eos_from_the_tokenizer_when_the_configs_name_none(
    make_checkpoint: Callable[..., Path], tokenizer: Any
) -> None:
    """A checkpoint whose config.json (and generation config) give no eos_token_id: the tokenizer's EOS
    ends generation, unless ignore_eos."""
    config = build_model_config(make_checkpoint(seed=3, eos_token_id=None), max_model_len=128)
    assert config.eos_token_ids == ()
    eos = tokenizer.eos_token_id
    script = [7, 8, eos, 9, 10, 11]
    engine = make_engine(config, tokenizer, ScriptedExecutor(text_script(script, len(PROMPT))))
    stops = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6))
    runs_on = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = run_all(engine)
    [stopped], [ran_on] = outputs[str(stops)], outputs[str(runs_on)]
    assert (stopped.outputs[0].token_ids, stopped.outputs[0].finish_reason) == ([7, 8, eos], "stop")
    assert (ran_on.outputs[0].token_ids, ran_on.outputs[0].finish_reason) == (script, "length")


def closed_form(req_id: int, position: int) -> int:
    return 3 + (req_id * 7919 + position * 104729) % (VOCAB - 3)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_random_aborts_free_everything_and_leave_the_rest_intact(
    model_config: Any, tokenizer: Any, seed: int, async_scheduling: bool
) -> None:
    """Requests aborted at random points (waiting, running, preempted, in a step in flight) end at once with
    their blocks freed; every other request gets exactly the scripted continuation."""
    rng = random.Random(seed)
    executor = ScriptedExecutor(closed_form)
    engine = make_engine(model_config, tokenizer, executor, async_scheduling)
    prompts: dict[int, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for _ in range(12):  # long enough that 4 of them overflow the cache: preemptions
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 60))]
        prompts[engine.add_request(prompt, params, stream=rng.random() < 0.5)] = prompt
    outputs: dict[str, list[RequestOutput]] = {}
    aborted: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        live = list(engine.scheduler.requests)
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            free_before = engine.scheduler.kv.num_free_blocks
            held = len(engine.scheduler.kv.blocks.get(victim, []))
            last = engine.abort_request(victim)
            assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"
            assert engine.scheduler.kv.num_free_blocks == free_before + held
            assert victim not in engine.scheduler.kv.blocks
            assert engine.abort_request(victim) is None  # already gone
            outputs.setdefault(last.request_id, []).append(last)
            aborted.add(victim)
    assert aborted and engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.num_free_blocks == NUM_BLOCKS
    for req_id, prompt in prompts.items():
        outs = outputs[str(req_id)]  # a streamed request's deltas, or another's one whole output
        token_ids = [t for o in outs for t in o.outputs[0].token_ids]
        want = [closed_form(req_id, len(prompt) + i) for i in range(len(token_ids))]
        assert token_ids == want
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert outs[-1].outputs[0].finish_reason == ("abort" if req_id in aborted else "length")
        if req_id not in aborted:
            assert len(token_ids) == 20


# ----------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def tiny_llm() -> Iterator[LLM]:
    with LLM("tiny-llama-tp", device="cpu", max_model_len=256, max_num_seqs=8) as llm:
        yield llm


def test_abort_mid_generation_on_the_real_model(tiny_llm: LLM) -> None:
    prompts = [[1, 15, 27, 300, 41], [1, 99, 98, 97], [1, 5, 6, 7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    engine = tiny_llm.engine
    total = engine.num_kv_blocks
    ids = [engine.add_request(p, greedy, stream=True) for p in prompts]
    victim = ids[1]
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
        if steps == 5:  # running, with a step in flight that holds it
            assert victim in engine.scheduler.kv.blocks
            used = total - engine.scheduler.kv.num_free_blocks
            last = engine.abort_request(victim)
            assert last is not None and last.outputs[0].finish_reason == "abort"
            assert victim not in engine.scheduler.kv.blocks
            assert total - engine.scheduler.kv.num_free_blocks < used
    assert engine.scheduler.kv.num_free_blocks == total
    tok = tiny_llm.get_tokenizer()
    for req_id, ref in zip(ids, reference, strict=True):
        if req_id == victim:
            continue
        text, token_ids = joined(outputs[str(req_id)])
        assert token_ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text == tok.decode(token_ids, skip_special_tokens=True)
    # The aborted request's blocks went back and nothing was left behind: the next batch is unaffected.
    again = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]


def test_streamed_logprobs_match_generate(tiny_llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    prompt = [1, 15, 27, 300, 41]
    [reference] = tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    engine = tiny_llm.engine
    req = engine.add_request(prompt, params, stream=True)
    deltas = run_all(engine)[str(req)]
    logprobs = [lp for d in deltas for lp in d.outputs[0].logprobs or []]
    ref = reference.outputs[0]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == ref.token_ids
    assert logprobs == ref.logprobs and deltas[-1].outputs[0].cumulative_logprob == pytest.approx(
        ref.cumulative_logprob
    )
    assert deltas[0].prompt_logprobs == reference.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])


# ----------------------------------------------------------------------------------- the engine thread
async def collect(stream: Any) -> dict[int, list[RequestOutput]]:
    got: dict[int, list[RequestOutput]] = {}
    async for index, out in stream:
        got.setdefault(index, []).append(out)
    return got


def idle_iterations(async_engine: AsyncLLMEngine, executor: ScriptedExecutor, count: int) -> list[int]:
    """The engine thread's iteration count at each of its next `count` liveness checks."""
    seen: list[int] = []
    done = threading.Event()

    def record() -> None:  # on the engine thread
        if len(seen) < count:
            seen.append(async_engine.iterations)
        if len(seen) == count:
            done.set()

    executor.on_check_alive = record
    assert done.wait(60), f"the idle engine thread checked its workers {len(seen)} times"
    executor.on_check_alive = None
    return seen


def test_engine_thread_streams_outputs_and_idles_without_spinning(model_config: Any, tokenizer: Any) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    executor = ScriptedExecutor(text_script(ids, len(PROMPT)))
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor), idle_check_s=0.01)
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main() -> list[dict[int, list[RequestOutput]]]:
        streams = [async_engine.add([(PROMPT, params), (PROMPT, params)]) for _ in range(3)]
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(main())
        for got in results:
            assert sorted(got) == [0, 1]
            for deltas in got.values():
                text, token_ids = joined(deltas)
                assert token_ids == ids[:30] and text == tokenizer.decode(ids[:30])
        # Idle: the thread blocks on its queue, waking only to check the workers: one iteration per check.
        seen = idle_iterations(async_engine, executor, 5)
        assert [b - a for a, b in itertools.pairwise(seen)] == [1] * 4, seen
        assert async_engine.stats.kv_blocks_used == 0 and async_engine.stats.num_running == 0
    finally:
        async_engine.shutdown()
    assert executor.shut_down


def test_engine_thread_abort_and_drain(model_config: Any, tokenizer: Any) -> None:
    """Steps advance only when the test releases them, so each check follows an observed event."""
    gate = threading.Semaphore(0)
    executor = ScriptedExecutor(closed_form, gate)
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor))
    async_engine.start()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main() -> None:
        doomed = async_engine.add([(PROMPT, long)])
        keep = async_engine.add([(PROMPT, short)])
        gate.release()
        index, first = await doomed.__anext__()  # the first token of the doomed request is out
        assert index == 0 and not first.finished and async_engine.stats.kv_blocks_used > 0
        async_engine.abort(doomed)
        for _ in range(4):
            gate.release()
        got = await collect(keep)
        assert [t for o in got[0] for t in o.outputs[0].token_ids] == [
            closed_form(int(first.request_id) + 1, len(PROMPT) + i) for i in range(3)
        ]
        # Drain: shutdown waits for the request in flight, up to its grace period, then aborts it.
        draining = async_engine.add([(PROMPT, long)])
        gate.release()
        await draining.__anext__()
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, async_engine.shutdown, 0.0)
        while async_engine.accepting:  # shutdown() refuses new requests first
            await asyncio.sleep(0.001)
        with pytest.raises(EngineClosedError, match="shutting down"):
            async_engine.add([(PROMPT, short)])
        for _ in range(3):
            gate.release()
        rest = await collect(draining)
        assert rest[0][-1].finished and rest[0][-1].outputs[0].finish_reason == "abort"
        await stopping

    asyncio.run(main())
    assert executor.shut_down and async_engine.stats.kv_blocks_used == 0


def test_drain_returns_at_once_and_a_shorter_grace_brings_the_end_forward(
    model_config: Any, tokenizer: Any
) -> None:
    """What the server does on a signal: drain(grace) refuses new requests but lets the running one go on;
    a second drain(0) (a second signal) ends it at once with finish_reason "abort", and the thread stops
    the engine by itself."""
    gate = threading.Semaphore(0)
    executor = ScriptedExecutor(closed_form, gate)
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor))
    async_engine.start()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> list[RequestOutput]:
        stream = async_engine.add([(PROMPT, long)])
        gate.release()
        got = [(await stream.__anext__())[1]]
        async_engine.drain(600.0)  # returns at once
        with pytest.raises(EngineClosedError, match="shutting down"):
            async_engine.add([(PROMPT, long)])
        gate.release()
        got.append((await stream.__anext__())[1])  # still running within its grace period
        async_engine.drain(0.0)
        gate.release(5)  # the step in flight, if any, completes
        got += (await collect(stream)).get(0, [])
        return got

    try:
        outputs = asyncio.run(main())
        assert [o.finished for o in outputs[:2]] == [False, False]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        async_engine._thread.join(60)
        assert not async_engine._thread.is_alive() and executor.shut_down
    finally:
        gate.release(1000)
        async_engine.shutdown()


def test_engine_thread_surfaces_a_dead_engine(model_config: Any, tokenizer: Any) -> None:
    """Every stream ends with an EngineClosedError of its own (raising one exception object in several
    readers would mutate its traceback under the others) that names the cause in one line."""
    executor = ScriptedExecutor(closed_form)
    executor.fail_at_step = 3
    executor.fail_after_requests = 3  # all three streams are in before the engine dies
    streams: list[Any] = []
    executor.hold_until = lambda: len(streams) == 3  # and none has finished before the last is added
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main() -> list[BaseException]:
        for _ in range(3):
            streams.append(async_engine.add([(PROMPT, params)]))
        errors = []
        for stream in streams:
            with pytest.raises(EngineClosedError) as info:
                await collect(stream)
            errors.append(info.value)
        with pytest.raises(EngineClosedError, match="the engine died: WorkerDiedError"):
            async_engine.add([(PROMPT, params)])
        return errors

    try:
        errors = asyncio.run(main())
        async_engine._thread.join(60)  # the streams hear of the failure before the thread stops the engine
        assert isinstance(async_engine.error, WorkerDiedError) and executor.shut_down
        assert len({id(e) for e in errors}) == 3
        for error in errors:
            assert str(error) == "the engine died: WorkerDiedError: worker rank 1 died: killed by the test"
            assert error.__cause__ is async_engine.error
    finally:
        async_engine.shutdown()


def test_idle_engine_thread_notices_a_dead_worker(model_config: Any, tokenizer: Any) -> None:
    """With no request to step, the thread still checks the workers every idle_check_s; a dead one fails
    the engine as a failed step does."""
    executor = ScriptedExecutor(closed_form)
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor), idle_check_s=0.01)
    async_engine.start()
    try:
        idle_iterations(async_engine, executor, 2)  # it is idle and checking
        executor.dead = WorkerDiedError(1, "exit code -9")
        async_engine._thread.join(60)
        assert not async_engine._thread.is_alive()
        assert async_engine.error is executor.dead and executor.shut_down

        async def add() -> None:
            async_engine.add([(PROMPT, SamplingParams(max_tokens=2))])

        with pytest.raises(EngineClosedError, match=r"the engine died: WorkerDiedError: worker rank 1 died"):
            asyncio.run(add())
    finally:
        async_engine.shutdown()


REMOTE_TRACEBACK = (
    'Traceback (most recent call last):\n  File "/srv/secret/worker.py", line 7, in execute_model\n'
    "    run()\nRuntimeError: CUDA error: secret detail\n"
)


def test_a_worker_traceback_is_logged_once_and_never_reaches_streams(
    model_config: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    executor = ScriptedExecutor(closed_form)
    executor.fail_at_step = 2
    executor.failure = WorkerError(1, REMOTE_TRACEBACK)
    async_engine = AsyncLLMEngine(make_engine(model_config, tokenizer, executor))
    caplog.set_level(logging.ERROR)
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    summary = "WorkerError: worker rank 1 failed (RuntimeError); see the server log"
    assert describe_failure(executor.failure) == summary

    async def main() -> list[str]:
        stream = async_engine.add([(PROMPT, params)])
        with pytest.raises(EngineClosedError) as info:
            await collect(stream)
        with pytest.raises(EngineClosedError) as refused:
            async_engine.add([(PROMPT, params)])
        return [str(info.value), str(refused.value)]

    try:
        messages = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert messages == [f"the engine died: {summary}"] * 2
    logged = [r for r in caplog.records if "secret detail" in r.getMessage()]
    assert len(logged) == 1 and "Traceback (most recent call last)" in logged[0].getMessage()


def test_describe_failure_is_one_short_line() -> None:
    assert describe_failure(WorkerError(0, "(no traceback)")) == (
        "WorkerError: worker rank 0 failed (an exception); see the server log"
    )
    assert describe_failure(WorkerError(2, "Traceback ...\ntorch.OutOfMemoryError: 40 GiB\n")) == (
        "WorkerError: worker rank 2 failed (torch.OutOfMemoryError); see the server log"
    )
    long = describe_failure(RuntimeError("x" * 500 + "\nsecond line"))
    assert long.startswith("RuntimeError: xxx") and len(long) < 250 and "second" not in long
    assert describe_failure(ValueError()) == "ValueError"


def _sentencepiece_style_tokenizer() -> Any:
    """A Llama-2-style tokenizer: Metaspace words ("▁Paris"), byte fallback, and a decoder that strips the
    leading space of a text's first word, so a word decoded alone loses its space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ])  # fmt: skip
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    corpus = [TEXT, "The capital of France is Paris. The capital of Spain is Madrid."]
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_output_text_keeps_the_space_its_first_word_begins_with(model_config: Any) -> None:
    """A SentencePiece-style decoder drops the leading space of a text's first word; the output is decoded
    after the prompt's last tokens, so its text is what it adds to the prompt's text, as vLLM and
    transformers' text-generation pipeline give it: " Paris." after "... is", streamed, whole, and cut by a
    stop string alike."""
    tok = _sentencepiece_style_tokenizer()
    prompt = tok("The capital of France is")["input_ids"]
    ids = tok(" Paris. The capital of Spain is Madrid.", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[0]).startswith("▁") and not tok.decode(ids).startswith(" ")
    prompt_text = tok.decode(prompt, skip_special_tokens=True)
    want = tok.decode(prompt + ids, skip_special_tokens=True)[len(prompt_text) :]
    assert want.startswith(" Paris.")
    engine = make_engine(model_config, tok, ScriptedExecutor(text_script(ids, len(prompt))))
    plain = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)
    stopped = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, stop="Spain")
    streamed, whole = engine.add_request(prompt, plain, stream=True), engine.add_request(prompt, plain)
    cut = engine.add_request(prompt, stopped)
    outputs = run_all(engine)
    assert joined(outputs[str(streamed)])[0] == want
    assert outputs[str(whole)][0].outputs[0].text == want
    assert outputs[str(cut)][0].outputs[0].text == want[: want.index("Spain")]


def test_a_prompt_ending_inside_a_character_streams_the_whole_text(model_config: Any, tokenizer: Any) -> None:
    """A prompt whose last token begins a character the output's first token completes (token-id prompts
    can): the output is decoded after the prompt's tokens before that byte, so the streamed pieces join
    into the whole text, with or without a stop string."""
    first, second = tokenizer("ö", add_special_tokens=False)["input_ids"]
    prompt = [1, *tokenizer("Kö", add_special_tokens=False)["input_ids"][:-1]]
    assert prompt[-1] == first
    ids = [second, *tokenizer("ln ok", add_special_tokens=False)["input_ids"]]
    want = tokenizer.decode(ids, skip_special_tokens=True)
    engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(prompt))))
    params = [
        SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, stop="zzz"),
    ]
    pairs = [(engine.add_request(prompt, p, stream=True), engine.add_request(prompt, p)) for p in params]
    outputs = run_all(engine)
    for streamed, whole in pairs:
        assert joined(outputs[str(streamed)])[0] == outputs[str(whole)][0].outputs[0].text == want


def test_a_stop_string_within_the_min_tokens_text_is_not_found(model_config: Any, tokenizer: Any) -> None:
    """Whatever other stop strings are listed (a longer one widens no search): a stop string that lies
    wholly in the first min_tokens tokens' text does not end the request, one that ends after it does
    (whole characters here: an unfinished one the detokenizer held back would count as after)."""
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "abcdab"]
    engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))))
    cases = {
        ("ab",): ("abcd", "stop"),
        ("ab", "zzzzzz"): ("abcd", "stop"),
        ("bc",): ("a", "stop"),
        ("bc", "zzzzzz"): ("a", "stop"),
    }
    requests = {}
    for stops in cases:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=2, stop=list(stops))
        requests[stops] = engine.add_request(PROMPT, params, stream=True), engine.add_request(PROMPT, params)
    outputs = run_all(engine)
    for stops, (text, reason) in cases.items():
        streamed, whole = requests[stops]
        final = outputs[str(whole)][0].outputs[0]
        assert (final.text, final.finish_reason) == (text, reason), stops
        assert joined(outputs[str(streamed)])[0] == text, stops


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_request_metrics_order_arrival_scheduling_and_first_token(
    model_config: Any, tokenizer: Any, async_scheduling: bool
) -> None:
    """RequestOutput.metrics: each request is first scheduled after it arrived and gets its first token
    after that; the two requests beyond max_num_seqs=4 wait in the queue until a running one has
    finished, so they are first scheduled after every running request's first token."""
    ids = tokenizer("hello there world", add_special_tokens=False)["input_ids"]
    engine = make_engine(model_config, tokenizer, ScriptedExecutor(text_script(ids, len(PROMPT))),
                         async_scheduling)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    req_ids = [engine.add_request(PROMPT, params, stream=i % 2 == 0) for i in range(6)]
    outputs = run_all(engine)
    times = []
    for req_id in req_ids:
        outs = outputs[str(req_id)]
        m = outs[-1].metrics
        assert m is not None and m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
        # A stream's first delta with a token already says when that token came.
        first = next(o for o in outs if o.outputs[0].token_ids)
        assert first.metrics is not None and first.metrics.first_token_time == m.first_token_time
        times.append(m)
    running, queued = times[:4], times[4:]
    assert all(q.first_scheduled_time > max(r.first_token_time for r in running) for q in queued)  # type: ignore[operator]
