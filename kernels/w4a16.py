"""Triton kernels for `y = x @ W.T` with `W` in cvllm's packed 4-bit (or 8-bit) layout, and their PyTorch reference.

The layout (built by `cvllm_lab.quant.w4a16.pack_weights`; the notebook `46_w4a16` draws it) for a weight
`W [N, K]` with integer levels `q[n, k]` in `0 .. 2**BITS - 1`:

- `qweight` `int32 [Kp * BITS / 32, N]`, `Kp` = K rounded up to a multiple of 128 (zero padded). K is cut into
  *tiles* of 128; tile `t` owns the `C = 4 * BITS` word rows `t*C .. t*C + C-1` (16 for 4-bit, 32 for 8-bit), and
  bit field `j` (bits `BITS*j ..`) of word row `t*C + c`, column `n`, holds `q[n, t*128 + j*C + c]`.
  So a load of `[C, BN]` words is contiguous along `n` (coalesced), and field `j` of it is the `[C, BN]` slice
  `k = t*128 + j*C + c` of `W.T`: for the GEMV it multiplies a contiguous run of `x`, for `tl.dot` it is a ready
  `[16 or 32, BN]` operand. No reshapes, no gathers.
- `scales`, `offsets` `fp16 [Kp / G, N]`: `W[n, k] = scales[k // G, n] * q[n, k] + offsets[k // G, n]`
  (GPTQ/AWQ zero points become `offset = -scale * zero`). `G` is a multiple of `C` that divides 128, or a multiple
  of 128 (`G = Kp`: one scale per output channel).

Integer to float: field `j` is shifted into the top mantissa bits of `1.0f` (`0x3F800000 | q << (23 - BITS)`), a
shift and one AND-OR (LOP3) per weight giving exactly `f = 1 + q / 2**BITS`. With `S = 2**BITS * scale` and
`B = offset - S`, `W = S * f + B`, and per scale group `sum_k x_k W_k = S * sum_k x_k f_k + B * sum_k x_k`:
the GEMV inner loop is one FMA per weight into a register tile, scales are applied once per group and word,
and the cross-thread reduction happens once, after the K loop.

| kernel | used for | what it does |
|---|---|---|
| `_gemv_kernel` / `_gemv3_kernel` | M = 1 (decode) | `TPI` word tiles `[C, BN]` loaded per iteration (as separate loads, or one `[C, TPI, BN]` load), fp32 register accumulator, split-K over programs with fp32 atomics only when N gives too few programs |
| `_mm_kernel` | 1 < M <= `MM_MAX_M` | per field: dequantize `[C, BN]` to the activation dtype, `tl.dot` with `x[:, C]`, fp32 accumulator |
| `_dequant_kernel` + cuBLAS | M > `MM_MAX_M` (prefill) | writes W once in bf16/fp16, then `torch.matmul` |

Measured once on an H200 (Triton 3.6, bf16 x, CUDA-graph replay over rotating weight copies so weights come
from HBM; % of 4.2 TB/s for the packed bytes incl. scales; `results/h200_quant_kernels.csv`):

| N x K (M=1) | bf16 cuBLAS | W4A16 g128, best config | q4_k packed (g32) | q8_0 packed | FP8 (fp8_matmul) |
|---|---|---|---|---|---|
| 6144 x 4096 (qkv) | 17.0 us | 11.4 us (28%) | 23.8 us | 19.4 us | 12.9 us (47%) |
| 4096 x 4096 (o) | 13.6 us | 9.4 us (23%) | 12.8 us | 12.6 us | 12.1 us |
| 28672 x 4096 (gate_up) | 58.5 us | 34.8 us (43%) | 50.6 us | 48.4 us | 37.9 us (74%) |
| 4096 x 14336 (down) | 32.9 us | 20.6 us (36%) | 38.5 us | 32.1 us | 37.8 us |

So the GEMV is issue-bound, not memory-bound: ~5 instructions per weight in the SASS (shift, LOP3, FFMA per
weight, plus x loads/conversions and scale application), and the latency of one load batch per iteration is
only hidden with many programs per SM (split-K helped every small-N shape). Next steps: fewer instructions per
weight (two nibbles per LOP3 via f16x2 magic numbers + HFMA2 into fp32 pairs, as Marlin does in CUDA), software
pipelining of the weight loads, and a batched (M = 2..16) kernel that reuses the dequantized tile across rows
without tensor cores (the `tl.dot` path reaches only 14-23% at M=16).
"""
import os

import torch
import triton
import triton.language as tl

from cvllm_lab.quant.w4a16 import TILE_K, check_layout, dequantize_packed_ref

__all__ = ['w4a16_matmul', 'w4a16_gemv', 'w4a16_mm', 'w4a16_dequantize', 'w4a16_matmul_ref']
_INTERPRET = os.environ.get('TRITON_INTERPRET', '0') == '1'
_ONE = 0x3F800000  # 1.0f


@triton.jit
def _field_f(words, J: tl.constexpr, BITS: tl.constexpr, ONE):
    """Bit field `J` of int32 `words` as fp32 `1 + q / 2**BITS` (q moved into the top mantissa bits of `ONE` = 1.0f).

    `ONE` (0x3F800000) is a runtime argument so that it lives in a register: with two immediates ptxas spends a
    MOV per weight to materialize one of them for the LOP3. Callers pass `J` as an expression: Triton 3.6 turns a
    constexpr sum assigned to a variable into a tensor."""
    SH: tl.constexpr = 23 - BITS - BITS * J
    MASK: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)
    if SH >= 0:
        v = (words << SH) & MASK
    else:
        v = (words >> (-SH)) & MASK
    return (v | ONE).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_tile(acc, words, xb, s_ptr, o_ptr, sp, rn, rc, nmask, kb, K, ONE,
               BITS: tl.constexpr, G: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    "acc[C, BN] += the products of one K-tile: `words` [C, BN], x at `xb` (+ field offsets), scale rows from `sp`."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128  # K-width of one scale group inside a tile
    JPG: tl.constexpr = GW // C                # bit fields per scale group
    NG: tl.constexpr = 128 // GW               # scale groups per tile
    for gi in tl.static_range(NG):
        row = (kb + gi * GW) // G * sp
        if EVEN_N:
            s = tl.load(s_ptr + row + rn).to(tl.float32) * (1 << BITS)
            o = tl.load(o_ptr + row + rn).to(tl.float32) - s
        else:
            s = tl.load(s_ptr + row + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
            o = tl.load(o_ptr + row + rn, mask=nmask, other=0.0).to(tl.float32) - s
        for jj in tl.static_range(JPG):
            if EVEN_K:
                xj = tl.load(xb + (gi * JPG + jj) * C, eviction_policy='evict_last').to(tl.float32)
            else:
                xj = tl.load(xb + (gi * JPG + jj) * C, mask=(kb + (gi * JPG + jj) * C + rc) < K, other=0.0,
                             eviction_policy='evict_last').to(tl.float32)
            f = _field_f(words, gi * JPG + jj, BITS, ONE)
            if JPG <= 2:   # small groups: dequantize each weight (2 FFMAs) instead of per-group partial sums
                acc += (f * s[None, :] + o[None, :]) * xj[:, None]
            else:
                if jj == 0:
                    tf = f * xj[:, None]
                    xs = xj
                else:
                    tf += f * xj[:, None]
                    xs += xj
        if JPG > 2:
            acc += tf * s[None, :]       # two separate updates: two FFMAs, not FMUL + FFMA + FADD
            acc += xs[:, None] * o[None, :]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, N, K, TPS, ONE,
                 BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, TPI: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC: tl.constexpr):
    "out[n] (+)= sum_k x[k] W[n, k] for the BN columns of program axis 0 and the TPS K-tiles of program axis 1."
    tl.static_assert(TPI == 1 or TPI == 2 or TPI == 4)
    C: tl.constexpr = 4 * BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    wp = qw_ptr + rc[:, None] * N + rn[None, :]   # [C, BN] word tile of K-tile 0
    nmask = rn < N
    acc = tl.zeros([C, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS, TPI):
        # TPI tiles per iteration, all loads first: more bytes in flight per thread
        w0 = tl.load(wp + t * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
        if TPI > 1:
            w1 = tl.load(wp + (t + 1) * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
        if TPI > 2:
            w2 = tl.load(wp + (t + 2) * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
            w3 = tl.load(wp + (t + 3) * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
        acc = _gemv_tile(acc, w0, x_ptr + t * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, t * 128, K, ONE, BITS, G, EVEN_K, EVEN_N)
        if TPI > 1:
            acc = _gemv_tile(acc, w1, x_ptr + (t + 1) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, (t + 1) * 128, K, ONE,
                             BITS, G, EVEN_K, EVEN_N)
        if TPI > 2:
            acc = _gemv_tile(acc, w2, x_ptr + (t + 2) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, (t + 2) * 128, K, ONE,
                             BITS, G, EVEN_K, EVEN_N)
            acc = _gemv_tile(acc, w3, x_ptr + (t + 3) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, (t + 3) * 128, K, ONE,
                             BITS, G, EVEN_K, EVEN_N)
    y = tl.sum(acc, 0)
    if ATOMIC:
        tl.atomic_add(out_ptr + rn, y, mask=nmask)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv3_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, N, K, TPS, ONE,
                  BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, TPI: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC: tl.constexpr):
    "The GEMV with one `[C, TPI, BN]` load per iteration (TPI K-tiles as a tensor axis; the default for groups >= 64)."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    ru = tl.arange(0, TPI)
    rc = tl.arange(0, C)
    # [C, TPI, BN]: in this order Triton puts the warps along c and gives each thread one tile (one scale row)
    wp = qw_ptr + (ru[None, :, None] * C + rc[:, None, None]) * N + rn[None, None, :]
    xp = x_ptr + ru[None, :] * 128 + rc[:, None]                                        # [C, TPI]
    nmask = rn < N
    acc = tl.zeros([C, TPI, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS, TPI):
        words = tl.load(wp + t * C * N, mask=nmask[None, None, :], other=0, eviction_policy='evict_first')
        xb = xp + t * 128
        for gi in tl.static_range(NG):
            for jj in tl.static_range(JPG):
                if EVEN_K:
                    xj = tl.load(xb + (gi * JPG + jj) * C, eviction_policy='evict_last').to(tl.float32)
                else:
                    xj = tl.load(xb + (gi * JPG + jj) * C, mask=(t * 128 + (gi * JPG + jj) * C + rc[:, None] + ru[None, :] * 128) < K,
                                 other=0.0, eviction_policy='evict_last').to(tl.float32)
                p = _field_f(words, gi * JPG + jj, BITS, ONE) * xj[:, :, None]
                if jj == 0:
                    tf = p
                    xs = xj
                else:
                    tf += p
                    xs += xj
            sp = ((t + ru) * 128 + gi * GW) // G * N   # scale row of each of the TPI tiles
            s = tl.load(s_ptr + sp[:, None] + rn[None, :], mask=nmask[None, :], other=0.0).to(tl.float32) * (1 << BITS)
            o = tl.load(o_ptr + sp[:, None] + rn[None, :], mask=nmask[None, :], other=0.0).to(tl.float32) - s
            acc += tf * s[None, :, :]
            acc += xs[:, :, None] * o[None, :, :]
    y = tl.sum(tl.sum(acc, 1), 0)
    if ATOMIC:
        tl.atomic_add(out_ptr + rn, y, mask=nmask)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _mm_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, M, N, K, stride_xm, stride_om, TPS, ONE,
               BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ATOMIC: tl.constexpr, PREC: tl.constexpr):
    "out[BM, BN] (+)= x[BM, K-range] @ W[BN, K-range].T with one tl.dot per bit field (K=C each)."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    nmask = rn < N
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rc[None, :]
    wp = qw_ptr + rc[:, None] * N + rn[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS):
        if EVEN_N:
            words = tl.load(wp + t * C * N)
        else:
            words = tl.load(wp + t * C * N, mask=nmask[None, :], other=0)
        kb = t * 128
        for gi in tl.static_range(NG):
            go = (kb + gi * GW) // G
            if EVEN_N:
                s = tl.load(s_ptr + go * N + rn).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn).to(tl.float32) - s
            else:
                s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
            for jj in tl.static_range(JPG):
                w = _field_f(words, gi * JPG + jj, BITS, ONE) * s[None, :] + o[None, :]
                if EVEN_K:
                    xt = tl.load(xp + kb + (gi * JPG + jj) * C)
                else:
                    xt = tl.load(xp + kb + (gi * JPG + jj) * C, mask=(kb + (gi * JPG + jj) * C + rc)[None, :] < K, other=0.0)
                acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PREC)
    mask = (rm < M)[:, None] & nmask[None, :]
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if ATOMIC:
        tl.atomic_add(optr, acc, mask=mask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, o_ptr, out_ptr, N, K, ONE,
                    BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
    "out[n, k] = W[n, k] (row-major [N, K]) for one K-tile (axis 0) and BN columns (axis 1)."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    nmask = rn < N
    words = tl.load(qw_ptr + (t * C + rc)[:, None] * N + rn[None, :], mask=nmask[None, :], other=0)
    for gi in tl.static_range(NG):
        go = (t * 128 + gi * GW) // G
        s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
        o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
        for jj in tl.static_range(JPG):
            w = _field_f(words, gi * JPG + jj, BITS, ONE) * s[None, :] + o[None, :]
            k = t * 128 + (gi * JPG + jj) * C + rc
            tl.store(out_ptr + rn[None, :].to(tl.int64) * K + k[:, None], w.to(out_ptr.dtype.element_ty),
                     mask=nmask[None, :] & (k < K)[:, None])


# --------------------------------------------------------------------------------------------- launchers

def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 1


def _divisors_split(tiles, want, multiple):
    "Largest split s <= want with tiles % s == 0 and (tiles // s) % multiple == 0."
    for s in range(max(1, min(want, tiles)), 0, -1):
        if tiles % s == 0 and (tiles // s) % multiple == 0: return s
    return 1


# GEMV defaults from the H200 sweep (tests/bench_quant.py, Triton 3.6): the 3-D variant with 32 columns, 8 K-tiles
# and 8 warps per program was best or within 5% on the four Llama-3-8B shapes; for groups < 64 (GGUF q4_0/q4_1/q4_k/
# q8_0 repacks) the 2-D variant with 64 columns. Split-K only when N leaves SMs idle and each split keeps >= MIN_TILES.
GEMV_VARIANT, GEMV_BN, GEMV_TPI, GEMV_WARPS = '3d', 32, 8, 8
GEMV_SMALL_GROUP = dict(variant='2d', bn=64, tpi=4, num_warps=4)
MIN_TILES = {'3d': 48, '2d': 16}


def w4a16_gemv(x, qweight, scales, offsets, bits, group, N, K, out_dtype=None, bn=None, tpi=None,
               num_warps=None, split_k=None, variant=None):
    "`x` `[1, K]` @ W.T -> `[1, N]` with a GEMV kernel (`variant` '2d': `_gemv_kernel`, '3d': `_gemv3_kernel`)."
    assert x.shape == (1, K), x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    x = x.contiguous()
    tiles = Kp // TILE_K
    small = G < 64 and variant is None and not _INTERPRET
    variant = variant or (GEMV_SMALL_GROUP['variant'] if small else GEMV_VARIANT)
    bn = bn or (16 if _INTERPRET else GEMV_SMALL_GROUP['bn'] if small else GEMV_BN)
    tpi = tpi or (2 if _INTERPRET else GEMV_SMALL_GROUP['tpi'] if small else GEMV_TPI)
    num_warps = num_warps or (GEMV_SMALL_GROUP['num_warps'] if small else GEMV_WARPS)
    if variant == '2d': tpi = min(tpi, 4)
    while tiles % tpi: tpi //= 2
    progs = triton.cdiv(N, bn)
    if split_k is None:  # split K (fp32 atomics + zero fill + cast) only when N leaves SMs idle and K is long
        sms = _num_sms(x.device)
        split_k = 1
        if progs < sms:
            for s_ in range(min(triton.cdiv(2 * sms, progs), tiles), 1, -1):
                if tiles % s_ == 0 and (tiles // s_) % tpi == 0 and tiles // s_ >= MIN_TILES[variant]:
                    split_k = s_; break
    elif tiles % split_k or (tiles // split_k) % tpi:
        raise ValueError(f"split_k={split_k} must divide the {tiles} K-tiles into multiples of tpi={tpi}")
    out_dtype = out_dtype or x.dtype
    atomic = split_k > 1
    out = torch.zeros(1, N, dtype=torch.float32, device=x.device) if atomic else torch.empty(1, N, dtype=out_dtype, device=x.device)
    kernel = _gemv3_kernel if variant == '3d' else _gemv_kernel
    kernel[(progs, split_k)](x, qweight, scales, offsets, out, N, K, tiles // split_k, _ONE,
                             BITS=bits, G=G, BN=bn, TPI=tpi, EVEN_K=K == Kp, EVEN_N=N % bn == 0,
                             ATOMIC=atomic, num_warps=num_warps)
    return out.to(out_dtype) if atomic else out


def w4a16_mm(x, qweight, scales, offsets, bits, group, N, K, out_dtype=None, bm=None, bn=None, num_warps=None,
             split_k=None, num_stages=None):
    "`x` `[M, K]` @ W.T -> `[M, N]` with the fused dequantize + `tl.dot` kernel."
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    x = x.contiguous()
    tiles = Kp // TILE_K
    bm = bm or (16 if M <= 16 or _INTERPRET else 32 if M <= 32 else 64)
    bn = bn or (32 if _INTERPRET else 64 if M <= 32 else 128)
    num_warps = num_warps or 4
    progs = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split_k is None:
        sms = _num_sms(x.device)
        split_k = 1 if progs >= sms else _divisors_split(tiles, triton.cdiv(2 * sms, progs), 1)
    elif tiles % split_k:
        raise ValueError(f"split_k={split_k} must divide the {tiles} K-tiles")
    out_dtype = out_dtype or x.dtype
    atomic = split_k > 1
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device) if atomic else torch.empty(M, N, dtype=out_dtype, device=x.device)
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    kw = dict(num_stages=num_stages) if num_stages else {}
    _mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split_k)](
        x, qweight, scales, offsets, out, M, N, K, x.stride(0), out.stride(0), tiles // split_k, _ONE,
        BITS=bits, G=G, BM=bm, BN=bn, EVEN_K=K == Kp, EVEN_N=N % bn == 0, ATOMIC=atomic, PREC=prec,
        num_warps=num_warps, **kw)
    return out.to(out_dtype) if atomic else out


def w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=torch.float16, bn=None):
    "The weight `[N, K]` in `dtype`, written by the Triton dequantize kernel."
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    bn = bn or (16 if _INTERPRET else 64)
    out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    _dequant_kernel[(Kp // TILE_K, triton.cdiv(N, bn))](qweight, scales, offsets, out, N, K, _ONE, BITS=bits, G=G, BN=bn,
                                                        num_warps=4)
    return out


MM_MAX_M = 128  # above: dequantize once + cuBLAS


def w4a16_matmul(x, qweight, scales, offsets, bits, group, N, K):
    "`x` `[..., K]` @ W.T -> `[..., N]` in x's dtype, picking the kernel by the number of rows M."
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0: return x.new_empty(*lead, N)
    if M == 1: y = w4a16_gemv(x2, qweight, scales, offsets, bits, group, N, K)
    elif M <= MM_MAX_M: y = w4a16_mm(x2, qweight, scales, offsets, bits, group, N, K)
    else:
        wdt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        y = (x2.to(wdt) @ w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=wdt).T).to(x.dtype)
    return y.reshape(*lead, N)


# --------------------------------------------------------------------------------------------- reference

def w4a16_matmul_ref(x, qweight, scales, offsets, bits, group, N, K):
    "Reference: dequantize in PyTorch, fp32 matmul, cast to x's dtype."
    w = dequantize_packed_ref(qweight, scales, offsets, bits, group, N, K)
    return (x.float() @ w.T).to(x.dtype)
