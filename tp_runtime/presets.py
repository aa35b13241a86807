"""Named model shapes for benchmarks and tests, written as cached checkpoints (models_catalog.py names them).

Each preset is a dict of ``transformers.LlamaConfig`` keyword arguments. Small presets can be written
with random weights (for tests against HF transformers); large ones are written as config + tokenizer
only, for ``load_format="dummy"`` benchmarks.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, PreTrainedTokenizerFast

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
UNK_TOKEN_ID = 0
# BPE merges are trained up to this many ids; above it the preset tokenizer holds filler tokens.
TOKENIZER_MAX_VOCAB = 512

_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}


def _preset(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType({**_COMMON, **kwargs})


# `rope_theta` is given the transformers 4 way; transformers 5 folds it into `config.rope_parameters`.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "tiny-llama": _preset(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            dtype="float32",
        ),
        # Head counts and sizes divide by 1, 2, 4 and 8, so every TP size up to 8 is valid.
        "tiny-llama-tp": _preset(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=8,
            intermediate_size=256,
            vocab_size=1000,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            dtype="float32",
        ),
        "smollm2-135m": _preset(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            dtype="bfloat16",
        ),
        "llama-3-8b": _preset(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
        "llama-3-70b": _preset(
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    }
)


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_hf_config(name: str) -> LlamaConfig:
    from transformers import LlamaConfig

    try:
        kwargs = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
    # Copy the list so a caller mutating config.architectures cannot change the preset.
    config_kwargs: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return LlamaConfig(**config_kwargs)


# Training text for the presets' tokenizer. Any English works; it only has to give the BPE trainer
# enough common pairs to fill the vocabulary so that short prompts become few tokens.
_TOKENIZER_TEXT = """\
A tensor parallel runtime splits every layer of a language model across several devices. Each device
holds one part of the weights, computes its share of the attention heads and of the feed forward
network, and then the devices add their partial results together. The driver process owns the
tokenizer, the request queue and the scheduler. At every step it sends the scheduled requests to the
workers, the workers run the model on their part of the weights, and the first worker sends back the
sampled tokens. Prompts are turned into tokens, the tokens into hidden states, and the hidden states
into logits over the vocabulary. The sampler picks the next token with greedy search, with a
temperature, or from the top of the distribution. The scheduler keeps as many requests running as the
cache allows, and when the cache is full it stops the newest request and starts it again later.
The capital of France is Paris. The quick brown fox jumps over the lazy dog. Once upon a time there
was a small model that wanted to tell a story to anyone who would listen. It told the story of the
sun and the moon, of the river that runs to the sea, and of the people who live in the city by the
water. Hello world! This is a test of the model, and the model should answer with a few words.
What is the time? It is ten past seven in the morning, and the day is bright and warm.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2048 show up in text as well.
"""


def build_preset_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline on built-in text; deterministic and fast.

    Ids 0/1/2 are ``<unk>``/``<s>``/``</s>``. Like Llama's tokenizer it prepends ``<s>`` when encoding.
    Its vocabulary has exactly ``vocab_size`` entries, so every id a model can sample decodes to text:
    BPE is trained to at most ``TOKENIZER_MAX_VOCAB`` entries and the rest are filler tokens (joins of
    trained tokens) that encoding never produces.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]  # list order gives the ids 0, 1, 2
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(specials) + len(alphabet)}, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, TOKENIZER_MAX_VOCAB),
        special_tokens=specials,
        initial_alphabet=alphabet,  # all 256 bytes, so any text encodes without <unk>
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_TOKEN_ID)]
    )
    if tok.get_vocab_size() < vocab_size:
        tok = _with_filler_tokens(tok, vocab_size)
    for token, want in zip(specials, (UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID), strict=True):
        if tok.token_to_id(token) != want:
            raise RuntimeError(f"tokenizer gave {token} id {tok.token_to_id(token)}, expected {want}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=1 << 30
    )


def _with_filler_tokens(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Grow ``tok``'s BPE vocabulary to ``vocab_size`` with joins of its word-like tokens.

    No merge rule leads to a filler, so encoding is unchanged; decoding a filler gives readable text.
    """
    from tokenizers import Tokenizer, decoders

    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    byte_level = decoders.ByteLevel()

    def word_like(token: str) -> bool:  # ASCII letters, digits, spaces, a little punctuation
        text = byte_level.decode([token])
        return (
            text.isascii()
            and any(c.isalnum() for c in text)
            and all(c.isalnum() or c in " .,'" for c in text)
        )

    # Vocab order (ids) keeps the result deterministic; the specials are not word-like.
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if word_like(t)]
    repeat = 2
    while len(vocab) < vocab_size:
        for parts in itertools.product(pieces, repeat=repeat):
            token = "".join(parts)
            if token not in vocab:
                vocab[token] = len(vocab)
                if len(vocab) == vocab_size:
                    break
        repeat += 1
    return Tokenizer.from_str(json.dumps(state))


def write_preset_checkpoint(name: str, out_dir: str | Path, *, with_weights: bool, seed: int = 0) -> Path:
    """Write an HF-format checkpoint of preset ``name`` into ``out_dir`` and return its path.

    With weights: random float32 weights (seeded, so the same seed gives the same tensors) saved as
    safetensors. Without: config, generation config and tokenizer only, for dummy-weight loading.
    """
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as transformers_logging

    config = preset_hf_config(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if with_weights:
        # Only here: importing transformers' modeling code takes seconds, which a server's first start
        # on the config alone (dummy weights) would pay.
        from transformers import LlamaForCausalLM

        config.dtype = torch.float32  # the saved tensors are float32; say so in config.json
        # fork_rng: seed the init without disturbing the caller's global RNG state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config).float()  # float32 even if the caller changed the default dtype
        # Quietly: the command line's one-line errors (and its output) must not carry transformers'
        # "Writing model shards" bar when a built-in model is written on first use.
        bars_were_on = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            model.save_pretrained(out, safe_serialization=True)
        finally:
            if bars_were_on:
                transformers_logging.enable_progress_bar()
        del model
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(out)
    build_preset_tokenizer(int(config.vocab_size)).save_pretrained(out)
    return out


def cache_root() -> Path:
    """Where generated checkpoints are cached: ``$TP_RUNTIME_CACHE`` or ``~/.cache/tp_runtime``."""
    env = os.environ.get("TP_RUNTIME_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tp_runtime"


def cached_dir(name: str, build: Callable[[Path], object]) -> Path:
    """Return ``cache_root()/name``, calling ``build(tmp_dir)`` to create it if it is missing.

    The build writes into a temporary sibling that is renamed into place, so a concurrent caller
    sees either no directory or a complete one. Builders take a file lock first, so concurrent callers
    (torchrun's ranks on one host) build once: the others wait and find the folder. Should two still
    race (a file system without locks), the first rename wins and the loser's copy is discarded.
    """
    target = cache_root() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "a") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # built while this caller waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the finished cache dir should look like any other
        try:
            build(tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                # Another process renamed its finished copy into place first (ENOTEMPTY/EEXIST).
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
