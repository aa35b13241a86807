"""Weight loading from safetensors: memory-mapped, and each rank reads only its own slice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from tp_runtime.errors import ConfigError

if TYPE_CHECKING:
    from tp_runtime.models.interface import CausalLM


class CheckpointTensor:
    """A tensor in a safetensors file, read lazily and in parts via safetensors' slice API."""

    def __init__(self, handle: Any, name: str, dtype: torch.dtype) -> None:
        self._slice = handle.get_slice(name)
        self._dtype = dtype
        self.shape: tuple[int, ...] = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._slice[index].to(self._dtype)

    def full(self) -> torch.Tensor:
        return self._slice[:].to(self._dtype)


def safetensors_files(model_dir: str) -> list[str]:
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({str(Path(model_dir) / f) for f in weight_map.values()})
        absent = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if absent:
            raise ConfigError(
                f"{index} names weight files that are not in {model_dir}: {', '.join(absent[:4])}; "
                "download the whole checkpoint"
            )
        return files
    single = Path(model_dir) / "model.safetensors"
    if single.is_file():  # as transformers: other *.safetensors beside it (a consolidated copy) are not read
        return [str(single)]
    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {model_dir}; convert the checkpoint to safetensors "
            "or use load_format='dummy' for random weights"
        )
    return files


def load_weights(model: CausalLM, model_dir: str, dtype: torch.dtype) -> None:
    """Fill every parameter of `model` from the checkpoint; missing or unknown tensors are errors."""
    # By checkpoint name, not by parameter: a fused or stacked parameter (q/k/v, experts) takes many.
    expected = dict(model.checkpoint_shapes())
    missing = dict(expected)
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                try:
                    targets = list(model.checkpoint_targets(name))
                except KeyError:
                    raise ConfigError(f"{os.path.basename(path)} holds unexpected tensor {name!r}") from None
                tensor = CheckpointTensor(handle, name, dtype)
                # Each rank reads only its slice, so a tensor of the wrong size could load part of itself.
                if name in expected and tensor.shape != tuple(expected[name]):
                    raise ConfigError(
                        f"{os.path.basename(path)}: tensor {name!r} has shape {list(tensor.shape)} but the "
                        f"model's config.json gives {list(expected[name])}; the config does not match the "
                        "weights"
                    )
                for param, shard_id in targets:
                    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                missing.pop(name, None)
    if missing:
        names = sorted(missing)
        raise ConfigError(f"checkpoint {model_dir} lacks tensors for: {', '.join(names[:8])}")


class DummyTensor:
    """A pseudo-random checkpoint tensor whose every element is a hash of its global index.

    Any slice can be made on the target device without building the full tensor, and a rank's slice holds
    exactly the values the same slice of the full tensor holds, so dummy models agree across TP sizes.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        seed: int,
        scale: float,
        offset: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self._seed = seed
        self._scale = scale
        self._offset = offset
        self._dtype = dtype
        self._device = device

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = torch.zeros((), dtype=torch.int64, device=self._device)
        stride = 1
        for d in reversed(range(len(self.shape))):
            lo, n = (start, length) if d == dim else (0, self.shape[d])
            view = [1] * len(self.shape)
            view[d] = n
            index = index + (torch.arange(lo, lo + n, device=self._device) * stride).view(view)
            stride *= self.shape[d]
        # splitmix-style integer mixing, kept within 62 bits so int64 never overflows
        h = (index + self._seed * 0x9E3779B1) & 0x3FFFFFFFFFFFFFFF
        h = ((h ^ (h >> 29)) * 0xBF58476D) & 0x3FFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB) & 0x3FFFFFFFFFFFFFFF
        h = h ^ (h >> 31)
        unit = (h & 0xFFFFFF).to(torch.float32) / float(0x1000000)  # [0, 1)
        return ((unit * 2.0 - 1.0) * self._scale + self._offset).to(self._dtype)

    def full(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


def init_dummy_weights(model: CausalLM, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Random weights through the same sharding path as a real checkpoint (see DummyTensor)."""
    for tensor_index, (name, shape) in enumerate(model.checkpoint_shapes()):
        is_norm = name.endswith("norm.weight")
        is_bias = name.endswith(".bias")
        source = DummyTensor(
            shape,
            seed=seed * 100003 + tensor_index,
            scale=0.0 if is_norm else (0.01 if is_bias else shape[-1] ** -0.5),
            offset=1.0 if is_norm else 0.0,
            dtype=dtype,
            device=device,
        )
        for param, shard_id in model.checkpoint_targets(name):
            param.weight_loader(param, source, shard_id)  # type: ignore[attr-defined]
