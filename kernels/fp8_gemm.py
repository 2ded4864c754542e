"""W8A8: `y = x @ W.T` on FP8 tensor cores, activations quantized on the fly; its launcher and PyTorch reference.

Weights are `float8_e4m3fn [N, K]` with one of two scale layouts (`W = weight * scale`):

| layout | scale | checkpoints |
|---|---|---|
| `block` | `weight_scale_inv` fp32 `[ceil(N/128), ceil(K/128)]`, one per 128 x 128 block | DeepSeek-V3, Qwen3-FP8 |
| `channel` | `weight_scale` fp32 `[N]`, one per output channel (a per-tensor scale is repeated N times) | per-tensor / per-channel FP8 (vLLM's `fp8`, compressed-tensors) |

Activations are quantized to e4m3 per row of each 128-wide K-block (`fp8_act_quant`, `group=128`) or per token
(`group=None`, channel layout only); per token also with a checkpoint's static per-tensor `input_scale` or under
its `scale_ub` (both: `act_quant_fp8`'s `scale` / `scale_ub`, then the per-token epilogue below). The kernel `_w8a8_kernel` walks K in steps of `BK` and feeds the FP8 tiles
to `tl.dot` (fp32 accumulation on the FP8 tensor cores); the scales go where they factor out of the dot:

- per-group activations (`GROUP_A`, `BK` = 128): each K-step's dot is a fresh fp32 tile `d`, and
  `acc += d * s_x[m, kb] * s_w[nb, kb]` (block weights; one weight scale per program when `BN` <= 128) or
  `acc += d * s_x[m, kb]` (channel weights, `* s_w[n]` in the epilogue);
- per-token activations with channel weights: `acc = dot(x_q, W_q, acc)` over all of K, then
  `acc * s_x[m] * s_w[n]` once in the epilogue.

Variants (constexprs, chosen per shape and row bucket by the tuned configs `configs/fp8_gemm/`):
`SWAP` computes the transposed tile `out.T[BN, BM] = W[BN, K] @ x.T[K, BM]`, so that few rows (decode) fill
the MMA's N side and the weights its 64-row M side; `AQ` quantizes x per 1 x 128 group inside the kernel, from
the 16-bit x tile of each K-step (no separate quantization launch: each program re-quantizes the x rows it reads,
which is cheap while M is small); split-K (`split`/`target`) through the self-zeroing workspace of `split_k`;
`GROUP_M` orders the output tiles in groups of rows for L2 reuse; PDL (`pdl`) waits for the previous kernel
before the first activation load.

`fp8_scaled_mm` runs the same product through `torch._scaled_mm` (cuBLAS/CUTLASS: rowwise scales for the channel
layout, 1 x 128 by 128 x 128 block scales for the block layout where the PyTorch build has them). The dispatcher
that picks between these, the W8A16 kernels and the batch-1 GEMV is `fp8_matmul.fp8_linear`.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.fp8_act_quant import act_quant_fp8, to_e4m3
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import split_for, split_k_workspace, store_out

__all__ = ['fp8_gemm', 'fp8_scaled_mm', 'fp8_gemm_ref', 'scale_layout', 'GEMM_BUCKETS', 'gemm_bucket']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

GEMM_BUCKETS = (16, 32, 64, 128, 256, 512)  # row buckets of the config tables; 512: every M above 256


def gemm_bucket(M: int) -> int:
    "The row bucket of `configs/fp8_gemm` tables for M rows."
    for b in GEMM_BUCKETS:
        if M <= b:
            return b
    return GEMM_BUCKETS[-1]


def scale_layout(scale: torch.Tensor, N: int, K: int) -> str:
    "'channel' for an fp32 `[N]` scale, 'block' for `[ceil(N/128), ceil(K/128)]`; ValueError otherwise."
    if scale.ndim == 1 and scale.shape[0] == N:
        return 'channel'
    if scale.ndim == 2 and tuple(scale.shape) == (-(-N // 128), -(-K // 128)):
        return 'block'
    raise ValueError(
        f'weight scale must be [{N}] (per channel) or [{-(-N // 128)}, {-(-K // 128)}] (128 x 128 blocks), '
        f'got {tuple(scale.shape)}'
    )


@triton.jit
def _quant_rows(x, EPS_: tl.constexpr):
    "A 16/32-bit `[R, 128]` tile -> (e4m3 tile, fp32 scales `[R]`), one scale per row (the 1 x 128 group)."
    xf = x.to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(xf), 1), EPS_) / 448.0
    return to_e4m3(tl.clamp(xf / s[:, None], -448.0, 448.0)), s


@triton.jit(do_not_specialize=['M'])
def _w8a8_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    KB,
    stride_am,
    stride_om,
    stride_asm,
    stride_asg,
    TPS,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    GROUP_A: tl.constexpr,
    AQ: tl.constexpr,
    SWAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPS_: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[BM, BN] tile of `x_q @ W_q.T` with the scales of the module docstring. Program axis 0: output tile
    (rows grouped by GROUP_M), axis 1: K-split of TPS steps of BK. BLOCK_W: weight scales per 128 x 128 block (else
    per channel); GROUP_A: activation scales per 1 x 128 group (else per token); AQ: a_ptr is the 16-bit x, quantized
    per group here; SWAP: the tile is computed transposed, W as the MMA's A operand."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gm
    pid_n = (pid % width) // gm
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm_c = tl.minimum(rm, M - 1)
    rn_c = tl.minimum(rn, N - 1)
    ap = a_ptr + rm_c.to(tl.int64)[:, None] * stride_am + rk[None, :]  # [BM, BK]
    bp = b_ptr + rn_c.to(tl.int64)[:, None] * K + rk[None, :]  # [BN, BK]: W rows, K contiguous
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    pdl_wait(PDL)
    pdl_launch(PDL)
    for t in range(t0, t0 + TPS):
        if EVEN_K:
            a = tl.load(ap + t * BK)
            b = tl.load(bp + t * BK, eviction_policy='evict_first')
        else:
            km = (t * BK + rk) < K
            a = tl.load(ap + t * BK, mask=km[None, :], other=0.0)
            b = tl.load(bp + t * BK, mask=km[None, :], other=0.0, eviction_policy='evict_first')
        if AQ:
            a, sa = _quant_rows(a, EPS_)
        elif GROUP_A:
            sa = tl.load(as_ptr + rm_c * stride_asm + t * stride_asg)  # [BM]
        if GROUP_A:
            if SWAP:
                d = tl.dot(b, tl.trans(a))  # [BN, BM]
            else:
                d = tl.dot(a, tl.trans(b))  # [BM, BN]
            if BLOCK_W:
                if BN <= 128:  # the program's columns lie in one 128-row block of W
                    f = sa * tl.load(bs_ptr + (pid_n * BN // 128) * KB + t)
                    if SWAP:
                        acc += d * f[None, :]
                    else:
                        acc += d * f[:, None]
                else:
                    sb = tl.load(bs_ptr + (rn_c // 128) * KB + t)
                    if SWAP:
                        acc += d * sb[:, None] * sa[None, :]
                    else:
                        acc += d * sa[:, None] * sb[None, :]
            else:
                if SWAP:
                    acc += d * sa[None, :]
                else:
                    acc += d * sa[:, None]
        else:
            if SWAP:
                acc = tl.dot(b, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    if not BLOCK_W:  # per-channel weight scales (and per-token x scales) once
        sb = tl.load(bs_ptr + rn_c)
        if GROUP_A:
            if SWAP:
                acc = acc * sb[:, None]
            else:
                acc = acc * sb[None, :]
        else:
            sa = tl.load(as_ptr + rm_c * stride_asm)
            if SWAP:
                acc = acc * sb[:, None] * sa[None, :]
            else:
                acc = acc * sa[:, None] * sb[None, :]
    if SWAP:
        mask = (rn < N)[:, None] & (rm < M)[None, :]
        store_out(
            acc,
            out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None],
            mask,
            ws_ptr + rm[None, :] * N + rn[:, None],
            cnt_ptr + pid,
            SPLIT,
        )
    else:
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        store_out(
            acc,
            out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
            mask,
            ws_ptr + rm[:, None] * N + rn[None, :],
            cnt_ptr + pid,
            SPLIT,
        )


def _plan(M, N, steps, cfg, device, bm, bn, split_k, swap):
    "Block sizes and split-K of one launch: arguments over `cfg` (the interpreter: small blocks)."
    bm = bm or (16 if _INTERPRET else cfg.get('bm', 64))
    bn = bn or (32 if _INTERPRET else cfg.get('bn', 128))
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split_k is None:
        split_k = 1 if _INTERPRET else split_for(cfg, steps, tiles, 1, device)
    elif steps % split_k:
        raise ValueError(f'split_k={split_k} must divide the {steps} K-steps')
    return bm, bn, tiles, split_k


def fp8_gemm(
    x,
    weight,
    scale,
    N,
    K,
    cfg=None,
    act_group=128,
    fused=None,
    out_dtype=None,
    bm=None,
    bn=None,
    bk=None,
    swap=None,
    split_k=None,
    num_warps=None,
    num_stages=None,
    group_m=None,
    pdl=None,
    input_scale=None,
    scale_ub=None,
):
    """`x` `[M, K]` (16/32-bit) @ W.T -> `[M, N]` with `_w8a8_kernel`. `scale`: the weight's (`scale_layout`).
    `act_group`: 128 (per 1 x 128 group) or None (per token, channel layout only); `fused`: quantize x inside the
    kernel (per group) instead of by `act_quant_fp8` first; `input_scale` (a static per-tensor activation scale) and
    `scale_ub` (a bound on the per-token scales) imply per-token activations. `cfg`: a launch config
    (`configs/fp8_gemm/`); the keyword arguments override it."""
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (N, K) or not weight.is_contiguous():
        raise ValueError(
            f'weight must be contiguous float8_e4m3fn [{N}, {K}], got {weight.dtype} {tuple(weight.shape)}'
        )
    layout = scale_layout(scale, N, K)
    cfg = cfg or {}
    if input_scale is not None or scale_ub is not None:
        act_group, fused = None, False
    fused = cfg.get('fused', act_group is not None) if fused is None else fused
    if layout == 'block' and act_group is None:
        raise ValueError('block-scaled weights need activations quantized per 1 x 128 group (act_group=128)')
    if fused and act_group is None:
        raise ValueError('the fused activation quantization is per 1 x 128 group')
    M = x.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    group_a = act_group is not None
    bk = bk or (128 if group_a else cfg.get('bk', 128))
    if group_a and bk != 128:
        raise ValueError(f'per-group scales need BK = 128, got {bk}')
    swap = cfg.get('swap', False) if swap is None else swap
    steps = triton.cdiv(K, bk)
    bm, bn, tiles, split_k = _plan(M, N, steps, cfg, x.device, bm, bn, split_k, swap)
    if layout == 'block' and bn > 128 and bn % 128:
        raise ValueError(f'bn={bn}: above 128 it must be a multiple of 128')
    if layout == 'block' and bn < 128 and 128 % bn:
        raise ValueError(f'bn={bn} must divide 128')
    if fused:
        a, sa = (x if x.stride(-1) == 1 else x.contiguous()), x.new_empty(1, 1, dtype=torch.float32)
    else:
        a, sa = act_quant_fp8(x, act_group, scale=input_scale, scale_ub=scale_ub)
        if sa.ndim == 1:
            sa = sa[:, None]
    ws, cnt = split_k_workspace(x.device, M * N if split_k > 1 else 1, tiles if split_k > 1 else 1)
    num_warps = num_warps or cfg.get('num_warps', 4)
    num_stages = num_stages or cfg.get('num_stages', 3)
    _w8a8_kernel[(tiles, split_k)](
        a,
        sa,
        weight,
        scale,
        out,
        ws,
        cnt,
        M,
        N,
        K,
        triton.cdiv(K, 128),
        a.stride(0),
        out.stride(0),
        sa.stride(0),
        sa.stride(1),
        steps // split_k,
        BM=bm,
        BN=bn,
        BK=bk,
        BLOCK_W=layout == 'block',
        GROUP_A=group_a,
        AQ=fused,
        SWAP=swap,
        EVEN_K=K % bk == 0,
        SPLIT=split_k,
        GROUP_M=group_m or cfg.get('group_m', 8),
        EPS_=1e-10,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kw(x.device, pdl),
    )
    return out


def fp8_scaled_mm(x, weight, scale, N, K, out_dtype=None, input_scale=None, scale_ub=None):
    """The same product by `torch._scaled_mm` (GPU): channel layout with per-token activation scales (rowwise; from
    a static `input_scale` or bounded by `scale_ub` as in `act_quant_fp8`), block layout with 1 x 128 activation
    scales against the 128 x 128 weight blocks (`torch.nn.functional.scaled_mm`, where the build and the GPU have it;
    it raises otherwise)."""
    layout = scale_layout(scale, N, K)
    out_dtype = out_dtype or x.dtype
    if layout == 'channel':
        xq, sx = act_quant_fp8(x, None, scale=input_scale, scale_ub=scale_ub)
        return torch._scaled_mm(xq, weight.t(), scale_a=sx[:, None], scale_b=scale[None, :], out_dtype=out_dtype)
    if input_scale is not None or scale_ub is not None:
        raise ValueError('block-scaled weights take dynamic 1 x 128 activations')
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    xq, sx = act_quant_fp8(x, 128, scales_t=True)  # 1 x 128 scales read K-block-major
    return scaled_mm(
        xq,
        weight.t(),
        sx,
        ScalingType.BlockWise1x128,
        scale,
        ScalingType.BlockWise128x128,
        swizzle_a=SwizzleType.NO_SWIZZLE,
        swizzle_b=SwizzleType.NO_SWIZZLE,
        output_dtype=out_dtype,
    )


def fp8_gemm_ref(x, weight, scale, N, K, act_group=128, input_scale=None, scale_ub=None):
    """Reference: x quantized as the kernels quantize it (`act_quant_fp8_ref`; `input_scale` / `scale_ub`: per token,
    as in `fp8_gemm`), both operands dequantized in fp32, an fp32 matmul, cast to x's dtype."""
    from cvllm_lab.kernels.fp8_act_quant import act_quant_fp8_ref
    from cvllm_lab.kernels.fp8_layout import dequantize_fp8_block

    if input_scale is not None or scale_ub is not None:
        act_group = None
    xq, sx = act_quant_fp8_ref(x, act_group, input_scale, scale_ub)
    xd = xq.float() * (sx[:, None] if act_group is None else sx.repeat_interleave(128, 1)[:, :K])
    wd = (
        weight.float() * scale[:, None]
        if scale_layout(scale, N, K) == 'channel'
        else dequantize_fp8_block(weight, scale)
    )
    return (xd @ wd.T).to(x.dtype)
