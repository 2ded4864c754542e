"""Dynamic FP8 quantization of activations for the W8A8 GEMM (`fp8_gemm`), and its PyTorch reference.

`x [M, K]` (16- or 32-bit) -> `q` `float8_e4m3fn [M, K]` and fp32 scales `s`, `x ~= q * s`, with `s = amax / 448`
(e4m3's largest finite value) over

| `group` | scales | pairs with weights |
|---|---|---|
| `None` (per token) | `[M]`, one per row | per-tensor / per-channel FP8 (`weight_scale`): the GEMM applies `s_x[m] * s_w[n]` once, in its epilogue |
| 128 (per 1 x 128 group) | `[M, ceil(K / 128)]` | 128 x 128 block FP8 (`weight_scale_inv`): each 128-wide K-block of the GEMM is scaled by `s_x[m, kb] * s_w[nb, kb]` |

Two per-token variants follow a checkpoint's activation scheme: a static per-tensor scale (`scale`, the
checkpoint's `input_scale`: every row divided by it and clamped to +-448, its scales all equal to it) and an upper
bound on the dynamic scales (`scale_ub`, fbgemm's `activation_scale_ub`: a row's amax is clamped to it before the
scale is taken, so one outlier token does not flatten the others' precision; values above it saturate at +-448).

An all-zero row or group gets the scale `EPS / 448` (its values quantize to 0). The Triton kernel runs one program
per row (per token: two passes over the row, the amax, then the quantization; per group: `GPB` groups of 128 per
iteration, amax and quantization in one pass). The quotient `x / s` is rounded to e4m3 by the hardware conversion
(round to nearest even, `to_e4m3`), as `Tensor.to(torch.float8_e4m3fn)` does in the reference; the GPU's fp32
division may differ from PyTorch's in the last bit, so a value may land one e4m3 step away from the reference
where `x / s` lies within an ulp of a rounding tie.
"""

import torch
import triton
import triton.language as tl

__all__ = ['FP8_MAX', 'EPS', 'to_e4m3', 'act_quant_fp8', 'act_quant_fp8_ref']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

_INTERP = tl.constexpr(_INTERPRET)
FP8_MAX = 448.0
EPS = 1e-10  # the smallest amax a scale is built from (vLLM's): zero rows stay finite


@triton.jit
def to_e4m3(v):
    """fp32 `v` (|v| <= 448) -> float8e4nv, rounded to nearest even. On the GPU one conversion instruction. The Triton
    interpreter's conversion drops the carry when rounding up to the next power of two (124.3 -> 64), so there the
    value is first rounded on the e4m3 grid in fp32 (exact: 3 mantissa bits, subnormal step 2**-9), and the
    conversion of an exactly representable value is exact."""
    if _INTERP:
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
        step = tl.exp2(e - 3.0)
        r = v / step
        f = tl.floor(r)
        up = (r - f > 0.5) | ((r - f == 0.5) & (f - 2.0 * tl.floor(f * 0.5) == 1.0))  # ties to even
        v = tl.where(up, f + 1.0, f) * step
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_token_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    in_ptr,
    K,
    stride_xm,
    stride_qm,
    ub,
    BK: tl.constexpr,
    EPS_: tl.constexpr,
    STATIC: tl.constexpr,
    UB: tl.constexpr,
):
    """Row `program_id(0)`: its amax over K (first pass; clamped to `ub` when UB), then q = x / s rounded to e4m3
    (second pass). STATIC: s is the one value at `in_ptr` (no first pass)."""
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BK)
    if STATIC:
        s = tl.load(in_ptr)
    else:
        amax = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        a = tl.max(amax, 0)
        if UB:
            a = tl.minimum(a, ub)
        s = tl.maximum(a, EPS_) / 448.0
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        q = to_e4m3(tl.clamp(x / s, -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + k0 + rk, q, mask=k0 + rk < K)
    tl.store(s_ptr + row, s)


@triton.jit
def _quant_group_kernel(
    x_ptr, q_ptr, s_ptr, K, KB, stride_xm, stride_qm, stride_sm, stride_sg, GPB: tl.constexpr, EPS_: tl.constexpr
):
    "Row `program_id(0)`, `GPB` groups of 128 per iteration: one scale per group, q = x / s rounded to e4m3."
    row = tl.program_id(0).to(tl.int64)
    rg = tl.arange(0, GPB)
    rk = tl.arange(0, 128)
    for g0 in range(0, KB, GPB):
        kk = (g0 + rg)[:, None] * 128 + rk[None, :]  # [GPB, 128]
        x = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), 1), EPS_) / 448.0  # [GPB]
        q = to_e4m3(tl.clamp(x / s[:, None], -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + kk, q, mask=kk < K)
        tl.store(s_ptr + row * stride_sm + (g0 + rg) * stride_sg, s, mask=g0 + rg < KB)


def act_quant_fp8(
    x: torch.Tensor,
    group: int | None = None,
    scales_t: bool = False,
    bk: int | None = None,
    scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
):
    """`x` `[M, K]` -> `(q float8_e4m3fn [M, K], s fp32)`: `s [M]` per token (`group=None`) or `s [M, ceil(K/128)]`
    per 1 x 128 group (`group=128`). `scales_t`: the group scales stored K-block-major (`s.t()` contiguous, the layout
    `torch._scaled_mm`'s 1 x 128 scaling reads); same values either way. Per token only: `scale`, a static fp32
    scale (one value) used for every row; `scale_ub`, the largest amax a dynamic row scale is built from."""
    assert x.ndim == 2, x.shape
    if group not in (None, 128):
        raise ValueError(f'group must be None (per token) or 128, got {group}')
    if group is not None and (scale is not None or scale_ub is not None):
        raise ValueError('a static scale or a scale bound is per token (group=None)')
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(
            f'the static activation scale must be one float32 value, got {scale.dtype} {tuple(scale.shape)}'
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    if group is None:
        s = torch.empty(M, dtype=torch.float32, device=x.device)
        if M == 0:
            return q, s
        bk = bk or (256 if _INTERPRET else min(4096, triton.next_power_of_2(K)))
        _quant_token_kernel[(M,)](
            x,
            q,
            s,
            s if scale is None else scale,
            K,
            x.stride(0),
            q.stride(0),
            float(scale_ub or 0.0),
            BK=bk,
            EPS_=EPS,
            STATIC=scale is not None,
            UB=scale_ub is not None,
            num_warps=4 if bk <= 1024 else 8,
        )
        return q, s
    KB = -(-K // 128)
    s = (
        torch.empty(KB, M, dtype=torch.float32, device=x.device).t()
        if scales_t
        else torch.empty(M, KB, dtype=torch.float32, device=x.device)
    )
    if M == 0:
        return q, s
    gpb = min(8, triton.next_power_of_2(KB))
    _quant_group_kernel[(M,)](
        x, q, s, K, KB, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GPB=gpb, EPS_=EPS, num_warps=4
    )
    return q, s


def act_quant_fp8_ref(
    x: torch.Tensor, group: int | None = None, scale: torch.Tensor | None = None, scale_ub: float | None = None
):
    "Reference: the same quantization in PyTorch (fp32 arithmetic)."
    M, K = x.shape
    xf = x.float()
    if group is None:
        if scale is not None:
            s = scale.float().reshape(1).expand(M).to(x.device)
        else:
            s = xf.abs().amax(1).clamp(max=scale_ub or float('inf')).clamp(min=EPS) / FP8_MAX
        return (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    KB = -(-K // 128)
    xp = torch.zeros(M, KB * 128, dtype=torch.float32, device=x.device)
    xp[:, :K] = xf
    s = xp.view(M, KB, 128).abs().amax(2).clamp(min=EPS) / FP8_MAX
    q = (xp.view(M, KB, 128) / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(M, KB * 128)[:, :K]
    return q.to(torch.float8_e4m3fn).contiguous(), s
