"""Triton kernels for `y = x @ W.T` with block-wise FP8 weights, and their PyTorch reference.

`W` is stored as Qwen3-FP8 / DeepSeek-V3 checkpoints store it: `weight` `float8_e4m3fn [N, K]` and
`weight_scale_inv` `fp32 [ceil(N/128), ceil(K/128)]`, one scale per 128 x 128 block, `W = weight * scale`
(the name is the checkpoints'; the value multiplies). Activations stay in bf16/fp16 (W8A16): the kernels convert
FP8 to fp32 in registers (`cvt` e4m3x2 -> f16x2 -> f32), so no activation quantization error is added.

| kernel | used for | what it does |
|---|---|---|
| `_fp8_gemv_kernel` | M = 1 (decode) | `[TPI, BN, 128]` weight tiles; all BN rows of a program share one 128-row block, so the block scale is applied to the 128 `x` values (not to the weights); fp32 register accumulator reduced once after the K loop |
| `_fp8_mm_kernel` | 1 < M <= `MM_MAX_M` | per K-block: `tl.dot(x, W_block.T)` in the activation dtype, then `acc += dot * scale[n]` |
| dequantize + cuBLAS | prefill | `W` in bf16 once, then `torch.matmul` |

Split-K goes through the self-zeroing workspace of `cvllm_lab.kernels.split_k` (one launch per matmul). Launch
configurations are tuned data (`configs/fp8_gemv/`, `configs/fp8_mm/`, loaded by `tuned`).
"""
import os

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.fp8_layout import BLOCK, dequantize_fp8_block
from cvllm_lab.kernels.split_k import batched_plan, m_bucket, split_for, split_k_workspace, store_out
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.tuned import configs_for

__all__ = ['fp8_matmul', 'fp8_gemv', 'fp8_mm', 'fp8_matmul_ref']
_INTERPRET = os.environ.get('TRITON_INTERPRET', '0') == '1'


@triton.jit
def _fp8_weights(wp, t, ru, rk, K, EVEN_K: tl.constexpr):
    "The `[TPI, BN, 128]` weight tiles of K-blocks t .. t + TPI - 1."
    if EVEN_K:
        return tl.load(wp + t * 128, eviction_policy='evict_first')
    kk = (t + ru[:, None]) * 128 + rk[None, :]
    return tl.load(wp + t * 128, mask=(kk < K)[:, None, :], other=0.0, eviction_policy='evict_first')


@triton.jit
def _fp8_iter(acc, w, xp, sp, t, ru, rk, K, EVEN_K: tl.constexpr):
    "acc += w * (x * block scale) for K-blocks t .. t + TPI - 1."
    if EVEN_K:
        xv = tl.load(xp + t * 128, eviction_policy='evict_last')
    else:
        xv = tl.load(xp + t * 128, mask=((t + ru[:, None]) * 128 + rk[None, :]) < K, other=0.0, eviction_policy='evict_last')
    xs = xv.to(tl.float32) * tl.load(sp + t)[:, None]
    return acc + w.to(tl.float32) * xs[:, None, :]


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, TPS, KB,
                     BN: tl.constexpr, TPI: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
    "out[n] = sum_k x[k] W[n, k]; program axis 0: BN rows (inside one 128-row block), axis 1: TPS K-blocks."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    ru = tl.arange(0, TPI)
    rk = tl.arange(0, 128)
    nmask = rn < N
    rn_c = tl.minimum(rn, N - 1)
    wp = w_ptr + rn_c.to(tl.int64)[None, :, None] * K + (ru[:, None, None] * 128 + rk[None, None, :])  # [TPI, BN, 128]
    xp = x_ptr + ru[:, None] * 128 + rk[None, :]                                                      # [TPI, 128]
    sp = s_ptr + (pid_n * BN // 128) * KB + ru                                                        # [TPI]
    acc = tl.zeros([TPI, BN, 128], dtype=tl.float32)
    t0 = pid_k * TPS
    ts = t0
    if PDL:   # the first iteration's weights before waiting for the previous kernel
        w = _fp8_weights(wp, t0, ru, rk, K, EVEN_K)
    pdl_wait(PDL)
    pdl_launch(PDL)
    if PDL:
        acc = _fp8_iter(acc, w, xp, sp, t0, ru, rk, K, EVEN_K)
        ts = t0 + TPI
    for t in range(ts, t0 + TPS, TPI):
        acc = _fp8_iter(acc, _fp8_weights(wp, t, ru, rk, K, EVEN_K), xp, sp, t, ru, rk, K, EVEN_K)
    y = tl.sum(tl.sum(acc, 2), 0)
    store_out(y, out_ptr + rn, nmask, ws_ptr + rn, cnt_ptr + pid_n, SPLIT)


@triton.jit
def _fp8_mm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om, TPS, KB,
                   BM: tl.constexpr, BN: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                   PREC: tl.constexpr):
    "out[BM, BN] = sum over the program's K-blocks of (x_blk @ W_blk.T) * scale[n-block, k-block]; axes N, K-split, M."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    rn_c = tl.minimum(rn, N - 1)
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    wp = w_ptr + rn_c.to(tl.int64)[None, :] * K + rk[:, None]          # [128, BN] = W_blk.T
    sp = s_ptr + (rn_c // 128) * KB                                      # [BN]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS):
        if EVEN_K:
            xt = tl.load(xp + t * 128, mask=(rm < M)[:, None], other=0.0)
            w = tl.load(wp + t * 128, eviction_policy='evict_first')
        else:
            km = (t * 128 + rk) < K
            xt = tl.load(xp + t * 128, mask=(rm < M)[:, None] & km[None, :], other=0.0)
            w = tl.load(wp + t * 128, mask=km[:, None], other=0.0, eviction_policy='evict_first')
        d = tl.dot(xt, w.to(xt.dtype), input_precision=PREC)
        acc += d * tl.load(sp + t)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    store_out(acc, optr, mask, ws_ptr + rm[:, None] * N + rn[None, :], cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT)


def _check(weight, scale, N, K):
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (N, K) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous float8_e4m3fn [{N}, {K}], got {weight.dtype} {tuple(weight.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (nb, kb):
        raise ValueError(f"weight_scale_inv must be float32 [{nb}, {kb}], got {scale.dtype} {tuple(scale.shape)}")
    return nb, kb


def fp8_gemv(x, weight, scale, N, K, out_dtype=None, bn=None, tpi=None, num_warps=None, split_k=None, num_stages=None,
             pdl=None):
    """`x` `[1, K]` @ W.T -> `[1, N]` with the FP8 GEMV kernel (`split_k` programs per row block meet in the
    workspace; `pdl`: programmatic dependent launch, default `pdl_on`)."""
    assert x.shape == (1, K), x.shape
    _, kb = _check(weight, scale, N, K)
    x = x.contiguous()
    T = configs_for('fp8_gemv', x.device)
    cfg = T['shapes'].get((N, K), T['default'])
    default = bn is None and tpi is None
    bn = bn or (8 if _INTERPRET else cfg['bn'])
    assert BLOCK % bn == 0, bn
    tpi = tpi or (1 if _INTERPRET else cfg['tpi'])
    while kb % tpi: tpi //= 2
    num_warps = num_warps or cfg['num_warps']
    num_stages = num_stages or cfg['num_stages']
    progs = triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else T['default'], kb, progs, tpi, x.device)
    elif kb % split_k or (kb // split_k) % tpi:
        raise ValueError(f"split_k={split_k} must divide the {kb} K-blocks into multiples of tpi={tpi}")
    out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, N, progs)
    _fp8_gemv_kernel[(progs, split_k)](x, weight, scale, out, ws, cnt, N, K, kb // split_k, kb, BN=bn, TPI=tpi,
                                       EVEN_K=K % BLOCK == 0, EVEN_N=N % bn == 0, SPLIT=split_k,
                                       num_warps=num_warps, num_stages=num_stages, **pdl_kw(x.device, pdl))
    return out


def fp8_mm(x, weight, scale, N, K, out_dtype=None, bm=None, bn=None, num_warps=None, split_k=None, num_stages=None,
           target=None):
    "`x` `[M, K]` @ W.T -> `[M, N]`: per 128-block `tl.dot` in the activation dtype, scaled into an fp32 accumulator."
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    _, kb = _check(weight, scale, N, K)
    x = x.contiguous()
    b = m_bucket(M)
    T = configs_for('fp8_mm', x.device)
    cfg = T['shapes'].get((N, K, b), T['default'][b])
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(x, N, kb, cfg, bm, bn, num_warps, num_stages,
                                                                         split_k, target, out_dtype, 'K-blocks')
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    _fp8_mm_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x, weight, scale, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), kb // split_k, kb,
        BM=bm, BN=bn, EVEN_K=K % BLOCK == 0, SPLIT=split_k, PREC=prec, num_warps=num_warps, num_stages=num_stages)
    return out


MM_MAX_M = 128


def fp8_matmul(x, weight, scale, N, K):
    "`x` `[..., K]` @ W.T -> `[..., N]` in x's dtype, picking the kernel by M."
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0: return x.new_empty(*lead, N)
    if M == 1: y = fp8_gemv(x2, weight, scale, N, K)
    elif M <= MM_MAX_M: y = fp8_mm(x2, weight, scale, N, K)
    else:
        wdt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        y = (x2.to(wdt) @ dequantize_fp8_block(weight, scale, wdt).T).to(x.dtype)
    return y.reshape(*lead, N)


def fp8_matmul_ref(x, weight, scale, N, K):
    "Reference: dequantize in fp32, fp32 matmul, cast to x's dtype."
    return (x.float() @ dequantize_fp8_block(weight, scale).T).to(x.dtype)
