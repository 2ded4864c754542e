"""`y = x @ W.T` with FP8 weights: the W8A16 kernels (bf16 activations), their PyTorch reference, and the
dispatcher `fp8_matmul` that picks between them and the W8A8 GEMM of `fp8_gemm` by the number of rows.

`W` is `weight` `float8_e4m3fn [N, K]` times a scale (`W = weight * scale`), either `weight_scale_inv`
`fp32 [ceil(N/128), ceil(K/128)]`, one per 128 x 128 block, as Qwen3-FP8 / DeepSeek-V3 checkpoints store it (the
name is the checkpoints'; the value multiplies), or one per output channel `fp32 [N]` (per-tensor and per-channel
checkpoints; `fp8_gemm.scale_layout`). The W8A16 kernels keep activations in bf16/fp16: FP8 is converted to fp32
in registers (`cvt` e4m3x2 -> f16x2 -> f32), so no activation quantization error is added.

| kernel | used for | what it does |
|---|---|---|
| `_fp8_gemv_kernel` | M = 1 (decode), both layouts | `[TPI, BN, 128]` weight tiles; all BN rows of a program share one 128-row block, so the block scale is applied to the 128 `x` values (not to the weights), or the channel scales to the row sums; fp32 register accumulator reduced once after the K loop |
| `_fp8_mm_kernel` | 1 < M, block layout, where the configs pick `w8a16` | per K-block: `tl.dot(x, W_block.T)` in the activation dtype, then `acc += dot * scale[n]` |
| `fp8_gemm._w8a8_kernel`, `torch._scaled_mm` | 1 < M (decode batches and prefill) | x quantized to FP8 on the fly, FP8 tensor cores, scales in the epilogue (`fp8_gemm`) |

Which one runs for a given (N, K, row bucket, layout) is tuned data: `configs/fp8_gemm/` (`backend`: `triton`,
`scaled_mm` or `w8a16`, plus the launch config; `dispatch.gemv_max_m`: the largest M the GEMV takes, row by row).
Split-K goes through the self-zeroing workspace of `cvllm_lab.kernels.split_k` (one launch per matmul). Launch
configurations are tuned data (`configs/fp8_gemv/`, `configs/fp8_mm/`, `configs/fp8_gemm/`, loaded by `tuned`).
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.fp8_gemm import fp8_gemm, fp8_scaled_mm, gemm_bucket, scale_layout
from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.fp8_layout import BLOCK, dequantize_fp8_block
from cvllm_lab.kernels.matmul_invariant import matmul_invariant
from cvllm_lab.kernels.split_k import batched_plan, m_bucket, split_for, split_k_workspace, store_out
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.tuned import configs_for

__all__ = ['fp8_matmul', 'fp8_gemv', 'fp8_mm', 'fp8_matmul_ref', 'fp8_dequantize', 'gemm_config']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)


@triton.jit
def _fp8_weights(wp, t, ru, rk, K, EVEN_K: tl.constexpr):
    "The `[TPI, BN, 128]` weight tiles of K-blocks t .. t + TPI - 1."
    if EVEN_K:
        return tl.load(wp + t * 128, eviction_policy='evict_first')
    kk = (t + ru[:, None]) * 128 + rk[None, :]
    return tl.load(wp + t * 128, mask=(kk < K)[:, None, :], other=0.0, eviction_policy='evict_first')


@triton.jit
def _fp8_iter(acc, w, xp, sp, t, ru, rk, K, EVEN_K: tl.constexpr, CHANNEL: tl.constexpr):
    "acc += w * (x * block scale) for K-blocks t .. t + TPI - 1 (CHANNEL: x unscaled, the scales come after the sum)."
    if EVEN_K:
        xv = tl.load(xp + t * 128, eviction_policy='evict_last')
    else:
        xv = tl.load(
            xp + t * 128, mask=((t + ru[:, None]) * 128 + rk[None, :]) < K, other=0.0, eviction_policy='evict_last'
        )
    if CHANNEL:
        xs = xv.to(tl.float32)
    else:
        xs = xv.to(tl.float32) * tl.load(sp + t)[:, None]
    return acc + w.to(tl.float32) * xs[:, None, :]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    TPS,
    KB,
    BN: tl.constexpr,
    TPI: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    CHANNEL: tl.constexpr,
):
    """out[n] = sum_k x[k] W[n, k]; program axis 0: BN rows (inside one 128-row block), axis 1: TPS K-blocks.
    CHANNEL: `s_ptr` holds one scale per row of W (`[N]`), applied to the row's sum."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    ru = tl.arange(0, TPI)
    rk = tl.arange(0, 128)
    nmask = rn < N
    rn_c = tl.minimum(rn, N - 1)
    wp = w_ptr + rn_c.to(tl.int64)[None, :, None] * K + (ru[:, None, None] * 128 + rk[None, None, :])  # [TPI, BN, 128]
    xp = x_ptr + ru[:, None] * 128 + rk[None, :]  # [TPI, 128]
    sp = s_ptr + (pid_n * BN // 128) * KB + ru  # [TPI]
    acc = tl.zeros([TPI, BN, 128], dtype=tl.float32)
    t0 = pid_k * TPS
    ts = t0
    if PDL:  # the first iteration's weights before waiting for the previous kernel
        w = _fp8_weights(wp, t0, ru, rk, K, EVEN_K)
    pdl_wait(PDL)
    pdl_launch(PDL)
    if PDL:
        acc = _fp8_iter(acc, w, xp, sp, t0, ru, rk, K, EVEN_K, CHANNEL)
        ts = t0 + TPI
    for t in range(ts, t0 + TPS, TPI):
        acc = _fp8_iter(acc, _fp8_weights(wp, t, ru, rk, K, EVEN_K), xp, sp, t, ru, rk, K, EVEN_K, CHANNEL)
    y = tl.sum(tl.sum(acc, 2), 0)
    if CHANNEL:
        y = y * tl.load(s_ptr + rn_c)
    store_out(y, out_ptr + rn, nmask, ws_ptr + rn, cnt_ptr + pid_n, SPLIT)


@triton.jit(do_not_specialize=['M'])
def _fp8_mm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    TPS,
    KB,
    BM: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):
    "out[BM, BN] = sum over the program's K-blocks of (x_blk @ W_blk.T) * scale[n-block, k-block]; axes N, K-split, M."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    rn_c = tl.minimum(rn, N - 1)
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    wp = w_ptr + rn_c.to(tl.int64)[None, :] * K + rk[:, None]  # [128, BN] = W_blk.T
    sp = s_ptr + (rn_c // 128) * KB  # [BN]
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
    store_out(
        acc, optr, mask, ws_ptr + rm[:, None] * N + rn[None, :], cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT
    )


def _check(weight, scale, N, K):
    "Validate the FP8 weight; returns `(layout, number of 128-wide K-blocks)`."
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (N, K) or not weight.is_contiguous():
        raise ValueError(
            f'weight must be contiguous float8_e4m3fn [{N}, {K}], got {weight.dtype} {tuple(weight.shape)}'
        )
    if scale.dtype != torch.float32:
        raise ValueError(f'the weight scale must be float32, got {scale.dtype}')
    return scale_layout(scale, N, K), -(-K // BLOCK)


def fp8_gemv(
    x, weight, scale, N, K, out_dtype=None, bn=None, tpi=None, num_warps=None, split_k=None, num_stages=None, pdl=None
):
    """`x` `[1, K]` @ W.T -> `[1, N]` with the FP8 GEMV kernel (`split_k` programs per row block meet in the
    workspace; `pdl`: programmatic dependent launch, default `pdl_on`)."""
    assert x.shape == (1, K), x.shape
    layout, kb = _check(weight, scale, N, K)
    x = x.contiguous()
    T = configs_for('fp8_gemv', x.device)
    cfg = T['shapes'].get((N, K), T['default'])
    default = bn is None and tpi is None
    bn = bn or (8 if _INTERPRET else cfg['bn'])
    assert BLOCK % bn == 0, bn
    tpi = tpi or (1 if _INTERPRET else cfg['tpi'])
    while kb % tpi:
        tpi //= 2
    num_warps = num_warps or cfg['num_warps']
    num_stages = num_stages or cfg['num_stages']
    progs = triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else T['default'], kb, progs, tpi, x.device)
    elif kb % split_k or (kb // split_k) % tpi:
        raise ValueError(f'split_k={split_k} must divide the {kb} K-blocks into multiples of tpi={tpi}')
    out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, N, progs)
    _fp8_gemv_kernel[(progs, split_k)](
        x,
        weight,
        scale,
        out,
        ws,
        cnt,
        N,
        K,
        kb // split_k,
        kb,
        BN=bn,
        TPI=tpi,
        EVEN_K=K % BLOCK == 0,
        EVEN_N=N % bn == 0,
        SPLIT=split_k,
        CHANNEL=layout == 'channel',
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kw(x.device, pdl),
    )
    return out


def fp8_mm(
    x, weight, scale, N, K, out_dtype=None, bm=None, bn=None, num_warps=None, split_k=None, num_stages=None, target=None
):
    """`x` `[M, K]` @ W.T -> `[M, N]` (block layout): per 128-block `tl.dot` in the activation dtype, scaled into an
    fp32 accumulator."""
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    layout, kb = _check(weight, scale, N, K)
    if layout != 'block':
        raise ValueError('fp8_mm takes 128 x 128 block scales')
    x = x.contiguous()
    b = m_bucket(M)
    T = configs_for('fp8_mm', x.device)
    cfg = T['shapes'].get((N, K, b), T['default'][b])
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(
        x, N, kb, cfg, bm, bn, num_warps, num_stages, split_k, target, out_dtype, 'K-blocks'
    )
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    _fp8_mm_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x,
        weight,
        scale,
        out,
        ws,
        cnt,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        kb // split_k,
        kb,
        BM=bm,
        BN=bn,
        EVEN_K=K % BLOCK == 0,
        SPLIT=split_k,
        PREC=prec,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def gemm_config(N, K, M, layout, device) -> dict:
    """The config `fp8_matmul` runs for M > `gemv_max_m` rows: `configs/fp8_gemm` table `<layout>_shapes` at
    (N, K, row bucket), else the layout's default for the bucket. Its `backend` names the kernel."""
    T = configs_for('fp8_gemm', device)
    b = gemm_bucket(M)
    return T[f'{layout}_shapes'].get((N, K, b)) or T['default' if layout == 'block' else 'channel'][b]


def fp8_matmul(x, weight, scale, N, K, backend=None, input_scale=None, scale_ub=None):
    """`x` `[..., K]` @ W.T -> `[..., N]` in x's dtype. Up to `gemv_max_m` rows (1 by default) the W8A16 GEMV, row
    by row; above, the tuned backend for (N, K, row bucket): `triton` (the W8A8 `fp8_gemm`), `scaled_mm`
    (`torch._scaled_mm`), `w8a16` (`fp8_mm`, block layout, up to 128 rows). `backend` overrides the table.
    A checkpoint's activation scheme (channel layout): `input_scale`, a static per-tensor activation scale, or
    `scale_ub`, a bound on the per-token scales; either makes the W8A8 backends quantize x per token with it (the
    GEMV rows keep x in 16 bits, as always). Batch-invariant mode (`batch_invariant`): `fp8_mm` (block layout) or
    the weight dequantized into `matmul_invariant` (channel layout) at every M."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    layout, _ = _check(weight, scale, N, K)
    if batch_invariant() and backend is None:  # one kernel and one config at every M (no per-token activation scales)
        if layout == 'block':
            return fp8_mm(x2, weight, scale, N, K).reshape(*lead, N)
        return matmul_invariant(x2, fp8_dequantize(weight, scale, x2.dtype)).reshape(*lead, N)
    if M <= configs_for('fp8_gemm', x.device)['dispatch'].get('gemv_max_m', 1) and backend is None:
        y = (
            torch.cat([fp8_gemv(r, weight, scale, N, K) for r in x2.split(1)])
            if M > 1
            else fp8_gemv(x2, weight, scale, N, K)
        )
        return y.reshape(*lead, N)
    cfg = gemm_config(N, K, M, layout, x.device)
    backend = backend or cfg.get('backend', 'triton')
    if x2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        x2 = x2.float()
    act = dict(input_scale=input_scale, scale_ub=scale_ub)
    if backend == 'scaled_mm' and x.is_cuda:
        y = fp8_scaled_mm(x2, weight, scale, N, K, **act)
    elif backend == 'w8a16' and layout == 'block' and M <= MM_MAX_M:
        y = fp8_mm(x2, weight, scale, N, K)
    else:
        y = fp8_gemm(x2, weight, scale, N, K, cfg=cfg, act_group=cfg.get('act_group', 128), **act)
    return y.to(x.dtype).reshape(*lead, N)


MM_MAX_M = 128


def fp8_dequantize(weight, scale, dtype=torch.float32):
    "The weight `[N, K]` in `dtype` for either scale layout (fp32 arithmetic)."
    N, K = weight.shape
    if scale_layout(scale, N, K) == 'channel':
        return (weight.float() * scale[:, None]).to(dtype)
    return dequantize_fp8_block(weight, scale, dtype)


def fp8_matmul_ref(x, weight, scale, N, K):
    "Reference of the W8A16 kernels: dequantize in fp32, fp32 matmul, cast to x's dtype."
    return (x.float() @ fp8_dequantize(weight, scale).T).to(x.dtype)
