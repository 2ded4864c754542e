"""Triton kernels for `y = x @ dequant(W).T` straight from GGUF block bytes, and their PyTorch reference.

`W` is a quantized weight as stored in a GGUF file: `qweight` `uint8 [N, bytes_per_row]`, each row a run of block
structs (see `gguf_layout`). No repacking: the kernels read those bytes through two views of the same
memory, the bytes themselves and a word view (`int32` when the struct size is a multiple of 4 bytes, else `int16`),
so the bulk quant fields come in as whole words (one load per 4-8 weights, 16-byte vector loads where the struct is
16-byte aligned, as q4_k's 144 bytes are) and the few scale bytes as single bytes.

Every kernel walks K in steps of 256 weights (one k-quant super-block, or `NB` legacy 32-blocks) and calls one
per-type *tile* function per pass, which returns a dequantized fp32 tile `[BN, KP]` of `BN` rows plus `kk` `[KP]`,
the position within the step of each tile column. The columns are in whatever order unpacks cheapest
(a word's nibbles side by side); the kernels load `x` through `kk`, so the order never matters for the product:

| kernel | used for | what it does |
|---|---|---|
| `_gemv_kernel` | M <= 4 (decode) | per `BN` rows: `acc[m] += sum(tile * x[m, kk])`, split over K (fp32 atomics) when N alone gives too few programs |
| `_mm_kernel` | 4 < M <= 64 | fused tile -> x dtype -> `tl.dot`, also split-K |
| `_dequant_kernel` + `torch.matmul` | M > 64 (prefill) | writes `W` in bf16/fp16 once, then cuBLAS; the dequantization is amortized over M |

Tiles per step (KP x passes): q4_0/q4_1/q5_0/q5_1/q8_0: `32*NB` x 1; q4_k/q5_k: 128 x 2 (low, high nibbles);
q6_k: 128 x 2; q2_k/q3_k: 64 x 4 (bit pairs). Scales are loaded per sub-block (`[BN, G]`) and broadcast over the
sub-block's columns, and ints become floats through the exponent trick `bits(q | 0x4B000000) - 2**23`.
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

from cvllm_lab.kernels.gguf_layout import dequantize, parse_qtype
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)
from cvllm_lab.kernels.tuned import configs_for

__all__ = ['gguf_matmul', 'gguf_gemv', 'gguf_mm', 'gguf_dequantize', 'gguf_matmul_ref', 'KERNEL_TYPES']

# --------------------------------------------------------------------------------------------- helpers


@triton.jit
def _u2f(q):
    "int32 in [0, 2**23) -> the same value as fp32 (2 ALU ops, no int->float conversion)."
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _h2f(v):
    "fp16 bits in the low 16 bits of int32 `v` -> fp32."
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _unpack(words, sh, MASK: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, R: tl.constexpr):
    "`[BN, W]` int32 words, per-column shifts `[W, R]` -> `[BN, W*R]` fields `(word >> sh) & MASK`."
    v = (words[:, :, None] >> sh[None, :, :]) & MASK
    return tl.reshape(v, (BN, W * R))


@triton.jit
def _rep(v, BN: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    "`[BN, G]` -> `[BN, G*R]`, each column repeated R times."
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, G, R)), (BN, G * R))


@triton.jit
def _flat(k, W: tl.constexpr, R: tl.constexpr):
    return tl.reshape(k, (W * R,))


@triton.jit
def _ld16(wq, off):
    "Unsigned 16-bit word (int16 view) -> int32."
    return tl.load(wq + off).to(tl.int32) & 0xFFFF


# --------------------------------------------------------------------------------------------- tiles
# Each returns (w fp32 [BN, KP], kk int32 [KP]) for step `sb` (256 weights, or 32*NB for the legacy types) of the rows
# whose first word / byte are at `rw` / `rb` ([BN] int64).


@triton.jit
def _t_q4_0(wq, rw, sb, BN: tl.constexpr, NB: tl.constexpr):
    # int16 view, 9 halfwords per block: d, then qs bytes (2i, 2i+1) in halfword 1+i
    W: tl.constexpr = NB * 8
    c = tl.arange(0, W)
    r = tl.arange(0, 4)
    blk = sb * NB + c // 8
    words = tl.load(wq + rw[:, None] + (blk * 9 + 1 + c % 8)[None, :]).to(tl.int32)
    q = _unpack(words, (4 * r)[None, :] + 0 * c[:, None], 15, BN, W, 4)  # r = 2*byte + nibble
    kk = _flat((c // 8 * 32 + c % 8 * 2)[:, None] + (r // 2 + 16 * (r % 2))[None, :], W, 4)
    db = tl.arange(0, NB)
    d = tl.load(wq + rw[:, None] + ((sb * NB + db) * 9)[None, :]).to(tl.float16, bitcast=True).to(tl.float32)
    return (_u2f(q) - 8.0) * _rep(d, BN, NB, 32), kk


@triton.jit
def _t_q4_1(wq, rw, sb, BN: tl.constexpr, NB: tl.constexpr):
    # int32 view, 5 words per block: d | m << 16, then qs bytes 4i..4i+3 in word 1+i
    W: tl.constexpr = NB * 4
    c = tl.arange(0, W)
    r = tl.arange(0, 8)
    blk = sb * NB + c // 4
    words = tl.load(wq + rw[:, None] + (blk * 5 + 1 + c % 4)[None, :])
    q = _unpack(words, (4 * r)[None, :] + 0 * c[:, None], 15, BN, W, 8)
    kk = _flat((c // 4 * 32 + c % 4 * 4)[:, None] + (r // 2 + 16 * (r % 2))[None, :], W, 8)
    db = tl.arange(0, NB)
    dm = tl.load(wq + rw[:, None] + ((sb * NB + db) * 5)[None, :])
    return _u2f(q) * _rep(_h2f(dm), BN, NB, 32) + _rep(_h2f(dm >> 16), BN, NB, 32), kk


@triton.jit
def _t_q5_0(wq, rw, sb, BN: tl.constexpr, NB: tl.constexpr):
    # int16 view, 11 halfwords per block: d, qh (2 halfwords), qs (8 halfwords)
    W: tl.constexpr = NB * 8
    c = tl.arange(0, W)
    r = tl.arange(0, 4)
    blk = sb * NB + c // 8
    words = tl.load(wq + rw[:, None] + (blk * 11 + 3 + c % 8)[None, :]).to(tl.int32)
    lo = _unpack(words, (4 * r)[None, :] + 0 * c[:, None], 15, BN, W, 4)
    e = _flat((c % 8 * 2)[:, None] + (r // 2 + 16 * (r % 2))[None, :], W, 4)  # element within its block
    kk = _flat((c // 8 * 32)[:, None] + 0 * r[None, :], W, 4) + e
    db = tl.arange(0, NB)
    bo = rw[:, None] + ((sb * NB + db) * 11)[None, :]
    d = tl.load(wq + bo).to(tl.float16, bitcast=True).to(tl.float32)
    qh = _rep(_ld16(wq, bo + 1) | (_ld16(wq, bo + 2) << 16), BN, NB, 32)
    q = lo | (((qh >> e[None, :]) & 1) << 4)
    return (_u2f(q) - 16.0) * _rep(d, BN, NB, 32), kk


@triton.jit
def _t_q5_1(wq, rw, sb, BN: tl.constexpr, NB: tl.constexpr):
    # int32 view, 6 words per block: d | m << 16, qh, qs (4 words)
    W: tl.constexpr = NB * 4
    c = tl.arange(0, W)
    r = tl.arange(0, 8)
    blk = sb * NB + c // 4
    words = tl.load(wq + rw[:, None] + (blk * 6 + 2 + c % 4)[None, :])
    lo = _unpack(words, (4 * r)[None, :] + 0 * c[:, None], 15, BN, W, 8)
    e = _flat((c % 4 * 4)[:, None] + (r // 2 + 16 * (r % 2))[None, :], W, 8)
    kk = _flat((c // 4 * 32)[:, None] + 0 * r[None, :], W, 8) + e
    db = tl.arange(0, NB)
    bo = rw[:, None] + ((sb * NB + db) * 6)[None, :]
    dm = tl.load(wq + bo)
    qh = _rep(tl.load(wq + bo + 1), BN, NB, 32)
    q = lo | (((qh >> e[None, :]) & 1) << 4)
    return _u2f(q) * _rep(_h2f(dm), BN, NB, 32) + _rep(_h2f(dm >> 16), BN, NB, 32), kk


@triton.jit
def _t_q8_0(wq, rw, sb, BN: tl.constexpr, NB: tl.constexpr):
    # int16 view, 17 halfwords per block: d, then int8 pairs
    W: tl.constexpr = NB * 16
    c = tl.arange(0, W)
    r = tl.arange(0, 2)
    blk = sb * NB + c // 16
    words = tl.load(wq + rw[:, None] + (blk * 17 + 1 + c % 16)[None, :]).to(tl.int32)
    q = _unpack(words, (8 * r)[None, :] + 0 * c[:, None], 255, BN, W, 2) ^ 0x80  # int8 + 128
    kk = _flat((c // 16 * 32 + c % 16 * 2)[:, None] + r[None, :], W, 2)
    db = tl.arange(0, NB)
    d = tl.load(wq + rw[:, None] + ((sb * NB + db) * 17)[None, :]).to(tl.float16, bitcast=True).to(tl.float32)
    return (_u2f(q) - 128.0) * _rep(d, BN, NB, 32), kk


@triton.jit
def _t_q2_k(wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr):
    # int32 view, 21 words: scales (bytes 0-15), qs (words 4-19), d | dmin << 16 (word 20). Pass P = bit pair.
    i = tl.arange(0, 16)
    b = tl.arange(0, 4)
    words = tl.load(wq + rw[:, None] + (sb * 21 + 4 + i)[None, :])
    q = _unpack(words, (8 * b + 2 * P)[None, :] + 0 * i[:, None], 3, BN, 16, 4)
    kk = _flat((i // 8 * 128 + P * 32 + i % 8 * 4)[:, None] + b[None, :], 16, 4)
    u = tl.arange(0, 4)  # groups of 16 weights = 4 words
    sc = tl.load(wb + rb[:, None] + (sb * 84 + u // 2 * 8 + 2 * P + u % 2)[None, :]).to(tl.int32)
    dd = tl.load(wq + rw + sb * 21 + 20)
    a = _h2f(dd)[:, None] * (sc & 15).to(tl.float32)
    m = _h2f(dd >> 16)[:, None] * (sc >> 4).to(tl.float32)
    return _rep(a, BN, 4, 16) * _u2f(q) - _rep(m, BN, 4, 16), kk


@triton.jit
def _t_q3_k(wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr):
    # int16 view, 55 halfwords: hmask (0-15), qs (16-47), scales (bytes 96-107), d (54). Pass P = bit pair.
    v = tl.arange(0, 32)
    b = tl.arange(0, 2)
    base = rw[:, None] + sb * 55
    lo = _unpack(_ld16(wq, base + (16 + v)[None, :]), (8 * b + 2 * P)[None, :] + 0 * v[:, None], 3, BN, 32, 2)
    hb = _unpack(_ld16(wq, base + (v % 16)[None, :]), (8 * b)[None, :] + (4 * (v // 16) + P)[:, None], 1, BN, 32, 2)
    kk = _flat((v // 16 * 128 + 32 * P + v % 16 * 2)[:, None] + b[None, :], 32, 2)
    u = tl.arange(0, 4)  # groups of 16 weights = 8 halfwords
    g = u // 2 * 8 + 2 * P + u % 2
    sbase = rb[:, None] + sb * 110 + 96
    low = tl.load(wb + sbase + (g % 8)[None, :]).to(tl.int32) >> (4 * (g // 8))[None, :]
    high = tl.load(wb + sbase + (8 + g % 4)[None, :]).to(tl.int32) >> (2 * (g // 4))[None, :]
    sc = ((low & 15) | ((high & 3) << 4)).to(tl.float32) - 32.0
    d = tl.load(wq + rw + sb * 55 + 54).to(tl.float16, bitcast=True).to(tl.float32)
    return _rep(d[:, None] * sc, BN, 4, 16) * (_u2f(lo | (hb << 2)) - 4.0), kk


@triton.jit
def _q4k_scale_min(wb, sbase, j):
    "6-bit scale and min of sub-blocks `j` ([G] in 0..7) from the 12 scale bytes at `sbase` ([BN, 1])."
    p = tl.load(wb + sbase + j[None, :]).to(tl.int32)
    q = tl.load(wb + sbase + (j + 4)[None, :]).to(tl.int32)
    r = tl.load(wb + sbase + tl.where(j >= 4, j - 4, j)[None, :]).to(tl.int32)
    first = (j < 4)[None, :]
    sc = tl.where(first, p & 63, (q & 15) | ((r >> 6) << 4))
    mn = tl.where(first, q & 63, (q >> 4) | ((p >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _t_q4_k(wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr):
    # int32 view, 36 words: d | dmin << 16, scales (bytes 4-15), qs (words 4-35). Pass P = nibble.
    i = tl.arange(0, 32)
    b = tl.arange(0, 4)
    words = tl.load(wq + rw[:, None] + (sb * 36 + 4 + i)[None, :])
    q = _unpack(words, (8 * b + 4 * P)[None, :] + 0 * i[:, None], 15, BN, 32, 4)
    kk = _flat((i // 8 * 64 + P * 32 + i % 8 * 4)[:, None] + b[None, :], 32, 4)
    sc, mn = _q4k_scale_min(wb, rb[:, None] + sb * 144 + 4, 2 * tl.arange(0, 4) + P)
    dd = tl.load(wq + rw + sb * 36)
    a = _h2f(dd)[:, None] * sc
    m = _h2f(dd >> 16)[:, None] * mn
    return _rep(a, BN, 4, 32) * _u2f(q) - _rep(m, BN, 4, 32), kk


@triton.jit
def _t_q5_k(wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr):
    # int32 view, 44 words: d | dmin << 16, scales (bytes 4-15), qh (words 4-11), qs (words 12-43). Pass P = nibble.
    i = tl.arange(0, 32)
    b = tl.arange(0, 4)
    base = rw[:, None] + sb * 44
    lo = _unpack(tl.load(wq + base + (12 + i)[None, :]), (8 * b + 4 * P)[None, :] + 0 * i[:, None], 15, BN, 32, 4)
    hb = _unpack(
        tl.load(wq + base + (4 + i % 8)[None, :]), (8 * b)[None, :] + (2 * (i // 8) + P)[:, None], 1, BN, 32, 4
    )
    kk = _flat((i // 8 * 64 + P * 32 + i % 8 * 4)[:, None] + b[None, :], 32, 4)
    sc, mn = _q4k_scale_min(wb, rb[:, None] + sb * 176 + 4, 2 * tl.arange(0, 4) + P)
    dd = tl.load(wq + rw + sb * 44)
    a = _h2f(dd)[:, None] * sc
    m = _h2f(dd >> 16)[:, None] * mn
    return _rep(a, BN, 4, 32) * _u2f(lo | (hb << 4)) - _rep(m, BN, 4, 32), kk


@triton.jit
def _t_q6_k(wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr):
    # int16 view, 105 halfwords: ql (0-63), qh (64-95), int8 scales (bytes 192-207), d (104). Pass P = nibble.
    v = tl.arange(0, 64)
    b = tl.arange(0, 2)
    base = rw[:, None] + sb * 105
    lo = _unpack(_ld16(wq, base + v[None, :]), (8 * b + 4 * P)[None, :] + 0 * v[:, None], 15, BN, 64, 2)
    hi = _unpack(
        _ld16(wq, base + (64 + v // 32 * 16 + v % 16)[None, :]),
        (8 * b)[None, :] + (4 * P + 2 * (v % 32 // 16))[:, None],
        3,
        BN,
        64,
        2,
    )
    kk = _flat((v // 32 * 128 + P * 64 + v % 32 * 2)[:, None] + b[None, :], 64, 2)
    u = tl.arange(0, 8)  # groups of 16 weights = 8 halfwords
    s = tl.load(wb + rb[:, None] + (sb * 210 + 192 + u // 4 * 8 + 4 * P + u % 4)[None, :]).to(tl.int32)
    s = (s ^ 0x80) - 128  # int8
    d = tl.load(wq + rw + sb * 105 + 104).to(tl.float16, bitcast=True).to(tl.float32)
    return _rep(d[:, None] * s.to(tl.float32), BN, 8, 16) * (_u2f(lo | (hi << 4)) - 32.0), kk


@triton.jit
def _tile(QT: tl.constexpr, wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    "Dispatch on the GGML type id."
    if QT == 2:
        w, kk = _t_q4_0(wq, rw, sb, BN, NB)
    elif QT == 3:
        w, kk = _t_q4_1(wq, rw, sb, BN, NB)
    elif QT == 6:
        w, kk = _t_q5_0(wq, rw, sb, BN, NB)
    elif QT == 7:
        w, kk = _t_q5_1(wq, rw, sb, BN, NB)
    elif QT == 8:
        w, kk = _t_q8_0(wq, rw, sb, BN, NB)
    elif QT == 10:
        w, kk = _t_q2_k(wq, wb, rw, rb, sb, P, BN)
    elif QT == 11:
        w, kk = _t_q3_k(wq, wb, rw, rb, sb, P, BN)
    elif QT == 12:
        w, kk = _t_q4_k(wq, wb, rw, rb, sb, P, BN)
    elif QT == 13:
        w, kk = _t_q5_k(wq, wb, rw, rb, sb, P, BN)
    else:
        w, kk = _t_q6_k(wq, wb, rw, rb, sb, P, BN)
    return w, kk


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
            w, kk = _tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
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
            w, kk = _tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
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
        w, kk = _tile(QT, wq, wb, rw, rb, sb, p, BN, NB)
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
    "`x` `[..., K]` @ dequant(qweight `uint8 [N, bytes_per_row]`).T -> `[..., N]` in x's dtype, picking a kernel by M."
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    if M <= GEMV_MAX_M:
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
