"""The per-type dequantizing tiles of the GGUF kernels (`gguf_matmul`): `dequant_tile` dispatches on the GGML type
id to `_t_q4_0` ... `_t_q6_k`, each reading one K-step of `BN` rows straight from the GGUF block bytes.

The weight comes in through two views of the same memory (`gguf_matmul._plan` makes them): `wq`, the word view
(`int32` when the struct size is a multiple of 4 bytes, else `int16`) for the bulk quant fields, and `wb`, the bytes,
for the few scale bytes; `rw` / `rb` `[BN]` are the rows' first word / byte. A tile returns a dequantized fp32 tile
`[BN, KP]` plus `kk` `[KP]`, the position within the step of each tile column, in whatever order unpacks cheapest
(the kernels load `x` through `kk`).

Tiles per step (KP x passes): q4_0/q4_1/q5_0/q5_1/q8_0: `32*NB` x 1; q4_k/q5_k: 128 x 2 (low, high nibbles);
q6_k: 128 x 2; q2_k/q3_k: 64 x 4 (bit pairs). Scales are loaded per sub-block (`[BN, G]`) and broadcast over the
sub-block's columns, and ints become floats through the exponent trick `bits(q | 0x4B000000) - 2**23`.

Data flow: GGUF block bytes (`wq`, `wb`) -> `_unpack` of the quant fields, scales per sub-block (`_rep`) ->
`(q - offset) * d` or `q * d - m` in fp32 -> `(w [BN, KP], kk [KP])` to the kernel.
"""

import triton
import triton.language as tl

__all__ = ['dequant_tile']

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
def dequant_tile(QT: tl.constexpr, wq, wb, rw, rb, sb, P: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
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
