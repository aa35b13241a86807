"""A norm's output handed on uncomputed, so that the linear layer it feeds can fuse it with its own
input's preparation (layers/norm.py makes them, the linear methods take them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tp_runtime.layers.norm import RMSNorm


class NormedInput:
    """RMSNorm(x [+ residual]) not yet computed, handed to the linear layer it feeds: its method computes it
    in the same kernel as its input's quantization where it can (FP8 W8A8, fp8.py), else plainly
    (`tensor`). Computed once: the residual's in-place update happens exactly once either way."""

    __slots__ = ("_out", "_quantized", "norm", "residual", "x")

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.norm = norm
        self.x = x
        self.residual = residual
        self._out: torch.Tensor | None = None
        self._quantized = False

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def tensor(self) -> torch.Tensor:
        if self._out is None:
            if self._quantized:
                raise RuntimeError("internal: a NormedInput taken quantized was asked for its values")
            self._out = self.norm(self.x, self.residual)
        return self._out

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized rows quantized per row to e4m3 (activation_quant_triton.rms_norm_quantized),
        in place of `tensor`; only for a fused norm (CUDA)."""
        from tp_runtime.layers.quantization.activation_quant_triton import rms_norm_quantized

        if self._out is not None or self._quantized or not self.norm.fused:
            raise RuntimeError("internal: NormedInput.quantized after its values, or without a fused norm")
        self._quantized = True
        norm = self.norm
        return rms_norm_quantized(self.x, norm.weight, norm.eps, self.residual, norm.unit_offset)


def as_tensor(x: torch.Tensor | NormedInput) -> torch.Tensor:
    """x's values, computing a deferred norm."""
    return x.tensor() if isinstance(x, NormedInput) else x
