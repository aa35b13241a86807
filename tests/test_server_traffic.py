"""`tp-runtime serve` under a seeded storm of mixed traffic, against `LLM.generate` / `LLM.chat` alone.

Many asyncio clients arrive at random moments, each with a random request: completions (one prompt, two,
token ids) and chat, streamed and not, greedy and seeded, n up to 3, logprobs, stop strings and
stop_token_ids, min_tokens, max_tokens from 1 to past the context, structured outputs (JSON schema, regex,
choice), logit_bias and allowed_token_ids, prompts sharing long prefixes and identical prompts. Some
streams are dropped after their k-th chunk (an event, not a timer), some plain requests give up on a short
read timeout (either outcome is fine: a response that comes is checked), a few bodies are malformed. The
server's KV cache, batch and token budget are small, so requests are preempted and prefills chunked.

Every answer must be the reference's (greedy and seeded outputs do not depend on the batch), every stream
must join into it with one finish per choice and the right usage, the malformed ones get 400/404, every
choice of a dropped stream (EOS ignored, up to the context: only an abort ends it soon) counts as aborted,
and afterwards the engine holds nothing (no request running or waiting, no KV block in use) and still
answers. At TP 1 and 2.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import Server, start_server

from tp_runtime import LLM, SamplingParams
from tp_runtime.sampling_params import StructuredOutputsParams

MODEL = "tiny-llama-tp"
MAX_LEN = 160
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "to", "big", "red", "house"]
SCHEMA = {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
    "required": ["a", "b"], "additionalProperties": False,
}  # fmt: skip
# Small on purpose: 12 blocks of 16 tokens hold one full-length sequence and a bit.
SERVER_FLAGS = (
    "--max-model-len", str(MAX_LEN), "--chat-template", TEMPLATE, "--num-kv-blocks", "12", "--block-size",
    "16", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
)  # fmt: skip
NUM_REQUESTS = 36


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tp(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def server(tp: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(MODEL, tp, tmp_path_factory.mktemp("traffic"), *SERVER_FLAGS)
    yield server
    assert server.stop() == 0, server.output()[-4000:]
    assert "Traceback" not in server.output(), server.output()[-4000:]


def _request(rng: random.Random, prefixes: list[str]) -> dict[str, Any]:
    """One random request: its path, body and fault (None, ("drop", k), ("give_up",), ("malformed", i))."""
    chat = rng.random() < 0.4
    text = rng.choice(prefixes)
    if rng.random() < 0.8:  # else the shared prefix alone: identical prompts
        text += " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
    body: dict[str, Any] = {"model": ""}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        shape = rng.random()
        body["prompt"] = (
            [text, rng.choice(prefixes)] if shape < 0.15
            else [rng.randint(3, 999) for _ in range(rng.randint(1, 30))] if shape < 0.25 else text
        )  # fmt: skip
    if rng.random() < 0.5:
        body.update(temperature=0.8, seed=rng.randint(0, 1000))
    else:
        body["temperature"] = 0
    body["n"] = rng.choice([1, 1, 2, 3])
    length = rng.random()
    body["max_tokens"] = (
        1 if length < 0.1 else None if length < 0.15 else rng.randint(120, 170) if length < 0.2
        else rng.randint(2, 16)
    )  # fmt: skip
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 3)} if chat else {"logprobs": 2})
    if rng.random() < 0.25:
        body["stop"] = rng.sample(["e", " the", "a", "at", "ou"], rng.randint(1, 2))
    if rng.random() < 0.15:
        body["stop_token_ids"] = rng.sample(range(3, 1000), 3)
    constraint = rng.random()
    if constraint < 0.06:
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe so"]}
    elif constraint < 0.12:
        body["structured_outputs"] = {"regex": "[a-c]{2,5}( [0-9]+)?"}
    elif constraint < 0.18:
        body["structured_outputs"] = {"json": SCHEMA}
    elif constraint < 0.26:
        body["logit_bias"] = {str(rng.randint(3, 999)): rng.choice([-100, 5, 100]) for _ in range(2)}
    elif constraint < 0.32:
        body["allowed_token_ids"] = rng.sample(range(3, 1000), 6)
    elif rng.random() < 0.3:
        body["min_tokens"] = rng.randint(1, 3)
    body["stream"] = rng.random() < 0.5
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    fault: tuple[Any, ...] | None = None
    roll = rng.random()
    if roll < 0.25 and body["stream"]:
        fault = ("drop", rng.randint(1, 3))
        # Up to the context (null), EOS ignored: tokens to go when dropped.
        for name in ("stop", "stop_token_ids", "structured_outputs", "min_tokens"):
            body.pop(name, None)
        body.update(max_tokens=None, ignore_eos=True)
    elif roll < 0.12:
        fault = ("give_up",)
    elif roll < 0.2:
        fault = ("malformed", rng.randrange(len(MALFORMED)))
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "fault": fault}


MALFORMED = [
    lambda body: b'{"prompt": ',
    lambda body: json.dumps({**body, "n": 0}).encode(),
    lambda body: json.dumps({**body, "model": "another-model"}).encode(),
    lambda body: json.dumps({**body, "temperature": "hot"}).encode(),
    lambda body: json.dumps({**body, "stop_token_ids": [10**6]}).encode(),
]


async def _send(client: httpx.AsyncClient, url: str, req: dict[str, Any], delay: float) -> dict[str, Any]:
    await asyncio.sleep(delay)  # the arrival time only: no check depends on it
    body, fault = req["body"], req["fault"]
    result: dict[str, Any] = {}
    if fault is not None and fault[0] == "malformed":
        raw = MALFORMED[fault[1]](body)
        headers = {"Content-Type": "application/json"}
        response = await client.post(url + req["path"], content=raw, headers=headers)
        return {"status": response.status_code}
    if body["stream"]:
        events: list[Any] = []
        async with client.stream("POST", url + req["path"], json=body) as response:
            result["status"] = response.status_code
            if response.status_code != 200:
                result["error"] = json.loads(await response.aread())["error"]["message"]
                return result
            async for line in response.aiter_lines():
                if line:
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if fault is not None and len(events) == fault[1]:
                        return {"dropped": True}  # leaving the block closes the connection mid-stream
        return {"status": 200, "events": events}
    try:
        timeout = httpx.Timeout(60, read=0.05 if fault is not None else 60)
        response = await client.post(url + req["path"], json=body, timeout=timeout)
    except httpx.ReadTimeout:
        return {"dropped": True}
    result = {"status": response.status_code, "json": response.json()}
    if response.status_code != 200:
        result["error"] = result["json"]["error"]["message"]
    return result


async def _storm(url: str, requests: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
        return await asyncio.gather(*(_send(client, url, r, rng.uniform(0, 1.0)) for r in requests))


def _num_choices(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)
    return int(body["n"]) * (len(prompt) if several and prompt is not None else 1)


def _params(body: dict[str, Any], chat: bool) -> SamplingParams:
    structured = body.get("structured_outputs")
    logprobs = body.get("top_logprobs") if chat else body.get("logprobs")
    bias = body.get("logit_bias")
    return SamplingParams(
        temperature=body["temperature"], seed=body.get("seed"), n=body["n"],
        max_tokens=body["max_tokens"],  # null: up to the context, for both (as vLLM)
        min_tokens=body.get("min_tokens", 0), stop=body.get("stop"),
        stop_token_ids=body.get("stop_token_ids"), logprobs=logprobs if body.get("logprobs") else None,
        logit_bias={int(k): v for k, v in bias.items()} if bias else None,
        allowed_token_ids=body.get("allowed_token_ids"), ignore_eos=body.get("ignore_eos", False),
        structured_outputs=StructuredOutputsParams(**structured) if structured else None,
    )  # fmt: skip


def _reference(llm: LLM, req: dict[str, Any]) -> tuple[list[Any], int] | None:
    """The reference's choices (text, finish_reason, token count, logprobs of the chosen tokens) and prompt
    tokens; None where the request does not fit the context (the server's 400)."""
    body, chat = req["body"], req["path"] == "/v1/chat/completions"
    params = _params(body, chat)
    if chat:
        outputs = llm.chat(body["messages"], params, use_tqdm=False, chat_template=TEMPLATE)
    else:
        prompt = body["prompt"]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        several = isinstance(prompt, list) and not is_ids
        prompts = [{"prompt_token_ids": prompt}] if is_ids else prompt if several else [prompt]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        if params.max_tokens is not None and len(out.prompt_token_ids) + params.max_tokens > MAX_LEN:
            return None
    choices = [
        (c.text, c.finish_reason, len(c.token_ids),
         None if c.logprobs is None else [p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True)])
        for out in outputs for c in out.outputs
    ]  # fmt: skip
    return choices, sum(len(out.prompt_token_ids) for out in outputs)


def _joined(events: list[Any], num_choices: int, chat: bool) -> tuple[list[Any], dict[str, Any] | None]:
    """A stream's choices (text, finish_reason, logprobs) and its usage; one finish per choice."""
    assert events and events[-1] == "[DONE]", events[-2:]
    texts, finishes = [""] * num_choices, [None] * num_choices
    logprobs: list[list[float]] = [[] for _ in range(num_choices)]
    usage = None
    for event in events[:-1]:
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            k = choice["index"]
            texts[k] += (choice["delta"].get("content") or "") if chat else choice["text"]
            if choice.get("logprobs"):
                logprobs[k] += _logprobs(choice["logprobs"], chat)
            if choice.get("finish_reason"):
                assert finishes[k] is None, f"choice {k} finished twice"
                finishes[k] = choice["finish_reason"]
    return list(zip(texts, finishes, logprobs, strict=True)), usage


def _logprobs(given: dict[str, Any], chat: bool) -> list[float]:
    """The chosen tokens' logprobs, in either endpoint's shape."""
    return [e["logprob"] for e in given["content"]] if chat else list(given["token_logprobs"])


def _close(got: list[float], want: list[float] | None) -> bool:
    # (the server clamps a logprob of -inf to -9999)
    return want is None or (
        len(got) == len(want)
        and all(math.isclose(a, max(b, -9999.0), abs_tol=1e-3) for a, b in zip(got, want, strict=True))
    )


def test_mixed_traffic_matches_llm_alone(server: Server, tp: int) -> None:
    aborted_before = server.metric("request_success_total", finished_reason="abort")
    rng = random.Random(2024)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 30))) for _ in range(3)]
    requests = [_request(rng, prefixes) for _ in range(NUM_REQUESTS)]
    results = asyncio.run(_storm(server.url, requests, rng))

    # The engine holds nothing once every client is answered or gone.
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"):
        server.wait_for_metric(gauge, lambda v: v == 0)
    assert server.metric("kv_cache_usage_perc") == 0
    # Each choice of a stream dropped long before its end was aborted (else it ran on to its length).
    dropped = sum(
        _num_choices(req["body"]) for req, result in zip(requests, results, strict=True)
        if result.get("dropped") and req["body"]["stream"]
    )  # fmt: skip
    aborted = server.metric("request_success_total", finished_reason="abort") - aborted_before
    assert dropped > 0 and aborted >= dropped, (dropped, aborted)

    checked = 0
    with LLM(MODEL, tensor_parallel_size=tp, device="cpu", max_model_len=MAX_LEN) as llm:
        for i, (req, result) in enumerate(zip(requests, results, strict=True)):
            body, chat, fault = req["body"], req["path"] == "/v1/chat/completions", req["fault"]
            where = f"request {i}: {json.dumps(body)[:300]}"
            if fault is not None and fault[0] == "malformed":
                assert result["status"] in (400, 404), (where, result)
                continue
            if result.get("dropped"):
                continue
            try:
                reference = _reference(llm, req)
            except ValueError as exc:  # the server refuses what LLM refuses (min_tokens > max_tokens, ...)
                assert result["status"] == 400, (where, str(exc), result)
                continue
            if reference is None:
                assert result["status"] == 400 and "context length" in result["error"], (where, result)
                continue
            assert result["status"] == 200, (where, result)
            want, prompt_tokens = reference
            if body["stream"]:
                got, usage = _joined(result["events"], len(want), chat)
            else:
                choices = sorted(result["json"]["choices"], key=lambda c: c["index"])
                got = [
                    ((c["message"]["content"] or "") if chat else c["text"], c["finish_reason"],
                     _logprobs(c["logprobs"], chat) if c.get("logprobs") else [])
                    for c in choices
                ]  # fmt: skip
                usage = result["json"]["usage"]
            assert [g[:2] for g in got] == [w[:2] for w in want], where
            assert all(_close(g[2], w[3]) for g, w in zip(got, want, strict=True)), where
            if usage is not None:
                assert usage["prompt_tokens"] == prompt_tokens, where
                assert usage["completion_tokens"] == sum(w[2] for w in want), where
            checked += 1
        assert checked >= NUM_REQUESTS // 2, checked

        # The server still answers, as LLM does.
        [ref] = llm.generate([prefixes[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    again = {"prompt": prefixes[0], "max_tokens": 8, "temperature": 0}
    after = httpx.post(f"{server.url}/v1/completions", json=again, timeout=60).json()
    assert after["choices"][0]["text"] == ref.outputs[0].text
