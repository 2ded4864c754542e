"""Triton kernels for `y = x @ dequant(W).T` straight from GGUF block bytes, their launchers and their PyTorch
reference. The per-type dequantizing tiles the kernels call are in `gguf_tiles`.

`W` is a quantized weight as stored in a GGUF file: `qweight` `uint8 [N, bytes_per_row]`, each row a run of block
structs (see `gguf_layout`). No repacking: the kernels read those bytes through two views of the same
memory, the bytes themselves and a word view (`int32` when the struct size is a multiple of 4 bytes, else `int16`),
so the bulk quant fields come in as whole words (one load per 4-8 weights, 16-byte vector loads where the struct is
16-byte aligned, as q4_k's 144 bytes are) and the few scale bytes as single bytes.

Every kernel walks K in steps of 256 weights (one k-quant super-block, or `NB` legacy 32-blocks) and calls one
per-type *tile* function per pass (`gguf_tiles.dequant_tile`), which returns a dequantized fp32 tile `[BN, KP]` of
`BN` rows plus `kk` `[KP]`, the position within the step of each tile column. The columns are in whatever order
unpacks cheapest (a word's nibbles side by side); the kernels load `x` through `kk`, so the order never matters for
the product:

| kernel | used for | what it does |
|---|---|---|
| `_gemv_kernel` | M <= 4 (decode) | per `BN` rows: `acc[m] += sum(tile * x[m, kk])`, split over K (fp32 atomics) when N alone gives too few programs |
| `_mm_kernel` | 4 < M <= 64 | fused tile -> x dtype -> `tl.dot`, also split-K |
| `_dequant_kernel` + `torch.matmul` | M > 64 (prefill) | writes `W` in bf16/fp16 once, then cuBLAS; the dequantization is amortized over M |

Data flow: `gguf_matmul(x, qweight, qtype, N, K)` -> by M, `gguf_gemv` / `gguf_mm` / `gguf_dequantize` -> `_plan`
(the two views, the type's compile-time constants) -> the kernel -> `dequant_tile` per step and pass -> `y`.

All 10 block types are covered by all three kernels. They are correct but far from the memory roofline (a dense
bf16 GEMV is faster; `results/NOTES.md` has the measurements and where the time goes), so the four types that are
affine per 32 weights (q4_0, q4_1, q4_k, q8_0) are repacked into the W4A16 layout instead when a model is loaded on
a GPU (`GGUFLinear.pack`); these kernels serve the others.
"""

import math

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as GT, GGML_QUANT_SIZES

from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.gguf_layout import dequantize, parse_qtype
from cvllm_lab.kernels.gguf_tiles import dequant_tile
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)
from cvllm_lab.kernels.tuned import configs_for

__all__ = ['gguf_matmul', 'gguf_gemv', 'gguf_mm', 'gguf_dequantize', 'gguf_matmul_ref', 'KERNEL_TYPES']

# --------------------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=['M'])
def _gemv_kernel(
    x_ptr,
    wq,
    wb,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    wpr,
    bpr,
    SPLIT_K,
    QT: tl.constexpr,
    NB: tl.constexpr,
    NPASS: tl.constexpr,
    STEP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    "out[m, n] (+)= sum_k x[m, k] * W[n, k] for m < M <= BM <= 4; program (n-tile, k-split)."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # clamped rows load real memory; their results are not stored
    rw = rows_c * wpr
    rb = rows_c * bpr
    x1 = x_ptr + tl.minimum(1, M - 1) * stride_xm
    x2 = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x3 = x_ptr + tl.minimum(3, M - 1) * stride_xm
    acc0 = tl.zeros([BN], dtype=tl.float32)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    acc2 = tl.zeros([BN], dtype=tl.float32)
    acc3 = tl.zeros([BN], dtype=tl.float32)
    for sb in range(pid_k, K // STEP, SPLIT_K):
        for p in tl.static_range(NPASS):
            w, kk = dequant_tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
            xo = sb * STEP + kk
            acc0 += tl.sum(w * tl.load(x_ptr + xo).to(tl.float32)[None, :], axis=1)
            if BM > 1:
                acc1 += tl.sum(w * tl.load(x1 + xo).to(tl.float32)[None, :], axis=1)
            if BM > 2:
                acc2 += tl.sum(w * tl.load(x2 + xo).to(tl.float32)[None, :], axis=1)
                acc3 += tl.sum(w * tl.load(x3 + xo).to(tl.float32)[None, :], axis=1)
    nmask = rows < N
    if ATOMIC:
        tl.atomic_add(out_ptr + rows, acc0, mask=nmask)
        if BM > 1:
            tl.atomic_add(out_ptr + stride_om + rows, acc1, mask=nmask & (tl.full([BN], 1, tl.int32) < M))
        if BM > 2:
            tl.atomic_add(out_ptr + 2 * stride_om + rows, acc2, mask=nmask & (tl.full([BN], 2, tl.int32) < M))
            tl.atomic_add(out_ptr + 3 * stride_om + rows, acc3, mask=nmask & (tl.full([BN], 3, tl.int32) < M))
    else:
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows, acc0.to(ty), mask=nmask)
        if BM > 1:
            tl.store(out_ptr + stride_om + rows, acc1.to(ty), mask=nmask & (tl.full([BN], 1, tl.int32) < M))
        if BM > 2:
            tl.store(out_ptr + 2 * stride_om + rows, acc2.to(ty), mask=nmask & (tl.full([BN], 2, tl.int32) < M))
            tl.store(out_ptr + 3 * stride_om + rows, acc3.to(ty), mask=nmask & (tl.full([BN], 3, tl.int32) < M))


@triton.jit(do_not_specialize=['M'])
def _mm_kernel(
    x_ptr,
    wq,
    wb,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    wpr,
    bpr,
    SPLIT_K,
    QT: tl.constexpr,
    NB: tl.constexpr,
    NPASS: tl.constexpr,
    STEP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    ATOMIC: tl.constexpr,
    PREC: tl.constexpr,
):
    "out[BM, BN] tile (+)= x[BM, :] @ dequant(W[BN, :]).T with tl.dot on the x dtype; program (m-tile, n-tile, k-split)."
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rows = pid_n * BN + tl.arange(0, BN)
    xrow = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    rw = rows_c * wpr
    rb = rows_c * bpr
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for sb in range(pid_k, K // STEP, SPLIT_K):
        for p in tl.static_range(NPASS):
            w, kk = dequant_tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
            xt = tl.load(xrow + (sb * STEP + kk)[None, :])
            acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision=PREC)
    mask = (rm < M)[:, None] & (rows < N)[None, :]
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rows[None, :]
    if ATOMIC:
        tl.atomic_add(optr, acc, mask=mask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(
    wq,
    wb,
    out_ptr,
    N,
    K,
    wpr,
    bpr,
    QT: tl.constexpr,
    NB: tl.constexpr,
    NPASS: tl.constexpr,
    STEP: tl.constexpr,
    BN: tl.constexpr,
):
    "out[BN rows, one step of K] = dequant(W); program (n-tile, step)."
    pid_n = tl.program_id(0)
    sb = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    rw = rows_c * wpr
    rb = rows_c * bpr
    for p in tl.static_range(NPASS):
        w, kk = dequant_tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
        optr = out_ptr + rows_c[:, None] * K + (sb * STEP + kk)[None, :]
        tl.store(optr, w.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None])


# --------------------------------------------------------------------------------------------- launchers

# type -> (word bytes of the word view, passes per 256-weight step); legacy types have 1 pass of NB blocks
_KINFO = {
    GT.Q4_0: (2, 1),
    GT.Q4_1: (4, 1),
    GT.Q5_0: (2, 1),
    GT.Q5_1: (4, 1),
    GT.Q8_0: (2, 1),
    GT.Q2_K: (4, 4),
    GT.Q3_K: (2, 4),
    GT.Q4_K: (4, 2),
    GT.Q5_K: (4, 2),
    GT.Q6_K: (2, 2),
}
KERNEL_TYPES = tuple(_KINFO)


def _qtype(qtype):
    t = parse_qtype(qtype)
    if t not in _KINFO:
        raise ValueError(f'no Triton kernel for {t.name}')
    return t


def _plan(qweight, qtype, N, K):
    "Views and compile-time constants: (wq, wb, wpr, bpr, meta)."
    t = _qtype(qtype)
    qk, ts = GGML_QUANT_SIZES[t]
    word, npass = _KINFO[t]
    bpr = K // qk * ts
    if K % qk or tuple(qweight.shape) != (N, bpr) or qweight.dtype != torch.uint8:
        raise ValueError(
            f'{t.name} weight for N={N}, K={K} must be uint8 [{N}, {bpr}], got {qweight.dtype} {tuple(qweight.shape)}'
        )
    wb = qweight.contiguous()
    wq = wb.view(torch.int32 if word == 4 else torch.int16)
    if qk == 32:  # legacy: NB blocks per step, the largest power of 2 <= 8 that divides the block count
        nblk = K // 32
        nb = 8 if nblk % 8 == 0 else 4 if nblk % 4 == 0 else 2 if nblk % 2 == 0 else 1
    else:
        nb = 1
    step = 32 * nb if qk == 32 else 256
    return wq, wb, bpr // word, bpr, dict(QT=int(t), NB=nb, NPASS=npass, STEP=step)


def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 1


def _split_k(programs, steps, device, split_k):
    "K splits so that the grid has ~4 programs per SM (never less than 2 steps per split)."
    if split_k is not None:
        return max(1, min(split_k, steps))
    want = 4 * _num_sms(device)
    return max(1, min(math.ceil(want / max(programs, 1)), steps // 2 if steps >= 4 else 1, 16))


def gguf_gemv(x, qweight, qtype, N, K, out_dtype=None, bn=None, num_warps=4, split_k=None):
    "`x` `[M, K]` (M <= 4) @ dequant(qweight `[N, bpr]`).T -> `[M, N]`, fused GEMV."
    M = x.shape[0]
    assert 1 <= M <= 4 and x.shape[1] == K, x.shape
    x = x.contiguous()
    wq, wb, wpr, bpr, meta = _plan(qweight, qtype, N, K)
    T = configs_for('gguf_gemv', x.device)
    bn = bn or (8 if _INTERPRET else T['types'].get(_qtype(qtype).name, T['default'])['bn'])
    bm = 1 if M == 1 else 2 if M == 2 else 4
    tiles = triton.cdiv(N, bn)
    sk = _split_k(tiles, K // meta['STEP'], x.device, split_k)
    out_dtype = out_dtype or x.dtype
    out = (
        torch.zeros(M, N, dtype=torch.float32, device=x.device)
        if sk > 1
        else torch.empty(M, N, dtype=out_dtype, device=x.device)
    )
    _gemv_kernel[(tiles, sk)](
        x,
        wq,
        wb,
        out,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        wpr,
        bpr,
        sk,
        BM=bm,
        BN=bn,
        ATOMIC=sk > 1,
        num_warps=num_warps,
        **meta,
    )
    return out.to(out_dtype)


def gguf_mm(x, qweight, qtype, N, K, out_dtype=None, bm=None, bn=None, num_warps=None, split_k=None):
    "`x` `[M, K]` @ dequant(qweight).T -> `[M, N]`, fused dequantize + tl.dot (any M; meant for small M)."
    M = x.shape[0]
    assert x.shape[1] == K, x.shape
    x = x.contiguous()
    wq, wb, wpr, bpr, meta = _plan(qweight, qtype, N, K)
    bm = bm or 16  # 16 rows per program: 32 needs 8 warps and spills registers
    bn = bn or (16 if _INTERPRET else 32)
    num_warps = num_warps or 4
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sk = _split_k(tiles, K // meta['STEP'], x.device, split_k)
    out_dtype = out_dtype or x.dtype
    out = (
        torch.zeros(M, N, dtype=torch.float32, device=x.device)
        if sk > 1
        else torch.empty(M, N, dtype=out_dtype, device=x.device)
    )
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    _mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), sk)](
        x,
        wq,
        wb,
        out,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        wpr,
        bpr,
        sk,
        BM=bm,
        BN=bn,
        ATOMIC=sk > 1,
        PREC=prec,
        num_warps=num_warps,
        **meta,
    )
    return out.to(out_dtype)


def gguf_dequantize(qweight, qtype, N, K, dtype=torch.float16, bn=None, num_warps=8):
    "dequant(qweight `[N, bpr]`) -> `[N, K]` in `dtype`, with the same tile functions as the matmul kernels."
    wq, wb, wpr, bpr, meta = _plan(qweight, qtype, N, K)
    bn = bn or (8 if _INTERPRET else 32)
    out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    _dequant_kernel[(triton.cdiv(N, bn), K // meta['STEP'])](
        wq, wb, out, N, K, wpr, bpr, BN=bn, num_warps=num_warps, **meta
    )
    return out


GEMV_MAX_M, MM_MAX_M = 4, 64


def gguf_matmul(x, qweight, qtype, N, K):
    """`x` `[..., K]` @ dequant(qweight `uint8 [N, bytes_per_row]`).T -> `[..., N]` in x's dtype, picking a kernel by M
    (batch-invariant mode: `gguf_mm` unsplit at every M)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    if batch_invariant():  # one kernel, one tile, no split-K (its fp32 atomics add in arrival order) at every M
        y = gguf_mm(x2, qweight, qtype, N, K, split_k=1)
    elif M <= GEMV_MAX_M:
        y = gguf_gemv(x2, qweight, qtype, N, K)
    elif M <= MM_MAX_M:
        y = gguf_mm(x2, qweight, qtype, N, K)
    else:
        wdt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        y = (x2.to(wdt) @ gguf_dequantize(qweight, qtype, N, K, dtype=wdt).T).to(x.dtype)
    return y.reshape(*lead, N)


def gguf_matmul_ref(x, qweight, qtype, N, K):
    "Reference: dequantize with the PyTorch dequantizer, fp32 matmul, cast to x's dtype."
    w = dequantize(qweight, qtype, (N, K), dtype=torch.float32)
    return (x.float() @ w.T).to(x.dtype)
