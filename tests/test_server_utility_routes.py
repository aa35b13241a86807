"""`tp-runtime serve`'s utility routes (/tokenize, /detokenize, /version, /v1/models/{id}) and request
fields beyond sampling, against two real servers for the module (started together): `keyed` (`python -m
tp_runtime.server.cli tiny-llama-tp` with a chat template and an API key) and `trusting` (no template of
its own, `--trust-request-chat-template`, served as an org/model name). Every answer is checked against
an independent reference: the checkpoint's tokenizer, the installed package's metadata, or
`LLM.generate` / `LLM.chat` on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import cli_servers
from test_server import InProcess
from test_streaming_engine import VOCAB, ScriptedExecutor, closed_form

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import build_model_config
from tp_runtime.presets import build_preset_tokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama-tp"
SLASHED = "test-org/tiny-llama"  # the trusting server's name, as an org/model name is written
MAX_MODEL_LEN = 256
API_KEY = "utility-key"
START_DEADLINE_S = 180.0
REQUEST_TIMEOUT_S = 60.0
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A request's own template, different from the server's.
OTHER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
PROMPT = "Hello, my name is"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


class Server:
    def __init__(self, url: str, key: str | None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(
            f"{self.url}{path}", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs
        )

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    base = [
        MODEL, "--device", "cpu", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN),
        "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    flags = {
        "keyed": [*base, "--chat-template", TEMPLATE, "--api-key", API_KEY],
        "trusting": [*base, "--trust-request-chat-template", "--served-model-name", SLASHED],
    }
    with cli_servers(tmp_path_factory.mktemp("utility"), flags, START_DEADLINE_S) as urls:
        yield {"keyed": Server(urls["keyed"], API_KEY), "trusting": Server(urls["trusting"], None)}


@pytest.fixture(scope="module")
def keyed(servers: dict[str, Server]) -> Server:
    return servers["keyed"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(MODEL, device="cpu", max_model_len=MAX_MODEL_LEN) as reference:
        yield reference


def _error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def _greedy_text(llm: LLM, ids: list[int]) -> str:
    params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].text


# ------------------------------------------------------------ fields honoured, or refused by name


def test_add_special_tokens_on_completions(keyed: Server, llm: LLM) -> None:
    """vLLM's default (true) puts the tokenizer's BOS in front of a string prompt; false leaves it out, and
    the output is LLM.generate's on the bare token ids (echo then gives the prompt's text alone)."""
    tok = llm.get_tokenizer()
    bare = tok(PROMPT, add_special_tokens=False)["input_ids"]
    full = tok(PROMPT, add_special_tokens=True)["input_ids"]
    assert len(full) == len(bare) + 1
    for special, ids in ((True, full), (False, bare)):
        body = {"prompt": PROMPT, "add_special_tokens": special, "echo": True, **GREEDY}
        response = keyed.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(ids)
        assert response.json()["choices"][0]["text"] == PROMPT + _greedy_text(llm, ids)


def test_add_special_tokens_on_chat(keyed: Server, llm: LLM) -> None:
    """vLLM's default (false) takes the rendered template's tokens alone; true adds the tokenizer's special
    tokens (a second BOS) on top, and the output is LLM.generate's on those ids."""
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    reference = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False, chat_template=TEMPLATE)[0]  # fmt: skip
    default = keyed.post("/v1/chat/completions", {"messages": MESSAGES, **GREEDY}).json()
    assert default["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    assert default["choices"][0]["message"]["content"] == reference.outputs[0].text
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert len(ids) == len(reference.prompt_token_ids) + 1
    response = keyed.post(
        "/v1/chat/completions", {"messages": MESSAGES, "add_special_tokens": True, **GREEDY}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    assert response.json()["choices"][0]["message"]["content"] == _greedy_text(llm, ids)


def test_a_request_chat_template_needs_a_trusting_server(servers: dict[str, Server], llm: LLM) -> None:
    """vLLM's rule: a request's own template (code the server renders) only with
    --trust-request-chat-template; there it is LLM.chat(chat_template=...)'s answer, also on a model that
    has no template of its own."""
    body = {"messages": MESSAGES, "chat_template": OTHER_TEMPLATE, **GREEDY}
    error = _error(servers["keyed"].post("/v1/chat/completions", body), 400, "chat_template")
    assert "--trust-request-chat-template" in error["message"]
    trusting = servers["trusting"]
    response = trusting.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    reference = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False, chat_template=OTHER_TEMPLATE)[0]  # fmt: skip
    assert response.json()["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    assert response.json()["choices"][0]["message"]["content"] == reference.outputs[0].text
    # Without one, that server has no template to render with; a broken one names the field.
    _error(trusting.post("/v1/chat/completions", {"messages": MESSAGES}), 400, "messages")
    broken = {"messages": MESSAGES, "chat_template": "{{ raise_exception('no') }}"}
    _error(trusting.post("/v1/chat/completions", broken), 400, "chat_template")


def test_documents_and_content_parts_reach_the_template_as_in_llm_chat(
    servers: dict[str, Server], llm: LLM
) -> None:
    """A request's `documents` (vLLM's field) reach the template, and a template that loops over a message's
    content gets its text parts: each prompt is LLM.chat's. Both were lost (the documents dropped unseen,
    the parts joined into one string the template looped over character by character)."""
    template = (
        "{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}"
        "{% endfor %}"
    )
    documents = [{"title": "cats", "text": "the mat"}]
    parts = [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]
    messages = [{"role": "user", "content": parts}]
    body = {"messages": messages, "chat_template": template, "documents": documents, **GREEDY}
    response = servers["trusting"].post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = llm.chat(messages, greedy, use_tqdm=False, chat_template=template, documents=documents)[0]
    assert reference.prompt is not None and reference.prompt.startswith("[cats]user:the|cat|")
    assert response.json()["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    assert response.json()["choices"][0]["message"]["content"] == reference.outputs[0].text


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "echo", True),
        ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("/v1/chat/completions", "function_call", "auto"),
        ("/v1/chat/completions", "return_tokens_as_token_ids", True),
        ("/v1/completions", "return_tokens_as_token_ids", True),
    ],
)
def test_fields_not_honoured_are_refused_by_name(keyed: Server, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"max_tokens": 1}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    _error(keyed.post(path, {**body, field: value}), 400, field)
    # Their defaults (and null) ask for nothing: served.
    default = {"echo": False, "functions": None, "function_call": None, "return_tokens_as_token_ids": False}
    response = keyed.post(path, {**body, field: default[field]})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------------------------- /tokenize


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_a_text_as_completions_does(keyed: Server, llm: LLM, special: bool) -> None:
    ids = llm.get_tokenizer()(PROMPT, add_special_tokens=special)["input_ids"]
    body = {"model": MODEL, "prompt": PROMPT, "add_special_tokens": special}
    response = keyed.post("/tokenize", body)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": None,
    }
    strs = keyed.post("/tokenize", {**body, "return_token_strs": True}).json()["token_strs"]
    assert strs == llm.get_tokenizer().convert_ids_to_tokens(ids)
    completion = keyed.post(
        "/v1/completions", {"prompt": PROMPT, "add_special_tokens": special, "max_tokens": 1}
    )
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)
    # An empty text has tokens too (the BOS), though no completion is made from it.
    empty = keyed.post("/tokenize", {"prompt": "", "add_special_tokens": special}).json()
    assert empty["tokens"] == llm.get_tokenizer()("", add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"unused": 1}},
    ],
    ids=["default", "no-generation-prompt", "continue", "special-tokens", "kwargs"],
)
def test_tokenize_a_conversation_as_chat_does(keyed: Server, llm: LLM, fields: dict[str, Any]) -> None:
    messages = (
        [*MESSAGES, {"role": "assistant", "content": "Blue"}]
        if "continue_final_message" in fields
        else MESSAGES
    )
    text = llm.get_tokenizer().apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=fields.get("add_generation_prompt", True),
        continue_final_message=fields.get("continue_final_message", False),
    )  # fmt: skip
    ids = llm.get_tokenizer()(text, add_special_tokens=fields.get("add_special_tokens", False))["input_ids"]
    response = keyed.post("/tokenize", {"messages": messages, "return_token_strs": True, **fields})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids and response.json()["count"] == len(ids)
    assert response.json()["token_strs"] == llm.get_tokenizer().convert_ids_to_tokens(ids)
    chat = keyed.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, **fields})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)


def test_tokenize_shows_the_tools_and_a_trusted_template(servers: dict[str, Server], llm: LLM) -> None:
    """The request's own template (on the trusting server) and its tools render as chat renders them."""
    template = "{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}" + OTHER_TEMPLATE
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": MESSAGES, "chat_template": template, "tools": [tool]}
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        MESSAGES, chat_template=template, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert "<get_weather>" in text
    tokens = servers["trusting"].post("/tokenize", body).json()["tokens"]
    assert tokens == tok(text, add_special_tokens=False)["input_ids"]
    chat = servers["trusting"].post("/v1/chat/completions", {**body, "tool_choice": "none", "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    without = servers["trusting"].post("/tokenize", {**body, "tools": None}).json()
    assert without["count"] < len(tokens)
    # The keyed server takes no request template here either.
    _error(servers["keyed"].post("/tokenize", body), 400, "chat_template")


def test_empty_tools_reach_the_template_on_chat_as_on_tokenize(servers: dict[str, Server], llm: LLM) -> None:
    """`tools: []` goes to the template as an empty list (vLLM passes a request's tools as given), on chat
    as on /tokenize: a template that asks `tools is not none` (as Llama 3.1's does) renders it alike."""
    template = "{% if tools is not none %}[tools: {{ tools | length }}]{% endif %}" + OTHER_TEMPLATE
    body = {"messages": MESSAGES, "chat_template": template, "tools": []}
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, chat_template=template, tools=[], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert "[tools: 0]" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert servers["trusting"].post("/tokenize", body).json()["tokens"] == ids
    chat = servers["trusting"].post("/v1/chat/completions", {**body, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)


def test_tokenize_failures(keyed: Server) -> None:
    _error(keyed.post("/tokenize", {"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"}), 401, None)
    error = _error(keyed.post("/tokenize", {"model": "gpt-4", "prompt": PROMPT}), 404, "model")
    assert error["code"] == "model_not_found"
    _error(keyed.post("/tokenize", {}), 400, "prompt")
    _error(keyed.post("/tokenize", {"prompt": 3}), 400, "prompt")
    _error(keyed.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": 1}), 400, "add_special_tokens")
    _error(keyed.post("/tokenize", {"messages": []}), 400, "messages")
    _error(keyed.post("/tokenize", {"messages": [{"role": "user", "content": 3}]}), 400, "messages")
    headers = {**keyed.headers, "Content-Type": "text/plain"}
    response = httpx.post(f"{keyed.url}/tokenize", content=b'{"prompt": "hi"}', headers=headers)
    assert _error(response, 415, None)["code"] == 415
    huge = keyed.post("/tokenize", {"prompt": "a" * (2 << 20)})
    assert _error(huge, 413, None)["code"] == 413


# -------------------------------------------------------------------------------------- /detokenize


def test_detokenize_is_the_tokenizers_decode(keyed: Server, llm: LLM) -> None:
    """Special tokens included (the BOS), as the tokenizer decodes them; /tokenize's ids come back as the
    text they were made from."""
    tok = llm.get_tokenizer()
    tokens = keyed.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert tokens[0] == tok.bos_token_id
    response = keyed.post("/detokenize", {"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tok.decode(tokens, skip_special_tokens=False)}
    assert response.json()["prompt"].endswith(PROMPT)
    last = len(tok) - 1
    assert keyed.post("/detokenize", {"tokens": [last]}).json()["prompt"] == tok.decode([last])
    assert keyed.post("/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_detokenize_failures(keyed: Server, llm: LLM) -> None:
    size = len(llm.get_tokenizer())
    for outside in (size, -1, 10**12):
        error = _error(keyed.post("/detokenize", {"tokens": [5, outside]}), 400, "tokens")
        assert str(outside) in error["message"]
    _error(keyed.post("/detokenize", {"tokens": [True]}), 400, "tokens")
    _error(keyed.post("/detokenize", {"tokens": "5"}), 400, "tokens")
    _error(keyed.post("/detokenize", {}), 400, "tokens")
    _error(keyed.post("/detokenize", {"tokens": [5]}, headers={"Authorization": "Bearer wrong"}), 401, None)
    assert (
        _error(keyed.post("/detokenize", {"model": "x", "tokens": [5]}), 404, "model")["code"]
        == "model_not_found"
    )
    response = httpx.post(f"{keyed.url}/detokenize", content=b'{"tokens": [5]}', headers=keyed.headers)
    _error(response, 415, None)
    huge = keyed.post("/detokenize", {"tokens": [5] * (1 << 20)})
    _error(huge, 413, None)


# ------------------------------------------------------------------------ /version, /v1/models/{id}


def test_version_is_the_packages(servers: dict[str, Server]) -> None:
    """The installed distribution's version, with no key needed (as /health)."""
    response = httpx.get(f"{servers['keyed'].url}/version", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json() == {"version": importlib.metadata.version("tp_runtime")}


@pytest.mark.parametrize(("name", "served"), [("keyed", MODEL), ("trusting", SLASHED)])
def test_a_models_card_is_the_listed_one(servers: dict[str, Server], name: str, served: str) -> None:
    server = servers[name]
    listed = server.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == [served]
    response = server.get(f"/v1/models/{served}")
    assert response.status_code == 200, response.text
    assert response.json() == listed[0]
    assert response.json()["max_model_len"] == MAX_MODEL_LEN and response.json()["object"] == "model"
    for other in ("gpt-4", f"{served}-x", f"x/{served}", ""):
        error = _error(server.get(f"/v1/models/{other}"), 404, "model")
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"


def test_a_models_card_needs_the_key(keyed: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{keyed.url}/v1/models/{MODEL}", headers=headers, timeout=REQUEST_TIMEOUT_S)
        assert _error(response, 401, None)["code"] == "invalid_api_key"


# ------------------------------------------------------------------------------ off the event loop


class _HeldTokenizer:
    """The front end's tokenizer, held inside its encode of one text and its decode of one id list until
    the test lets it go."""

    def __init__(self, inner: Any, text: str, ids: list[int]) -> None:
        self.inner, self.text, self.ids = inner, text, ids
        self.entered, self.go = threading.Event(), threading.Event()
        self.timed_out = False

    def _hold(self) -> None:
        self.entered.set()
        self.timed_out |= not self.go.wait(20)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if text == self.text:
            self._hold()
        return self.inner(text, **kwargs)

    def decode(self, ids: list[int], **kwargs: Any) -> Any:
        if list(ids) == self.ids:
            self._hold()
        return self.inner.decode(ids, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize(
    ("path", "held_body", "other_body"),
    [
        ("/tokenize", {"prompt": "a huge prompt"}, {"prompt": "Hi"}),
        ("/detokenize", {"tokens": [5, 6, 7]}, {"tokens": [5]}),
    ],
)
def test_tokenizing_does_not_block_the_event_loop(
    make_checkpoint: Callable[..., Path], path: str, held_body: Any, other_body: Any
) -> None:
    """While one request's text is being tokenized (or its ids decoded), /health and other requests are
    answered (the app in this process, over test_server's scripted engine)."""
    config = build_model_config(make_checkpoint(seed=3), max_model_len=128)
    byte_tokenizer = build_preset_tokenizer(VOCAB)
    front = _HeldTokenizer(byte_tokenizer, "a huge prompt", [5, 6, 7])

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            held = asyncio.create_task(client.post(path, json=held_body))
            assert await asyncio.to_thread(front.entered.wait, 60)
            assert (await client.get("/health")).status_code == 200
            assert (await client.post(path, json=other_body)).status_code == 200
            assert not front.go.is_set()
            front.go.set()
            assert (await held).status_code == 200

    with InProcess(config, byte_tokenizer, ScriptedExecutor(closed_form), front_tokenizer=front) as served:
        asyncio.run(main(served))
    assert not front.timed_out, "the held tokenizer blocked the event loop"
