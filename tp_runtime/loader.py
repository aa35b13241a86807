"""Weight loading from safetensors (or PyTorch's pytorch_model.bin): each rank reads only its own slice.

The safetensors files are read with plain reads rather than through a memory map (which is all
safetensors' Python API offers): the pages of a mapped file count as the process's resident memory until
it is closed, so mapping a checkpoint while copying it into the model held its weights twice at the peak.
A checkpoint with no safetensors is read from pytorch_model.bin as transformers falls back to it: through
torch.load's restricted unpickler (weights_only) on a memory map.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import pickle
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from tp_runtime.config import QuantConfig
from tp_runtime.errors import ConfigError
from tp_runtime.layers import kv_fp8
from tp_runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from tp_runtime.layers.moe import ExpertWeights, SparseMoE
from tp_runtime.layers.quantization import FP8_DTYPES, UNQUANTIZED, check_finite_scale
from tp_runtime.models.interface import MODEL_NAMES, CheckpointNames

if TYPE_CHECKING:
    from tp_runtime.models.interface import CausalLM

# What a checkpoint weight and its FP8 scales load into: a linear layer, or a stack of experts' weights.
QuantizedLayer = ColumnParallelLinear | RowParallelLinear | ExpertWeights

# safetensors' dtype names: those the loader reads, and every other valid one with its size in bits (such a
# tensor is refused by name and dtype when it is read, not as a broken file).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_UNSUPPORTED_DTYPE_BITS = {
    "U64": 64, "U32": 32, "U16": 16, "C64": 64, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}  # fmt: skip
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class SafetensorsFile:
    """One open safetensors file: its header, and reads of a tensor or of a slice of it (only the slice's
    bytes are read)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed by close() / the with block
        except OSError as exc:  # a link to a blob an interrupted download never wrote, a folder, ...
            raise ConfigError(
                f"could not open {path} ({exc.strerror or exc}); download the checkpoint again"
            ) from None
        try:
            self._entries = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _bad(self, why: str) -> ConfigError:
        return ConfigError(
            f"{self.path} is not a valid safetensors file ({why}); re-download or re-convert it"
        )

    def _read_header(self) -> dict[str, tuple[torch.dtype | str, tuple[int, ...], int, int]]:
        """Each tensor's dtype (its safetensors name where the loader does not read it), shape and span."""
        size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise self._bad("shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise self._bad(f"header length {header_len} does not fit the file's {size} bytes")
        try:
            header = json.loads(self._file.read(header_len))
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._bad(f"its header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        data_start = 8 + header_len
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype: torch.dtype | str
                if info["dtype"] in _UNSUPPORTED_DTYPE_BITS:
                    dtype, bits = info["dtype"], _UNSUPPORTED_DTYPE_BITS[info["dtype"]]
                else:
                    dtype = _SAFETENSORS_DTYPES[info["dtype"]]
                    bits = 8 * dtype.itemsize
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has a bad or unsupported dtype, shape or offsets") from None
            numbers = (*shape, begin, end)
            if not all(type(x) is int and 0 <= x < 1 << 62 for x in numbers):
                raise self._bad(f"tensor {name!r}'s shape and offsets must be non-negative integers")
            if 8 * (end - begin) != math.prod(shape) * bits or data_start + end > size:
                raise self._bad(f"tensor {name!r}'s offsets do not match its shape or the file")
            entries[name] = (dtype, shape, data_start + begin, data_start + end)
        spans = sorted((begin, end) for _, _, begin, end in entries.values() if end > begin)
        if any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)):
            raise self._bad("two tensors' data overlap")
        return entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> torch.dtype | str:
        """The tensor's torch dtype, or its safetensors dtype name where the loader cannot read it."""
        return self._entries[name][0]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only [start, start + length) of its dimension `dim`: only those bytes are read
        (one read per index of the dimensions before `dim`)."""
        dtype, shape, begin, _ = self._entries[name]
        if isinstance(dtype, str):  # a valid safetensors file; "re-download" was the wrong advice
            raise ConfigError(
                f"{os.path.basename(self.path)}: tensor {name!r} is stored as {dtype}, a safetensors dtype "
                f"tp_runtime does not support (it reads {', '.join(_SAFETENSORS_DTYPES)})"
            )
        if length is None:
            dim, start, length = 0, 0, shape[0] if shape else 1
        extent = (shape or (1,))[dim] if 0 <= dim < max(len(shape), 1) else -1
        if extent < 0 or start < 0 or length < 0 or start + length > extent:
            raise IndexError(f"[{start}, {start}+{length}) of dim {dim} of {name!r} is outside {list(shape)}")
        out_shape = (*shape[:dim], length, *shape[dim + 1 :]) if shape else ()
        nbytes = math.prod(out_shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(out_shape, dtype=dtype)
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * dtype.itemsize
        row, chunk = (shape[dim] * inner if shape else nbytes), length * inner
        # An anonymous mapping of its own, unmapped when the tensor goes: buffers from the heap stayed
        # resident between the parameters they were copied into.
        staging = mmap.mmap(-1, nbytes)
        view = memoryview(staging)
        fd = self._file.fileno()
        if chunk == row or outer == 1:  # contiguous in the file
            pieces = [(view, begin + start * inner)]
        else:
            pieces = [
                (view[i * chunk : (i + 1) * chunk], begin + i * row + start * inner) for i in range(outer)
            ]
        for target, offset in pieces:
            done = 0
            while done < len(target):  # one preadv returns at most about 2 GiB
                got = os.preadv(fd, [target[done:]], offset + done)
                if got == 0:
                    raise self._bad(f"tensor {name!r} is cut short")
                done += got
        del view, pieces
        return torch.frombuffer(staging, dtype=torch.uint8).view(dtype).reshape(out_shape)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal styling in torch's unpickling messages


class TorchBinFile:
    """One PyTorch checkpoint file (transformers' pytorch_model.bin: a pickled state dict) with
    SafetensorsFile's interface. torch.load's weights_only unpickler builds nothing but tensors and plain
    containers, and its memory map reads only the pages of the slices taken."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # A file of torch's legacy (pre-zip) format cannot be mapped: read whole.
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling, zip and format errors of every kind
            # torch's message is ANSI-styled; it names an object it refused on an "unsupported global" line.
            lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
            refused = next((line for line in lines if "unsupported global" in line.lower()), None)
            if isinstance(exc, pickle.UnpicklingError) and refused is not None:
                raise ConfigError(
                    f"{path} holds more than tensors, which tp_runtime does not unpickle ({refused[:300]}); "
                    "save the model's state_dict() alone, or convert the checkpoint to safetensors"
                ) from None
            reason = lines[0] if lines else type(exc).__name__
            raise ConfigError(
                f"{path} is not a loadable PyTorch checkpoint ({reason[:300]}); re-download it or convert "
                "the checkpoint to safetensors"
            ) from None
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ConfigError(
                f"{path} does not hold a flat state dict (tensor names mapped to tensors), as transformers "
                "writes pytorch_model.bin; save the model's state_dict() alone, or convert it to safetensors"
            )
        self._tensors: dict[str, torch.Tensor] = dict(state)

    def __enter__(self) -> TorchBinFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._tensors = {}  # drops the file's memory map with the last tensor of it

    def keys(self) -> list[str]:
        return list(self._tensors)

    def dtype(self, name: str) -> torch.dtype | str:
        return self._tensors[name].dtype

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """As SafetensorsFile.read: the tensor, or [start, start + length) of its dimension `dim`, copied out
        of the map."""
        tensor = self._tensors[name]
        if length is not None:
            extent = tensor.shape[dim] if 0 <= dim < tensor.dim() else -1
            if extent < 0 or start < 0 or length < 0 or start + length > extent:
                raise IndexError(
                    f"[{start}, {start}+{length}) of dim {dim} of {name!r} is outside {list(tensor.shape)}"
                )
            tensor = tensor.narrow(dim, start, length)
        return tensor.clone(memory_format=torch.contiguous_format)


# A checkpoint file open for reading.
WeightFile = SafetensorsFile | TorchBinFile


def open_weight_file(path: str) -> WeightFile:
    return TorchBinFile(path) if path.endswith(".bin") else SafetensorsFile(path)


class CheckpointTensor:
    """A tensor in a checkpoint file, read lazily and in parts, converted to `dtype` (None: as stored).
    FP8 tensors stay FP8: their layer's LinearMethod reads them with their scales."""

    def __init__(self, handle: WeightFile, name: str, dtype: torch.dtype | None) -> None:
        self._handle = handle
        self.name = name
        self._dtype = dtype
        self.shape: tuple[int, ...] = handle.shape(name)

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._dtype is None or t.dtype in FP8_DTYPES else t.to(self._dtype)

    @property
    def stored_dtype(self) -> torch.dtype | str:
        return self._handle.dtype(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._convert(self._handle.read(self.name, dim, start, length))

    def full(self) -> torch.Tensor:
        return self._convert(self._handle.read(self.name))


_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def _weight_map(model_dir: str, index_name: str = _SAFETENSORS_INDEX) -> dict[str, str] | None:
    """An index's weight_map (tensor name -> file), None where there is no such index."""
    index = Path(model_dir) / index_name
    if not index.is_file():
        return None
    kind = "safetensors" if index_name == _SAFETENSORS_INDEX else "PyTorch checkpoint"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("a file name that is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{index} is not a {kind} index (a JSON object whose weight_map maps tensor names to "
            f"files): {type(exc).__name__}: {exc}; download it again"
        ) from None
    return dict(weight_map)


def _indexed_files(model_dir: str, index_name: str, weight_map: dict[str, str]) -> list[str]:
    """The files an index names, all of which must be there."""
    absent = sorted({f for f in weight_map.values() if not (Path(model_dir) / f).is_file()})
    if absent:
        # With a tensor the index puts in each: which part of the model is missing.
        named = [f"{f} (for {next(n for n, g in weight_map.items() if g == f)!r})" for f in absent[:4]]
        raise ConfigError(
            f"{Path(model_dir) / index_name} names weight files that are not in {model_dir}: "
            f"{', '.join(named)}; download the whole checkpoint"
        )
    return sorted({str(Path(model_dir) / f) for f in weight_map.values()})


class RowSlice:
    """Rows [start, start + length) of a checkpoint tensor, read as a tensor of its own (a part of a fused
    tensor, CausalLM.fused_checkpoint_parts)."""

    def __init__(self, source: CheckpointTensor, name: str, start: int, length: int) -> None:
        self._source = source
        self.name = name
        self._start = start
        self.shape: tuple[int, ...] = (length, *source.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._source.narrow(0, self._start + start, length)
        return self.full().narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self._source.narrow(0, self._start, self.shape[0])


class HeadRowsReordered:
    """A checkpoint tensor whose rows are read in another order within each head (CausalLM.
    checkpoint_row_order); ranks read whole heads, so each rank still reads only its rows."""

    def __init__(self, source: Any, order: list[int]) -> None:
        self._source = source
        self._order = torch.tensor(order)
        self.name: str = source.name
        self.shape: tuple[int, ...] = tuple(source.shape)
        if self.shape[0] % len(order):
            raise ConfigError(f"{self.name!r} has {self.shape[0]} rows: not whole heads of {len(order)}")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.full().narrow(dim, start, length)
        head = len(self._order)
        if start % head or length % head:
            raise ConfigError(f"{self.name!r}: rows {start}..{start + length} are not whole heads of {head}")
        rows = self._source.narrow(0, start, length)
        by_head = rows.reshape(length // head, head, *rows.shape[1:])
        return by_head[:, self._order.to(rows.device)].reshape(rows.shape)

    def full(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


# transformers 5's in-memory names of a mixture of experts' stacked weights ([experts, ...] tensors).
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(_scale\w*)?$")


def _unexpected_tensor(path: str, stored: str) -> str:
    message = f"{os.path.basename(path)} holds unexpected tensor {stored!r}"
    if _STACKED_EXPERTS.search(stored):
        message += (
            " (transformers' in-memory layout of stacked experts, as a raw state_dict save writes it; "
            "save the model with save_pretrained, which writes one tensor per expert, as the model's own "
            "checkpoints have them)"
        )
    return message


def _split_fused(model: CausalLM, path: str, name: str, tensor: CheckpointTensor) -> list[tuple[str, Any]]:
    """(name, source) for each tensor the model takes from checkpoint tensor `name`: its parts where it
    fuses several (CausalLM.fused_checkpoint_parts), else itself."""
    parts = model.fused_checkpoint_parts(name)
    if not parts:
        return [(name, tensor)]
    rows = sum(length for _, length in parts)
    if not tensor.shape or tensor.shape[0] != rows:
        raise ConfigError(
            f"{os.path.basename(path)}: tensor {name!r} has shape {list(tensor.shape)} but the model's "
            f"config.json gives {rows} rows ({' + '.join(str(n) for _, n in parts)}); the config does not "
            "match the weights"
        )
    split, start = [], 0
    for part, length in parts:
        split.append((part, RowSlice(tensor, part, start, length)))
        start += length
    return split


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files transformers reads: model.safetensors, else the index's (in its order, the
    later file's tensor winning where two hold one), else every *.safetensors."""
    files, _ = _safetensors_source(model_dir)
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {model_dir}; convert the checkpoint to safetensors "
            "or use load_format='dummy' for random weights"
        )
    return files


def _safetensors_source(model_dir: str) -> tuple[list[str], str | None]:
    """safetensors_files' files ([] where there are none) and the index they come from (None: none)."""
    folder = Path(model_dir)
    # As transformers: model.safetensors before an index beside it (one left from an earlier save), and
    # other *.safetensors beside it (a consolidated copy) are not read.
    single = folder / "model.safetensors"
    if single.is_file():
        return [str(single)], None
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        return _indexed_files(model_dir, _SAFETENSORS_INDEX, weight_map), _SAFETENSORS_INDEX
    return sorted(str(p) for p in folder.glob("*.safetensors")), None


def weight_files(model_dir: str) -> list[str]:
    """The weight files, in transformers' order of preference: model.safetensors, the safetensors index's,
    pytorch_model.bin, the PyTorch index's (pytorch_model.bin.index.json), else every *.safetensors (so a
    stray adapter_model.safetensors beside pytorch_model.bin is not taken for the weights)."""
    return _weight_source(model_dir)[0]


def _weight_source(model_dir: str) -> tuple[list[str], str | None]:
    """weight_files' files and the index that lists them (None: they come from no index)."""
    folder = Path(model_dir)
    if (folder / _SAFETENSORS_INDEX).is_file() or (folder / "model.safetensors").is_file():
        return _safetensors_source(model_dir)
    if (folder / "pytorch_model.bin").is_file():  # before an index beside it, as in transformers
        return [str(folder / "pytorch_model.bin")], None
    weight_map = _weight_map(model_dir, _BIN_INDEX)
    if weight_map is not None:
        return _indexed_files(model_dir, _BIN_INDEX, weight_map), _BIN_INDEX
    if any(folder.glob("*.safetensors")):
        return _safetensors_source(model_dir)
    raise ConfigError(
        f"no weights in {model_dir}: neither *.safetensors nor pytorch_model.bin; download the checkpoint's "
        "weights, or use load_format='dummy' for random weights"
    )


class QuantizedCheckpoint:
    """The FP8 side of loading: which layers the checkpoint leaves unquantized (its ignore list), and the
    scale tensors (`<module>.weight_scale`, ...), routed to the layer of `<module>.weight`."""

    def __init__(
        self,
        model: CausalLM,
        quant: QuantConfig | None,
        checkpoint_names: CheckpointNames = MODEL_NAMES,
        stored_unquantized: frozenset[str] = frozenset(),
    ) -> None:
        """`stored_unquantized`: the checkpoint's names of the weights it stores in 16 or 32 bits. Their
        layers stay unquantized, as if the config's ignore list named them (a scale beside such a weight
        is refused once all are read)."""
        self.model = model
        self.quant = quant
        modules = model.modules() if isinstance(model, torch.nn.Module) else []
        self.layers: dict[int, QuantizedLayer] = {}
        for module in modules:
            holders = module.stacks if isinstance(module, SparseMoE) else [module]
            for holder in holders:
                if isinstance(holder, QuantizedLayer):
                    self.layers[id(holder.weight)] = holder
        self.weight_shapes = dict(model.checkpoint_shapes())
        self.scales_missing: set[str] = set()
        # Scales of weights whose layer is not FP8 here (an embedding, an LM head, an ignored layer): their
        # FP8 weights are dequantized at load (DequantizedTensor).
        self.plain_scales: dict[str, torch.Tensor] = {}
        if quant is None:
            return
        # A fused layer (q/k/v, gate/up) is quantized or not as a whole.
        parts: dict[int, tuple[QuantizedLayer, list[bool]]] = {}
        for name, _ in model.checkpoint_shapes():
            layer = self._layer_of(name)
            if layer is not None and _is_quantized(layer):
                # The ignore list names modules as the checkpoint does.
                stored = checkpoint_names.checkpoint_names(name)
                ignored = any(
                    quant.is_ignored(s.removesuffix(".weight")) or s in stored_unquantized for s in stored
                )
                parts.setdefault(id(layer), (layer, []))[1].append(ignored)
                self.scales_missing.add(name)
        for layer, flags in parts.values():
            if all(flags):
                layer.use_method(UNQUANTIZED)
            elif any(flags):
                raise ConfigError(
                    "the checkpoint leaves some of the projections this engine stores together (q/k/v, "
                    "gate/up, or one layer's experts: their gate/up projections, and their down projections) "
                    "unquantized (its quantization_config's ignore list, or weights stored in 16/32 bits) "
                    "and not the others; that is not supported"
                )
        still_quantized = {n for n in self.scales_missing if _is_quantized(self._layer_of(n))}
        self.scales_missing = set() if quant.checkpoint_format == "online" else still_quantized

    def _layer_of(self, weight_name: str) -> QuantizedLayer | None:
        if not weight_name.endswith(".weight"):
            return None
        try:
            targets = list(self.model.checkpoint_targets(weight_name))
        except KeyError:
            return None
        return self.layers.get(id(targets[0][0])) if targets else None

    def load_extra(self, name: str, tensor: CheckpointTensor) -> bool:
        """Load `name` if it is a quantization tensor (a scale; activation scales are read and dropped:
        activations get dynamic per-token scales); False if it is not one."""
        if self.quant is None:
            return False
        module, _, suffix = name.rpartition(".")
        weight_scale = suffix in self.quant.scale_suffixes
        activation_scale = suffix in self.quant.activation_scale_suffixes
        # A layer kept unquantized here may hold an FP8 weight under either name (transformers'
        # FP8Embedding says `weight_scale` in a block-scaled checkpoint).
        plain_scale = suffix in _PLAIN_SCALE_SUFFIXES
        if not (weight_scale or activation_scale or plain_scale):
            return False
        weight = f"{module}.weight"
        try:
            targets = list(self.model.checkpoint_targets(weight))
        except KeyError:
            return False
        layers = [self.layers.get(id(param)) for param, _ in targets]
        if not any(_is_quantized(layer) for layer in layers):
            if not activation_scale:  # (an unquantized layer's activation scale is dropped)
                self.plain_scales[weight] = tensor.full().to(torch.float32)
            return True
        if not (weight_scale or activation_scale):
            return False  # a scale of another format's name, for an FP8 layer
        for (_, shard_id), layer in zip(targets, layers, strict=True):
            if weight_scale and layer is not None:
                layer.load_scale(tensor, shard_id, tuple(self.weight_shapes[weight]))
        if weight_scale:  # an activation scale is no weight scale: without one the weight is refused
            self.scales_missing.discard(weight)
        return True

    def plain_weight_scale(self, name: str, stored: str, path: str) -> torch.Tensor:
        """The scale of FP8 checkpoint tensor `stored` (the model's `name`) of a layer that is not FP8 here
        (DequantizedTensor reads it): ConfigError where the checkpoint cannot say it."""
        where = f"{os.path.basename(path)}: {stored!r}"
        scale = self.plain_scales.get(name)
        if self.quant is None:
            raise ConfigError(
                f"{where} is stored in FP8, but the checkpoint's config.json has no quantization_config to "
                "say how its scales are stored"
            )
        if self.quant.checkpoint_format == "online":
            raise ConfigError(
                f"{where} is stored in FP8, but quantization='fp8' quantizes a 16- or 32-bit checkpoint at "
                "load and this one has no quantization_config to give its scales; use the checkpoint it was "
                "made from"
            )
        if scale is None:
            module = name.removesuffix(".weight")
            raise ConfigError(
                f"{where} is stored in FP8, but the checkpoint holds no scale for it "
                f"({module}.{self.quant.scale_suffixes[0]}); it is incomplete: download it again"
            )
        check_finite_scale(scale, f"the scale of {where}")
        return scale


class DequantizedTensor:
    """An FP8 checkpoint tensor of a layer the engine keeps unquantized (an FP8 embedding or LM head:
    transformers' FP8Embedding, compressed-tensors whose ignore list leaves lm_head in), read as
    weight * scale in float32 and rounded to `dtype`, as transformers dequantizes it: only the rows a
    rank asks for, a few million values at a time (an LM head's float32 copy would be gigabytes)."""

    _CHUNK = 1 << 22  # values dequantized at once

    def __init__(
        self, handle: WeightFile, stored: str, scale: torch.Tensor, block: tuple[int, int] | None,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        where = f"{os.path.basename(handle.path)}: {stored!r}"
        stored_dtype = handle.dtype(stored)
        if stored_dtype != torch.float8_e4m3fn:
            raise ConfigError(f"{where} is {stored_dtype}; only float8_e4m3fn FP8 weights are supported")
        self.name = stored
        self.shape: tuple[int, ...] = handle.shape(stored)
        self._handle, self._dtype = handle, dtype
        rows = self.shape[0] if self.shape else 1
        cols = self.shape[1] if len(self.shape) == 2 else 1
        # A block grid first: a few rows' grid ([1, 4] for a [4, 64] router in 16x16 blocks) has the
        # count and shape of per-row scales.
        if (
            len(self.shape) == 2 and block is not None
            and tuple(scale.shape) == (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        ):  # fmt: skip
            bn, bk = block

            def tiles(r0: int, n: int) -> torch.Tensor:
                first = r0 // bn
                part = scale[first : (r0 + n - 1) // bn + 1].repeat_interleave(bn, dim=0)
                return part[r0 - first * bn : r0 - first * bn + n].repeat_interleave(bk, dim=1)[:, :cols]

            self._scale_rows: Any = tiles
        elif scale.numel() == 1:
            self._scale_rows = lambda r0, n: scale.reshape(())
        elif len(self.shape) == 2 and scale.numel() == rows and (scale.dim() == 1 or 1 in scale.shape):
            by_row = scale.reshape(rows, 1)
            self._scale_rows = lambda r0, n: by_row[r0 : r0 + n]
        else:
            raise ConfigError(
                f"{where} has shape {list(self.shape)} and its scale {list(scale.shape)}: not one scale, one "
                "per row, or one per block of the config's weight_block_size"
            )

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.full().narrow(dim, start, length)
        out = torch.empty((length, *self.shape[1:]), dtype=self._dtype)
        row_values = max(1, math.prod(self.shape[1:]))
        step = max(1, self._CHUNK // row_values)
        for r0 in range(start, start + length, step):
            n = min(step, start + length - r0)
            w = self._handle.read(self.name, 0, r0, n).to(torch.float32)
            out[r0 - start : r0 - start + n] = (w * self._scale_rows(r0, n)).to(self._dtype)
        return out

    def full(self) -> torch.Tensor:
        if not self.shape:
            return (self._handle.read(self.name).to(torch.float32) * self._scale_rows(0, 1)).to(self._dtype)
        return self.narrow(0, 0, self.shape[0])


_PLAIN_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def _is_quantized(layer: QuantizedLayer | None) -> bool:
    return layer is not None and layer.method.quantized


def load_weights(
    model: CausalLM,
    model_dir: str,
    dtype: torch.dtype,
    quant: QuantConfig | None = None,
    checkpoint_names: CheckpointNames = MODEL_NAMES,
) -> None:
    """Fill every parameter of `model` from the checkpoint; missing or unknown tensors are errors.
    `quant`: the model's FP8 config (its layers are FP8 already; the checkpoint's scales go to them).
    `checkpoint_names`: how the architecture's checkpoints name the model's tensors (models/registry.py);
    the tensors it skips are never read."""
    files, index_name = _weight_source(model_dir)
    stored_unquantized: frozenset[str] = frozenset()
    if quant is not None and quant.checkpoint_format != "online":
        stored_unquantized = _stored_unquantized(files)
    quantized = QuantizedCheckpoint(model, quant, checkpoint_names, stored_unquantized)
    # By checkpoint name, not by parameter: a fused or stacked parameter (q/k/v, experts) takes many.
    expected = dict(model.checkpoint_shapes())
    missing = dict(expected)
    tied = model.tied_checkpoint_names()
    tied_found: dict[str, tuple[str, str]] = {}  # a tied name the checkpoint holds -> its file, name there
    plain_fp8: dict[str, tuple[str, str]] = {}  # FP8 tensors of layers not FP8 here -> file, name there
    for path in files:
        with open_weight_file(path) as handle:
            for stored in handle.keys():  # noqa: SIM118 - not a dict
                # `stored`: the tensor's name in the file (what is read); `name`: the model's name of it.
                try:
                    name = checkpoint_names.model_name(stored)
                except KeyError:
                    raise ConfigError(_unexpected_tensor(path, stored)) from None
                if name is None:
                    continue
                if name in tied:  # checked against (or standing in for) its twin once all are loaded
                    tied_found[name] = (path, stored)
                    continue
                if quantized.load_extra(name, CheckpointTensor(handle, stored, None)):
                    continue
                if _load_kv_scale(model, name, CheckpointTensor(handle, stored, None)):
                    continue
                for part, tensor in _split_fused(model, path, name, CheckpointTensor(handle, stored, dtype)):
                    order = model.checkpoint_row_order(part)
                    if order is not None:
                        tensor = HeadRowsReordered(tensor, order)
                    try:
                        targets = list(model.checkpoint_targets(part))
                    except KeyError:
                        raise ConfigError(_unexpected_tensor(path, stored)) from None
                    # Each rank reads only its slice, so a tensor of the wrong size could load part of itself.
                    if part in expected and tensor.shape != tuple(expected[part]):
                        raise ConfigError(
                            f"{os.path.basename(path)}: tensor {stored!r} has shape {list(tensor.shape)} but "
                            f"the model's config.json gives {list(expected[part])}; the config does not "
                            "match the weights"
                        )
                    if handle.dtype(stored) in FP8_DTYPES and any(
                        p.dtype not in FP8_DTYPES for p, _ in targets
                    ):
                        if part != name:
                            raise ConfigError(
                                f"{os.path.basename(path)}: tensor {stored!r} is stored in FP8, but this "
                                "engine keeps the layer it fills unquantized (not an FP8 layer of the "
                                "checkpoint's quantization_config)"
                            )
                        plain_fp8[name] = (path, stored)  # dequantized once its scale has been read
                        continue
                    for param, shard_id in targets:
                        param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                    missing.pop(part, None)
    for name, (path, stored) in plain_fp8.items():
        scale = quantized.plain_weight_scale(name, stored, path)
        block = quant.block_size if quant is not None else None
        with open_weight_file(path) as handle:
            source = DequantizedTensor(handle, stored, scale, block, dtype)
            for param, shard_id in model.checkpoint_targets(name):
                param.weight_loader(param, source, shard_id)  # type: ignore[attr-defined]
        missing.pop(name, None)
    # (tied tensors first: one stored in FP8 with its scale gets its own message)
    for name, (path, stored) in tied_found.items():
        _load_tied(model, name, stored, tied[name], path, dtype, expected, missing)
    stray = sorted(set(quantized.plain_scales) - set(plain_fp8))
    if stray:
        raise ConfigError(
            f"checkpoint {model_dir} holds weight scales of layers whose weights are not FP8 "
            f"({', '.join(stray[:4])}): its quantization_config does not match its tensors"
        )
    if missing:
        names = sorted(missing)
        # A checkpoint of a tied model under an untied config: the usual cause of a missing LM head.
        hint = (
            "; if the model shares its LM head with the input embeddings, set tie_word_embeddings to true "
            "in config.json"
            if "lm_head.weight" in missing
            else ""
        )
        # Where the index puts a missing tensor in a file: that file lacks it (a bad or mixed download).
        weight_map = _weight_map(model_dir, index_name) if index_name is not None else None
        by_model_name = _model_names(weight_map or {}, checkpoint_names)
        placed = [f"{n!r} in {by_model_name[n]}" for n in names if n in by_model_name][:4]
        if placed:
            hint += (
                f"; {index_name} puts {', '.join(placed)}, which does not hold it: download the checkpoint "
                "again"
            )
        raise ConfigError(f"checkpoint {model_dir} lacks tensors for: {', '.join(names[:8])}{hint}")
    if quantized.scales_missing:
        names = sorted(quantized.scales_missing)
        suffix = quant.scale_suffixes[0] if quant is not None else "weight_scale"
        raise ConfigError(
            f"checkpoint {model_dir} has FP8 weights without their scales (*.{suffix}): "
            f"{', '.join(names[:8])}"
        )


def _stored_unquantized(files: list[str]) -> frozenset[str]:
    """The names of the 16- and 32-bit floating-point tensors that `files` hold (from their headers)."""
    names = set()
    for path in files:
        with open_weight_file(path) as handle:
            for stored in handle.keys():  # noqa: SIM118 - not a dict
                if handle.dtype(stored) in (torch.float16, torch.bfloat16, torch.float32):
                    names.add(stored)
    return frozenset(names)


def _model_names(weight_map: dict[str, str], names: CheckpointNames) -> dict[str, str]:
    """An index's weight_map by the model's names of its tensors (those `names` skips or does not know
    left out)."""
    renamed = {}
    for stored, file in weight_map.items():
        try:
            name = names.model_name(stored)
        except KeyError:
            continue
        if name is not None:
            renamed[name] = file
    return renamed


def _load_tied(
    model: CausalLM,
    name: str,
    stored: str,
    twin: str,
    path: str,
    dtype: torch.dtype,
    expected: dict[str, tuple[int, ...]],
    missing: dict[str, tuple[int, ...]],
) -> None:
    """A tied tensor the checkpoint holds (a tied model's lm_head.weight; `stored`: its name in the file),
    as transformers 5 reads it: it fills its twin's parameter when the checkpoint lacks the twin; where
    both are there and differ, transformers unties them, which a tied model cannot, so that is a
    ConfigError (it silently gave another LM head than HF's)."""
    with open_weight_file(path) as handle:
        if handle.dtype(stored) in FP8_DTYPES:
            raise ConfigError(
                f"{os.path.basename(path)}: tensor {stored!r} of a tied model is stored in FP8; tied "
                "embeddings are loaded only unquantized"
            )
        tensor = CheckpointTensor(handle, stored, dtype)
        if tensor.shape != tuple(expected[twin]):
            raise ConfigError(
                f"{os.path.basename(path)}: tensor {stored!r} has shape {list(tensor.shape)} but the model's "
                f"config.json gives {list(expected[twin])}; the config does not match the weights"
            )
        for param, shard_id in model.checkpoint_targets(twin):
            if twin in missing:
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                continue
            this_rank = torch.nn.Parameter(torch.zeros_like(param), requires_grad=False)
            param.weight_loader(this_rank, tensor, shard_id)  # type: ignore[attr-defined]
            if not torch.equal(this_rank, param):
                raise ConfigError(
                    f"checkpoint {os.path.dirname(path)} holds {stored!r} and {twin!r} with different "
                    "values, but its config.json ties them (tie_word_embeddings=true); transformers then "
                    "uses the two untied: set tie_word_embeddings to false in config.json"
                )
    missing.pop(twin, None)


def _load_kv_scale(model: CausalLM, name: str, tensor: CheckpointTensor) -> bool:
    """Give a checkpoint KV-cache scale to its attention layer (used where the cache is FP8, see
    layers/kv_fp8.py); False if `name` is not one."""
    found = kv_fp8.kv_scale_name(name)
    if found is None or not isinstance(model, torch.nn.Module):
        return False
    module_name, which = found
    try:
        attention = model.get_submodule(module_name)
    except AttributeError:
        return False
    set_scales = getattr(attention, "set_kv_scales", None)
    if set_scales is None:
        return False
    if not which:  # a query or probability scale: read and dropped
        return True
    value = kv_fp8.scale_value(tensor.full(), name)
    set_scales(value if "k" in which else None, value if "v" in which else None)
    return True


# Elements of a dummy tensor hashed at once (each takes ~40 bytes of int64 temporaries).
_DUMMY_CHUNK_ELEMENTS = 1 << 23


class DummyTensor:
    """A pseudo-random checkpoint tensor whose every element is a hash of its global index.

    Any slice can be made on the target device without building the full tensor, and a rank's slice holds
    exactly the values the same slice of the full tensor holds, so dummy models agree across TP sizes.
    `synthetic`: an FP8 layer of a checkpoint's quantization_config quantizes it at load (no scales come).
    """

    synthetic = True

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
        shape = list(self.shape)
        shape[dim] = length
        out = torch.empty(shape, dtype=self._dtype, device=self._device)
        if out.numel() == 0:
            return out
        # The hash runs on int64 with a few temporaries alive at once: made whole, a 70B LM head's would
        # take ~30 GB beside the weights already loaded, so rows are made a bounded number at a time.
        per_row = out.numel() // shape[0]
        step = max(1, _DUMMY_CHUNK_ELEMENTS // per_row)
        for row in range(0, shape[0], step):
            rows = min(step, shape[0] - row)
            out[row : row + rows] = self._values(dim, start, length, row, rows)
        return out

    def _values(self, dim: int, start: int, length: int, row: int, rows: int) -> torch.Tensor:
        """Rows [row, row + rows) of narrow(dim, start, length)."""
        index = torch.zeros((), dtype=torch.int64, device=self._device)
        stride = 1
        for d in reversed(range(len(self.shape))):
            lo, n = (start, length) if d == dim else (0, self.shape[d])
            if d == 0:
                lo, n = lo + row, rows
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


def dummy_checkpoint(
    model: CausalLM, seed: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, DummyTensor]]:
    """The full checkpoint tensors `load_format="dummy"` gives `model` (by checkpoint name): norms 1,
    biases within ±0.01, weights within ±1/sqrt(fan-in)."""
    for tensor_index, (name, shape) in enumerate(model.checkpoint_shapes()):
        is_norm = name.endswith("norm.weight")
        is_bias = name.endswith(".bias")
        yield name, DummyTensor(
            shape,
            seed=seed * 100003 + tensor_index,
            scale=0.0 if is_norm else (0.01 if is_bias else shape[-1] ** -0.5),
            offset=1.0 if is_norm else 0.0,
            dtype=dtype,
            device=device,
        )


def init_dummy_weights(model: CausalLM, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Random weights through the same sharding path as a real checkpoint (see DummyTensor)."""
    for name, source in dummy_checkpoint(model, seed, dtype, device):
        for param, shard_id in model.checkpoint_targets(name):
            param.weight_loader(param, source, shard_id)  # type: ignore[attr-defined]
