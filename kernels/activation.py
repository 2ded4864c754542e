"""Gated MLP activation `silu(x[..., :I]) * x[..., I:]` (or, `interleaved`, `silu(x[..., 0::2]) * x[..., 1::2]`):
Triton kernel and plain-PyTorch reference."""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait

__all__ = ['silu_and_mul', 'silu_and_mul_ref', 'swigluoai_and_mul_ref']


def silu_and_mul_ref(x, interleaved: bool = False):
    "`x` `[..., 2I]` -> `silu(gate) * up` `[..., I]`, computed in fp32 (`interleaved`: gate_i, up_i at 2i, 2i + 1)."
    gate, up = (x.float()[..., 0::2], x.float()[..., 1::2]) if interleaved else x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def swigluoai_and_mul_ref(x, alpha: float = 1.702, limit: float = 7.0, interleaved: bool = False):
    """gpt-oss's clamped SwiGLU (vLLM's `swigluoai`): `x` `[..., 2I]` -> `(up + 1) * gate * sigmoid(alpha * gate)`
    with `gate` clamped above at `limit` and `up` to `[-limit, limit]`, in fp32 (`interleaved`: gate_i, up_i at 2i,
    2i + 1, as gpt-oss's checkpoints store them; otherwise the gate half, then the up half)."""
    gate, up = (x.float()[..., 0::2], x.float()[..., 1::2]) if interleaved else x.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(gate * alpha)).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_inter, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    pdl_wait(PDL)
    pdl_launch(PDL)
    gp = x_ptr + row * stride_x + (2 * offs if INTERLEAVED else offs)
    gate = tl.load(gp, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gp + (1 if INTERLEAVED else n_inter), mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x, out=None, interleaved: bool = False):
    "Triton `silu_and_mul_ref` over the last dim of `x` (any leading shape)."
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device) if out is None else out
    o2 = out.view(-1, n)
    if x2.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, o2, x2.stride(0), o2.stride(0), n, BLOCK=block, INTERLEAVED=interleaved, num_warps=4, **pdl_kw(x2.device)
    )
    return out
