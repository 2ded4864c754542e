"""One K-tile of the W4A16 MMA kernel (`w4a16_mma`): a thread's words, scales and x loaded, then its MMAs.

The kernel (`_mma_kernel`) loads the next K-tile's weights with `tile_weights` while this one's math runs: each
thread's 4 word rows `4t + i` of its 4 columns (16 bytes each, `_tile_words`) for its one or two word tensors A and
B, and the tile's scales and offsets (`_tile_scales`). `x_runs` loads this K-tile's x as eight `[R, 4]` runs
`x[T*128 + j*16 + 4t ..]` (`_x_run`: one 8-byte load each for 16-bit x; fp32 gate/up sums activated, or an fp32
residual times an RMSNorm's weight, as they load). `tile_math` takes both: per word row (`_row_step`) `sum x` and
the `mma.m16n8k16` pairs of A and B against x in B's register order (`_b_regs`), then the tile's scales and
offsets on the totals (`_epilogue`), added into the fp32 tiles the kernel writes at the end:

    words, scales  --`tile_weights`-->  a0..a3, b0..b3, scA, ofA, scB, ofB  --+
    x              --`x_runs`------->  x0..x7 (16-bit)                     --+--`tile_math`-->  tA0, tA1, tB0, tB1

Why the fragments need no repacking is in `w4a16_mma`'s docstring; the register-level pieces (inline PTX, and their
emulation under the Triton interpreter) are in `w4a16_frag`.
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.w4a16_frag import _b_regs, _epilogue, _mma_ones, _mma_pair, _silu_mul, _silu_mul_scaled

__all__ = ['tile_weights', 'x_runs', 'tile_math']


@triton.jit
def _tile_words(wp, T, N, nmask, EVEN_N: tl.constexpr):
    "The 4 word rows (`4t + i`, i = 0..3) of K-tile T of this thread's 4 columns (16 bytes each)."
    p = wp + (T * 16).to(tl.int64) * N
    if EVEN_N:
        return tl.load(p), tl.load(p + N), tl.load(p + 2 * N), tl.load(p + 3 * N)
    else:
        return (
            tl.load(p, mask=nmask, other=0),
            tl.load(p + N, mask=nmask, other=0),
            tl.load(p + 2 * N, mask=nmask, other=0),
            tl.load(p + 3 * N, mask=nmask, other=0),
        )


@triton.jit
def _tile_scales(sp, op, T, N, col, nmask, G: tl.constexpr, SYM: tl.constexpr):
    "K-tile T's scales (and offsets; SYM: the scales again, unread) of the 4 columns `col`."
    grp = (T * 128) // G
    sc = tl.load(sp + grp * N + col, mask=nmask, other=0.0)
    if SYM:
        return sc, sc
    else:
        return sc, tl.load(op + grp * N + col, mask=nmask, other=0.0)


@triton.jit
def tile_weights(
    wpA,
    wpB,
    sp,
    op,
    T,
    N,
    colA,
    colB,
    nmA,
    nmB,
    G: tl.constexpr,
    NH: tl.constexpr,
    SYM: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    "K-tile T's words, scales and offsets of the thread's word tensors A and B (NH = 1: A's again, unused)."
    a0, a1, a2, a3 = _tile_words(wpA, T, N, nmA, EVEN_N)
    scA, ofA = _tile_scales(sp, op, T, N, colA, nmA, G, SYM)
    b0, b1, b2, b3, scB, ofB = a0, a1, a2, a3, scA, ofA
    if NH == 2:
        b0, b1, b2, b3 = _tile_words(wpB, T, N, nmB, EVEN_N)
        scB, ofB = _tile_scales(sp, op, T, N, colB, nmB, G, SYM)
    return a0, a1, a2, a3, b0, b1, b2, b3, scA, ofA, scB, ofB


@triton.jit
def _x_run(
    xp,
    gp,
    k,
    K,
    s,
    EVEN_K: tl.constexpr,
    ACT_X: tl.constexpr,
    RMS_X: tl.constexpr,
    NORM_X: tl.constexpr,
    F16: tl.constexpr,
):
    """x[k] for an [R, 4] run of K indices `k`, and (NORM_X) the run's squares. ACT_X: x is `silu(s gate) * s up` of
    fp32 gate/up sums at `2k`, `2k + 1` (interleaved pairs; RMS_X: `s` [R, 4] is the rows' 1/rms), computed here and
    rounded to the MMA's 16-bit type, as an activation kernel would. NORM_X: x is an fp32 residual row and the input
    `g[k] * x[k]` (`gp`: an RMSNorm's weight), rounded the same way; its 1/rms is left to the sums' consumer."""
    if ACT_X:
        p = xp[:, :, None] + 2 * k[:, :, None] + tl.arange(0, 2)[None, None, :]  # [R, 4, 2]: 32 contiguous bytes
        if EVEN_K:
            gate, up = tl.split(tl.load(p))
        else:
            gate, up = tl.split(tl.load(p, mask=(k < K)[:, :, None], other=0.0))
        if RMS_X:
            y = _silu_mul_scaled(gate, up, s)
        else:
            y = _silu_mul(gate, up)
        sq = y
    elif NORM_X:
        if EVEN_K:
            xv = tl.load(xp + k)
            gv = tl.load(gp + k)
        else:
            xv = tl.load(xp + k, mask=k < K, other=0.0)
            gv = tl.load(gp + k, mask=k < K, other=0.0)
        y = xv * gv.to(tl.float32)
        sq = xv * xv
    else:
        if EVEN_K:
            y = tl.load(xp + k)
        else:
            y = tl.load(xp + k, mask=k < K, other=0.0)
        sq = y
    if F16:
        return y.to(tl.float16), sq
    else:
        return y.to(tl.bfloat16), sq


@triton.jit
def x_runs(
    xp,
    gp,
    xk,
    T,
    K,
    s,
    sq,
    EVEN_K: tl.constexpr,
    ACT_X: tl.constexpr,
    RMS_X: tl.constexpr,
    NORM_X: tl.constexpr,
    F16: tl.constexpr,
):
    """x[T*128 + j*16 + 4t + (0 .. 3)] for j = 0 .. 7: eight [R, 4] runs (16-bit x: one 8-byte load each);
    `xk` = 4t + (0 .. 3). NORM_X: `sq` plus the runs' squares (the residual's sum of squares, per lane)."""
    k = T * 128 + xk
    x0, q0 = _x_run(xp, gp, k, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x1, q1 = _x_run(xp, gp, k + 16, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x2, q2 = _x_run(xp, gp, k + 32, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x3, q3 = _x_run(xp, gp, k + 48, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x4, q4 = _x_run(xp, gp, k + 64, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x5, q5 = _x_run(xp, gp, k + 80, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x6, q6 = _x_run(xp, gp, k + 96, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    x7, q7 = _x_run(xp, gp, k + 112, K, s, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
    if NORM_X:
        sq += ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))
    return x0, x1, x2, x3, x4, x5, x6, x7, sq


@triton.jit
def _row_step(wA, wB, xa, xb, dA0, dA1, dB0, dB1, sx, F16: tl.constexpr, NH: tl.constexpr):
    "One word row: `sum x` and the MMAs of the thread's word tensors."
    sx = _mma_ones(xa, xb, sx, F16)
    dA0, dA1 = _mma_pair(wA, xa, xb, dA0, dA1, F16)
    if NH == 2:
        dB0, dB1 = _mma_pair(wB, xa, xb, dB0, dB1, F16)
    return dA0, dA1, dB0, dB1, sx


@triton.jit
def tile_math(
    a0,
    a1,
    a2,
    a3,
    b0,
    b1,
    b2,
    b3,
    scA,
    ofA,
    scB,
    ofB,
    x0,
    x1,
    x2,
    x3,
    x4,
    x5,
    x6,
    x7,
    tA0,
    tA1,
    tB0,
    tB1,
    F16: tl.constexpr,
    NH: tl.constexpr,
    SYM: tl.constexpr,
):
    "One K-tile: its 4 word rows through the MMAs, then its scales on the totals."
    z = tl.zeros_like(tA0)
    dA0, dA1, dB0, dB1, sx = z, z, z, z, z
    dA0, dA1, dB0, dB1, sx = _row_step(
        a0, b0, _b_regs(x0, x4, x1, x5, 0), _b_regs(x2, x6, x3, x7, 0), dA0, dA1, dB0, dB1, sx, F16, NH
    )
    dA0, dA1, dB0, dB1, sx = _row_step(
        a1, b1, _b_regs(x0, x4, x1, x5, 1), _b_regs(x2, x6, x3, x7, 1), dA0, dA1, dB0, dB1, sx, F16, NH
    )
    dA0, dA1, dB0, dB1, sx = _row_step(
        a2, b2, _b_regs(x0, x4, x1, x5, 2), _b_regs(x2, x6, x3, x7, 2), dA0, dA1, dB0, dB1, sx, F16, NH
    )
    dA0, dA1, dB0, dB1, sx = _row_step(
        a3, b3, _b_regs(x0, x4, x1, x5, 3), _b_regs(x2, x6, x3, x7, 3), dA0, dA1, dB0, dB1, sx, F16, NH
    )
    tA0, tA1 = _epilogue(dA0, dA1, sx, scA, ofA, tA0, tA1, F16, SYM)
    if NH == 2:
        tB0, tB1 = _epilogue(dB0, dB1, sx, scB, ofB, tB0, tB1, F16, SYM)
    return tA0, tA1, tB0, tB1
