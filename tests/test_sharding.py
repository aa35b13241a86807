"""Each rank's weight shards against slices cut by hand from the HF checkpoint, and each rank reads only
about 1/TP of the big tensors from disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import count_checkpoint_reads
from safetensors.torch import load_file

from tp_runtime import loader
from tp_runtime.config import build_model_config
from tp_runtime.distributed import TPGroup
from tp_runtime.models.llama import LlamaForCausalLM


def _expected(hf: dict[str, torch.Tensor], name: str, heads: int, kv_heads: int, head_dim: int,
              vocab: int, tp: int, rank: int) -> torch.Tensor:  # fmt: skip
    """The slice of HF tensors rank `rank` must hold for our parameter `name` (written independently)."""

    def rows(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        size = t.shape[0] // parts
        return t[index * size : (index + 1) * size]

    kv_index, kv_parts = (rank, tp) if kv_heads >= tp else (rank * kv_heads // tp, kv_heads)
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        base, suffix = name.replace("qkv_proj", "{}").rsplit(".", 1)[0], name.rsplit(".", 1)[1]
        q = rows(hf[f"{base.format('q_proj')}.{suffix}"], tp, rank)
        k = rows(hf[f"{base.format('k_proj')}.{suffix}"], kv_parts, kv_index)
        v = rows(hf[f"{base.format('v_proj')}.{suffix}"], kv_parts, kv_index)
        return torch.cat([q, k, v])
    if name.endswith("gate_up_proj.weight"):
        base = name.replace("gate_up_proj.weight", "")
        return torch.cat(
            [rows(hf[base + "gate_proj.weight"], tp, rank), rows(hf[base + "up_proj.weight"], tp, rank)]
        )
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        return rows(hf[name].T, tp, rank).T
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = hf.get(name, hf["model.embed_tokens.weight"])
        per = -(-vocab // tp)
        shard = torch.zeros(per, full.shape[1])
        part = full[rank * per : min((rank + 1) * per, vocab)]
        shard[: part.shape[0]] = part
        return shard
    return hf[name]  # norms and row-parallel biases are replicated


@pytest.mark.parametrize(
    ("overrides", "tp"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301}, 2),
        ({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128, "vocab_size": 301}, 4),
        (
            {
                "num_attention_heads": 6,
                "num_key_value_heads": 6,
                "hidden_size": 96,
                "intermediate_size": 192,
                "tie_word_embeddings": True,
                "attention_bias": True,
            },
            3,
        ),
    ],
    ids=["gqa-tp2", "kv-replicated-tp4", "tied-bias-tp3"],
)
def test_each_rank_holds_its_slice(
    make_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    overrides: dict[str, object],
    tp: int,
) -> None:
    model_dir = make_checkpoint(**overrides)
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    hf = load_file(str(model_dir / "model.safetensors"))
    full_elements = sum(t.numel() for t in hf.values())
    read = count_checkpoint_reads(monkeypatch)
    for rank in range(tp):
        read.clear()
        model = LlamaForCausalLM(cfg, TPGroup(rank, tp), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(model_dir), torch.float32)
        for name, param in model.named_parameters():
            want = _expected(
                hf, name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, tp, rank
            )
            assert torch.equal(param.data, want), f"rank {rank}: {name}"
        # Norms, biases and replicated KV heads are read in full; everything else only this rank's part.
        assert sum(read) < full_elements / tp * 1.35, (rank, sum(read), full_elements)


def _dummy_value(flat_index: int, seed: int, scale: float, offset: float) -> float:
    """DummyTensor's value at one global (row-major) index, in Python integers."""
    mask = (1 << 62) - 1
    h = (flat_index + seed * 0x9E3779B1) & mask
    h = ((h ^ (h >> 29)) * 0xBF58476D) & mask
    h = ((h ^ (h >> 27)) * 0x94D049BB) & mask
    h ^= h >> 31
    return ((h & 0xFFFFFF) / float(0x1000000) * 2.0 - 1.0) * scale + offset


@pytest.mark.parametrize("chunk", [1, 7, 1 << 23])
def test_dummy_slices_hold_the_full_tensors_values(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any slice of a dummy tensor, made a few rows at a time (bounded memory for an LM head), holds the
    values of the same slice of the full tensor, each a hash of its global index."""
    monkeypatch.setattr(loader, "_DUMMY_CHUNK_ELEMENTS", chunk)
    shape = (5, 6, 3)
    source = loader.DummyTensor(shape, 12, 0.5, 0.25, torch.float32, torch.device("cpu"))
    values = [_dummy_value(i, 12, 0.5, 0.25) for i in range(5 * 6 * 3)]
    full = torch.tensor(values, dtype=torch.float32).view(shape)
    torch.testing.assert_close(source.full(), full, rtol=0, atol=0)
    for dim, start, length in [(0, 1, 3), (1, 2, 4), (2, 1, 1), (1, 0, 0)]:
        got = source.narrow(dim, start, length)
        torch.testing.assert_close(got, full.narrow(dim, start, length), rtol=0, atol=0)
