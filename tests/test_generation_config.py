"""Default sampling parameters from the model's generation_config.json, as vLLM takes them
(`generation_config="auto"`, its default): repetition_penalty, temperature, top_k, top_p, min_p and
max_new_tokens (as max_tokens) are the defaults of `LLM.generate` / `LLM.chat` without SamplingParams
(`LLM.get_default_sampling_params()`) and of every server request that leaves them out (a request's
max_tokens at most the config's). `generation_config="vllm"` leaves them out; a folder gives its own
generation_config.json. `do_sample` is ignored, as in vLLM; a value SamplingParams refuses is a ConfigError
at start-up naming the file and the key.

The model is a tiny random Llama whose generation_config.json asks for greedy decoding with a repetition
penalty and 7 new tokens: HF transformers' `generate`, reading the same file, is the reference.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from conftest import hf_greedy, with_chat_template
from test_cli_args import _cli, _one_error_line
from test_server import InProcess, Server, start_server
from test_streaming_engine import ScriptedExecutor, closed_form

from tp_runtime import LLM, EngineArgs, SamplingParams
from tp_runtime.config import GenerationDefaults, build_model_config
from tp_runtime.errors import ConfigError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What transformers writes on save_pretrained (the tiny checkpoints' own file) plus the model creator's
# sampling settings; do_sample false is ignored, as vLLM ignores it.
GENERATION = {
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False,
    "temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.3, "max_new_tokens": 7,
}  # fmt: skip
DEFAULTS = SamplingParams(temperature=0.0, top_p=0.9, top_k=20, repetition_penalty=1.3, max_tokens=7)
PROMPTS = ["Hello, my name is", "The capital of France is", "In the beginning", "1, 2, 3, 4,"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_MODEL_LEN = 128


def _write_generation_config(folder: Path, generation: dict[str, Any]) -> None:
    (folder / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="module")
def plain_dir(make_checkpoint: Callable[..., Path]) -> Path:
    """The tiny checkpoint as transformers saved it: its generation_config.json has bos/eos/pad only."""
    return make_checkpoint(seed=11)


@pytest.fixture(scope="module")
def model_dir(plain_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights, with GENERATION as generation_config.json and TEMPLATE as the chat template."""
    out = with_chat_template(plain_dir, tmp_path_factory.mktemp("gencfg") / "model", TEMPLATE)
    _write_generation_config(out, GENERATION)
    return out


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=4) as engine:
        yield engine


def _hf_generate(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' generate with no arguments: all its settings come from the checkpoint's
    generation_config.json (greedy, the repetition penalty, max_new_tokens, EOS)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        outs.append(model.generate(ids, attention_mask=torch.ones_like(ids))[0, len(p) :].tolist())
    return outs


# ------------------------------------------------------------------------------------- the offline API
def test_default_sampling_params_are_the_generation_configs(llm: LLM, model_dir: Path) -> None:
    assert llm.get_default_sampling_params() == DEFAULTS
    defaults = llm.config.model.generation_defaults
    assert defaults.source == str(model_dir / "generation_config.json")
    assert defaults.overrides() == {
        "repetition_penalty": 1.3, "temperature": 0.0, "top_k": 20, "top_p": 0.9, "max_tokens": 7,
    }  # fmt: skip


def test_generate_without_params_is_hf_generate_with_the_same_config(llm: LLM, model_dir: Path) -> None:
    """Greedy (temperature 0, do_sample false), the repetition penalty, and exactly max_new_tokens tokens."""
    tok = llm.get_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    want = _hf_generate(model_dir, prompts)
    assert all(len(w) == GENERATION["max_new_tokens"] for w in want), want  # none stopped at EOS
    outs = llm.generate(PROMPTS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_chat_without_params_uses_the_defaults(llm: LLM) -> None:
    [default] = llm.chat(MESSAGES, use_tqdm=False)
    [explicit] = llm.chat(MESSAGES, DEFAULTS, use_tqdm=False)
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(default.outputs[0].token_ids) == 7 and default.outputs[0].finish_reason == "length"


def test_explicit_sampling_params_are_used_as_given(llm: LLM, plain_dir: Path) -> None:
    """An explicit SamplingParams takes nothing from the config: no repetition penalty, its own
    max_tokens (the reference: HF greedy on the same weights, without the config's penalty)."""
    tok = llm.get_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    want = hf_greedy(plain_dir, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # A list of them, one per prompt, too.
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=n) for n in (3, 12)],
                        use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 12]


def test_generation_config_vllm_restores_samplingparams_defaults(model_dir: Path) -> None:
    """"vllm": no defaults from the file (its EOS ids still count, as in vLLM)."""
    with LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, generation_config="vllm") as engine:
        assert engine.get_default_sampling_params() == SamplingParams()
        assert engine.config.model.generation_defaults == GenerationDefaults()
        assert engine.config.model.eos_token_ids == (2,)
        outs = engine.generate(PROMPTS, use_tqdm=False)
    for out in outs:  # SamplingParams' 16 tokens (or fewer, ending at EOS), not the config's 7
        ids = out.outputs[0].token_ids
        assert len(ids) == 16 or (ids[-1] == 2 and out.outputs[0].finish_reason == "stop"), ids


def test_transformers_own_generation_config_changes_nothing(plain_dir: Path) -> None:
    """The file transformers writes on save_pretrained (bos, eos, pad) holds no sampling parameter."""
    with LLM(plain_dir, device="cpu", max_model_len=MAX_MODEL_LEN) as engine:
        assert engine.get_default_sampling_params() == SamplingParams()
        assert not engine.config.model.generation_defaults.overrides()


def test_a_folder_gives_its_generation_config(plain_dir: Path, tmp_path: Path) -> None:
    """generation_config=FOLDER: that folder's generation_config.json gives the defaults and the EOS ids
    (as vLLM reads the whole generation config from it), whatever the checkpoint's says."""
    _write_generation_config(tmp_path, {"temperature": 0.0, "top_k": 3, "max_new_tokens": 4,
                                        "eos_token_id": [2, 5]})  # fmt: skip
    with LLM(plain_dir, device="cpu", max_model_len=MAX_MODEL_LEN, generation_config=str(tmp_path)) as engine:
        assert engine.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=3, max_tokens=4)
        assert engine.config.model.eos_token_ids == (2, 5)
        assert engine.config.model.generation_defaults.source == str(tmp_path / "generation_config.json")
        outs = engine.generate(PROMPTS, use_tqdm=False)
        want = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) <= 4 for o in outs)


def test_do_sample_false_nulls_and_other_keys(plain_dir: Path, tmp_path: Path) -> None:
    """As vLLM: do_sample is not read (false with a temperature still samples at it), a null is no value,
    keys outside the six (num_beams, length_penalty, ...) are not defaults; a whole number written as a
    float is that int."""
    folder = tmp_path / "gen"
    folder.mkdir()
    _write_generation_config(folder, {"do_sample": False, "temperature": 0.7, "top_p": None, "top_k": 50.0,
                                      "min_p": 0.05, "num_beams": 4, "length_penalty": 2.0})  # fmt: skip
    config = build_model_config(plain_dir, generation_config=folder)
    assert config.generation_defaults.overrides() == {"temperature": 0.7, "top_k": 50, "min_p": 0.05}
    assert type(config.generation_defaults.top_k) is int


BAD_FILES = [
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"temperature": "hot"}, "temperature='hot'"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 2}, "top_p=2"),
    ({"top_k": -2}, "top_k=-2"),
    ({"top_k": 2.5}, "top_k=2.5"),
    ({"min_p": 1.5}, "min_p=1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty=0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": True}, "max_new_tokens=True"),
]


@pytest.mark.parametrize(("generation", "fragment"), BAD_FILES, ids=[f for _, f in BAD_FILES])
def test_a_bad_value_is_a_config_error_naming_file_and_key(
    plain_dir: Path, tmp_path: Path, generation: dict[str, Any], fragment: str
) -> None:
    _write_generation_config(tmp_path, generation)
    with pytest.raises(ConfigError) as info:
        build_model_config(plain_dir, generation_config=tmp_path)
    message = str(info.value)
    file = tmp_path / "generation_config.json"
    assert message.startswith(f"{file}: {fragment} cannot be a default sampling parameter ("), message
    assert "--generation-config vllm" in message, message
    # "vllm" leaves the file's sampling parameters out: that file then starts (its EOS ids still read).
    ckpt = tmp_path / "ckpt"
    shutil.copytree(plain_dir, ckpt)
    _write_generation_config(ckpt, {**generation, "eos_token_id": 2})
    with pytest.raises(ConfigError, match="cannot be a default sampling parameter"):
        build_model_config(ckpt)
    assert build_model_config(ckpt, generation_config="vllm").generation_defaults == GenerationDefaults()


def test_bad_generation_config_options(plain_dir: Path, tmp_path: Path) -> None:
    """What generation_config takes, checked as the options are (EngineArgs: before anything loads)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "generation_config.json").write_text("{}")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{not json")
    cases = {
        str(tmp_path / "missing"): "is not a folder",
        str(tmp_path / "empty"): "has no generation_config.json",
        str(tmp_path / "generation_config.json"): "is a file: give the folder that holds it",
        "Auto": "is not a folder",
    }
    for value, fragment in cases.items():
        with pytest.raises(ConfigError) as info:
            EngineArgs(model=str(plain_dir), generation_config=value)
        message = str(info.value)
        assert message.startswith("generation_config must be auto (the checkpoint's generation_config.json), "
                                  "vllm (no defaults from it"), message  # fmt: skip
        assert fragment in message, message
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            build_model_config(plain_dir, generation_config=value)
    with pytest.raises(ConfigError, match="generation_config must not be empty"):
        EngineArgs(model=str(plain_dir), generation_config="")
    with pytest.raises(ConfigError, match=r"broken/generation_config.json as JSON .*; fix the file"):
        build_model_config(plain_dir, generation_config=tmp_path / "broken")


def test_command_line_errors_are_one_line(plain_dir: Path, tmp_path: Path) -> None:
    _one_error_line(
        _cli("generate", "--model", str(plain_dir), "--generation-config", str(tmp_path / "missing")),
        "argument --generation-config: must be auto", "is not a folder",
    )  # fmt: skip
    _write_generation_config(tmp_path, {"temperature": -1})
    _one_error_line(
        _cli("generate", "--model", str(plain_dir), "--generation-config", str(tmp_path)),
        "temperature=-1 cannot be a default sampling parameter",
    )  # fmt: skip


# ------------------------------------------------------------------------------- the server, in process
class _Recording(InProcess):
    """The app over a scripted engine, keeping the SamplingParams of every engine request."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer, ScriptedExecutor(closed_form))
        self.params: list[SamplingParams] = []
        engine = self.engine.engine
        add = engine.add_request

        def recording(prompt_ids: list[int], params: SamplingParams, *args: Any, **kwargs: Any) -> int:
            self.params.append(params)
            return add(prompt_ids, params, *args, **kwargs)

        engine.add_request = recording  # type: ignore[method-assign]

    def run(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
        """POST `body`: the response, and the SamplingParams of its (one) engine request."""

        async def post() -> httpx.Response:
            async with self.client() as client:
                return await client.post(path, json=body)

        before = len(self.params)
        response = asyncio.run(post())
        assert response.status_code == 200, response.text
        [params] = self.params[before:]
        return response.json(), params


def _option(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in
            ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_server_requests_take_the_defaults_they_leave_out(model_dir: Path, tokenizer: Any) -> None:
    config = build_model_config(model_dir, max_model_len=MAX_MODEL_LEN)
    model = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.3}
    with _Recording(config, tokenizer) as served:
        # Left out: the config's; max_tokens the smaller of the request's (completions: 16; chat: the
        # rest of the context) and max_new_tokens.
        body, params = served.run("/v1/completions", {"prompt": "Hello"})
        assert _option(params) == {**model, "max_tokens": 7}
        assert body["usage"]["completion_tokens"] == 7 and body["choices"][0]["finish_reason"] == "length"
        _, params = served.run("/v1/chat/completions", {"messages": MESSAGES})
        assert _option(params) == {**model, "max_tokens": 7}
        _, params = served.run("/v1/completions", {"prompt": "Hello", "max_tokens": 50})
        assert params.max_tokens == 7
        _, params = served.run("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 60})
        assert params.max_tokens == 7
        # Given: the request's, field by field (null is left out).
        mine = {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.0}
        _, params = served.run("/v1/completions", {"prompt": "Hello", "max_tokens": 3, **mine})
        assert _option(params) == {**mine, "max_tokens": 3}
        _, params = served.run("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "top_k": 4,
                                                        "temperature": None})  # fmt: skip
        assert _option(params) == {**model, "top_k": 4, "max_tokens": 5}
        # The other options keep SamplingParams' defaults.
        assert (params.presence_penalty, params.frequency_penalty, params.seed) == (0.0, 0.0, None)


def test_server_with_generation_config_vllm_keeps_its_defaults(model_dir: Path, tokenizer: Any) -> None:
    config = build_model_config(model_dir, max_model_len=MAX_MODEL_LEN, generation_config="vllm")
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    with _Recording(config, tokenizer) as served:
        _, params = served.run("/v1/completions", {"prompt": "Hello"})
        assert _option(params) == {**plain, "max_tokens": 16}
        _, params = served.run("/v1/chat/completions", {"messages": MESSAGES})
        prompt_len = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])  # fmt: skip
        assert _option(params) == {**plain, "max_tokens": MAX_MODEL_LEN - prompt_len}


# ------------------------------------------------------------------------- the server, end to end
@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("gencfg-servers")
    started: dict[str, Server] = {}
    try:
        started["auto"] = start_server(model_dir, 1, tmp)
        started["vllm"] = start_server(model_dir, 1, tmp, "--generation-config", "vllm")
        yield started
    finally:
        for server in started.values():
            assert server.stop() == 0, server.output()[-4000:]
            assert "Traceback" not in server.output(), server.output()[-4000:]


def _completion(server: Server, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPTS[0], **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0] | {"usage": response.json()["usage"]}


def test_serve_says_once_which_defaults_it_took(servers: dict[str, Server], model_dir: Path) -> None:
    line = (
        f"tp-runtime serve: default sampling parameters from the model's generation config "
        f"({model_dir / 'generation_config.json'}), as its creator recommends: repetition_penalty=1.3, "
        "temperature=0.0, top_k=20, top_p=0.9, max_tokens=7; a request's own values win"
    )
    assert servers["auto"].output().count(line) == 1, servers["auto"].output()[-4000:]
    assert "default sampling parameters" not in servers["vllm"].output()


def test_serve_requests_follow_the_generation_config(servers: dict[str, Server], llm: LLM) -> None:
    """A request that leaves the options out gets what LLM.generate without SamplingParams gives (the
    config's greedy decoding, repetition penalty and 7 tokens); one that sets them gets its own."""
    [default] = llm.generate(PROMPTS[0], use_tqdm=False)
    choice = _completion(servers["auto"])
    assert (choice["text"], choice["usage"]["completion_tokens"]) == (default.outputs[0].text, 7)
    [mine] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    choice = _completion(servers["auto"], max_tokens=5, temperature=0, repetition_penalty=1.0)
    assert (choice["text"], choice["usage"]["completion_tokens"]) == (mine.outputs[0].text, 5)
    # --generation-config vllm: the server's own defaults (16 tokens, no penalty).
    [greedy] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    choice = _completion(servers["vllm"], temperature=0, ignore_eos=True)
    assert (choice["text"], choice["usage"]["completion_tokens"]) == (greedy.outputs[0].text, 16)
