"""One iteration of the M = 1 GEMV's K loop (`w4a16_gemv`): its word tiles loaded, then multiplied into the sums.

The kernel (`_gemv_kernel`) calls `gemv_words` for the `[C, BNH]` word tiles of an iteration, in four register
slots: TPI K-tiles (NH = 1), two K-tiles of two column tiles (NH = 2), or the four row halves of one K-tile (RS);
the words are streamed (`evict_first`) and unmasked where the columns divide evenly. `gemv_iter` then hands the
slots to the tile math of `w4a16_gemv_tile` (`gemv_tile`, `gemv_tile_rs`), each K-tile `t` with its x
(`x_ptr + t * 128`). Loads and math are separate calls so that the kernel can load one iteration's words (register
prefetch, or before `pdl_wait`) before it runs another's math.
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.w4a16_gemv_tile import gemv_tile, gemv_tile_rs

__all__ = ['gemv_words', 'gemv_iter']


@triton.jit
def _wload(ptr, mask, EVEN_N: tl.constexpr):
    "One word tile, streamed (`evict_first`); unmasked when the columns divide evenly (no predicates, no zeroing)."
    if EVEN_N:
        return tl.load(ptr, eviction_policy='evict_first')
    return tl.load(ptr, mask=mask[None, :], other=0, eviction_policy='evict_first')


@triton.jit
def gemv_words(
    wp,
    t,
    N,
    nmask,
    nmask2,
    C: tl.constexpr,
    TPI: tl.constexpr,
    NH: tl.constexpr,
    BNH: tl.constexpr,
    RS: tl.constexpr = False,
    EVEN_N: tl.constexpr = False,
):
    """The word tiles `[C, BNH]` of one iteration: K-tiles t .. t + TPI - 1 (NH = 1), or (K-tile, column half)
    (t, 0), (t, 1), (t + 1, 0), (t + 1, 1) (NH = 2, TPI <= 2); unused slots repeat the first ones. RS: the
    `[C / 2, BNH]` row halves (rows, columns) (0, 0), (1, 0), (0, 1), (1, 1) of K-tile t."""
    if RS:
        w0 = _wload(wp + t * C * N, nmask, EVEN_N)
        w1 = _wload(wp + t * C * N + C // 2 * N, nmask, EVEN_N)
        w2 = _wload(wp + t * C * N + BNH, nmask2, EVEN_N)
        w3 = _wload(wp + t * C * N + C // 2 * N + BNH, nmask2, EVEN_N)
        return w0, w1, w2, w3
    w0 = _wload(wp + t * C * N, nmask, EVEN_N)
    w1 = w0
    if NH == 2:
        w1 = _wload(wp + t * C * N + BNH, nmask2, EVEN_N)
    w2 = w0
    w3 = w1
    if NH == 1:
        if TPI > 1:
            w1 = _wload(wp + (t + 1) * C * N, nmask, EVEN_N)
        if TPI > 2:
            w2 = _wload(wp + (t + 2) * C * N, nmask, EVEN_N)
            w3 = _wload(wp + (t + 3) * C * N, nmask, EVEN_N)
    else:
        if TPI > 1:
            w2 = _wload(wp + (t + 1) * C * N, nmask, EVEN_N)
            w3 = _wload(wp + (t + 1) * C * N + BNH, nmask2, EVEN_N)
    return w0, w1, w2, w3


@triton.jit
def gemv_iter(
    acc,
    acc2,
    w0,
    w1,
    w2,
    w3,
    t,
    x_ptr,
    s_ptr,
    o_ptr,
    N,
    rn,
    rc,
    nmask,
    nmask2,
    K,
    ONE,
    BITS: tl.constexpr,
    G: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    TPI: tl.constexpr,
    NH: tl.constexpr,
    BNH: tl.constexpr,
    RS: tl.constexpr = False,
    SYM: tl.constexpr = False,
):
    "acc (and acc2) += the products of one iteration's word tiles (`gemv_words`)."
    if RS:
        acc, acc2 = gemv_tile_rs(
            acc,
            acc2,
            w0,
            w1,
            w2,
            w3,
            x_ptr + t * 128 + rc,
            s_ptr,
            o_ptr,
            N,
            rn,
            rc,
            nmask,
            nmask2,
            t * 128,
            K,
            ONE,
            G,
            EVEN_K,
            EVEN_N,
            BNH,
            SYM,
        )
    elif NH == 1:
        acc, acc2 = gemv_tile(
            acc,
            acc2,
            w0,
            w0,
            x_ptr + t * 128 + rc,
            s_ptr,
            o_ptr,
            N,
            rn,
            rc,
            nmask,
            nmask2,
            t * 128,
            K,
            ONE,
            BITS,
            G,
            EVEN_K,
            EVEN_N,
            NH,
            BNH,
            SYM,
        )
        if TPI > 1:
            acc, acc2 = gemv_tile(
                acc,
                acc2,
                w1,
                w1,
                x_ptr + (t + 1) * 128 + rc,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                (t + 1) * 128,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                NH,
                BNH,
                SYM,
            )
        if TPI > 2:
            acc, acc2 = gemv_tile(
                acc,
                acc2,
                w2,
                w2,
                x_ptr + (t + 2) * 128 + rc,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                (t + 2) * 128,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                NH,
                BNH,
                SYM,
            )
            acc, acc2 = gemv_tile(
                acc,
                acc2,
                w3,
                w3,
                x_ptr + (t + 3) * 128 + rc,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                (t + 3) * 128,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                NH,
                BNH,
                SYM,
            )
    else:
        acc, acc2 = gemv_tile(
            acc,
            acc2,
            w0,
            w1,
            x_ptr + t * 128 + rc,
            s_ptr,
            o_ptr,
            N,
            rn,
            rc,
            nmask,
            nmask2,
            t * 128,
            K,
            ONE,
            BITS,
            G,
            EVEN_K,
            EVEN_N,
            NH,
            BNH,
            SYM,
        )
        if TPI > 1:
            acc, acc2 = gemv_tile(
                acc,
                acc2,
                w2,
                w3,
                x_ptr + (t + 1) * 128 + rc,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                (t + 1) * 128,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                NH,
                BNH,
                SYM,
            )
    return acc, acc2
