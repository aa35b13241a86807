from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """SiLU(gate) * up for the merged [gate | up] projection output (`fused`: one Triton kernel)."""
    if fused:
        from tp_runtime.layers import fused_triton

        return fused_triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up for the merged [gate | up] projection output (GeGLU, Gemma 2's
    `gelu_pytorch_tanh`; `fused`: one Triton kernel)."""
    if fused:
        from tp_runtime.layers import fused_triton

        return fused_triton.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
