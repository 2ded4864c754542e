"""One K-tile of the M = 1 GEMV (`w4a16_gemv`): its products with x added into the fp32 register tiles.

`gemv_tile` takes the `[C, BNH]` word tile of one 128-wide K-tile (C = 4 * BITS word rows; with NH = 2 also the
tile of the columns BNH further on), x at the K-tile's start and the scale rows. Per scale group it loads the
columns' scales and offsets (`_scale_rows`); per bit field j it loads the field's contiguous run of x (`_gemv_x`,
kept in cache), turns the field into floats (`field_f`, or `field_slot` where the fields stay where they lie in
the word and x is scaled to match by `_x_field`) and adds `f * x` into a per-group partial sum that the group's
scale then multiplies once (groups of 1 or 2 fields: each weight dequantized instead). `gemv_tile_rs` is the same
for the 4-bit row-halves layout (`RS`). The words arrive loaded by `w4a16_gemv_iter`, which calls these per K-tile;
the fields' arithmetic is in `w4a16_fields`.
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.w4a16_fields import field_f, field_slot, x_slot, x_start, x_unslot

__all__ = ['gemv_tile', 'gemv_tile_rs']


@triton.jit
def _scale_rows(s_ptr, o_ptr, idx, nmask, BITS: tl.constexpr, EVEN_N: tl.constexpr, SLOT: tl.constexpr):
    """`S = 2**BITS * scale` and `B = offset - S` (fp32) of the columns at `idx` of one scale row (SLOT: the sums
    are `sum x q` without `1`s, so `S = scale`, `B = offset`)."""
    if EVEN_N:
        s = tl.load(s_ptr + idx).to(tl.float32)
        o = tl.load(o_ptr + idx).to(tl.float32)
    else:
        s = tl.load(s_ptr + idx, mask=nmask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + idx, mask=nmask, other=0.0).to(tl.float32)
    if not SLOT:
        s = s * (1 << BITS)
        o = o - s
    return s, o


@triton.jit
def _gemv_x(xb, kb, rc, K, J: tl.constexpr, C: tl.constexpr, EVEN_K: tl.constexpr):
    "The `[C]` x values of bit field `J` of a K-tile (x at `xb`, the tile at `kb`), kept in cache (`evict_last`)."
    if EVEN_K:
        return tl.load(xb + J * C, eviction_policy='evict_last')
    else:
        return tl.load(xb + J * C, mask=(kb + J * C + rc) < K, other=0.0, eviction_policy='evict_last')


@triton.jit
def _x_field(xb, kb, rc, K, J: tl.constexpr, EVEN_K: tl.constexpr):
    "4-bit field `J`'s x values of a K-tile (`_gemv_x`), scaled for `field_slot` (`x_slot`)."
    return x_slot(_gemv_x(xb, kb, rc, K, J, 16, EVEN_K), J)


@triton.jit
def gemv_tile(
    acc,
    acc2,
    words,
    words2,
    xb,
    s_ptr,
    o_ptr,
    sp,
    rn,
    rc,
    nmask,
    nmask2,
    kb,
    K,
    ONE,
    BITS: tl.constexpr,
    G: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    NH: tl.constexpr,
    BNH: tl.constexpr,
    SYM: tl.constexpr = False,
):
    """acc[C, BNH] += the products of one K-tile: `words` [C, BNH], x at `xb` (+ field offsets), scale rows from
    `sp`; with NH = 2 also acc2 for `words2`, the columns BNH further on, with the same x values (each thread holds
    the same rows of both, so one x load and conversion serves 8 columns instead of 4). SYM (4-bit, groups >= 64):
    offsets are -8 scale, folded into the sums' start (`x_start`)."""
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128  # K-width of one scale group inside a tile
    JPG: tl.constexpr = GW // C  # bit fields per scale group
    NG: tl.constexpr = 128 // GW  # scale groups per tile
    SLOT: tl.constexpr = BITS == 4 and JPG > 2  # fields where they lie (`field_slot`), x scaled to match
    for gi in tl.static_range(NG):
        row = (kb + gi * GW) // G * sp
        s, o = _scale_rows(s_ptr, o_ptr, row + rn, nmask, BITS, EVEN_N, SLOT)
        s2, o2 = s, o
        if NH == 2:
            s2, o2 = _scale_rows(s_ptr, o_ptr, row + BNH + rn, nmask2, BITS, EVEN_N, SLOT)
        if SLOT:  # x sums first (the loads below are the same, CSE'd): xs = sum x, xsp = sum x * 2**E
            for jj in tl.static_range(JPG):
                xq = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
                if jj == 0:
                    if not SYM:
                        xs = x_unslot(xq, gi * JPG + jj)
                    xsp = x_start(xq, gi * JPG + jj, SYM)
                else:
                    if not SYM:
                        xs += x_unslot(xq, gi * JPG + jj)
                    xsp += x_start(xq, gi * JPG + jj, SYM)
            tf = tl.zeros_like(acc) - xsp[:, None]
            tf2 = tf
            for jj in tl.static_range(JPG):
                xq = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
                tf += field_slot(words, gi * JPG + jj, ONE) * xq[:, None]
                if NH == 2:
                    tf2 += field_slot(words2, gi * JPG + jj, ONE) * xq[:, None]
        else:
            for jj in tl.static_range(JPG):
                xj = _gemv_x(xb, kb, rc, K, gi * JPG + jj, C, EVEN_K).to(tl.float32)
                f = field_f(words, gi * JPG + jj, BITS, ONE)
                f2 = f
                if NH == 2:
                    f2 = field_f(words2, gi * JPG + jj, BITS, ONE)
                if JPG <= 2:  # small groups: dequantize each weight (2 FFMAs) instead of per-group partial sums
                    acc += (f * s[None, :] + o[None, :]) * xj[:, None]
                    if NH == 2:
                        acc2 += (f2 * s2[None, :] + o2[None, :]) * xj[:, None]
                else:
                    if jj == 0:
                        tf = f * xj[:, None]
                        tf2 = f2 * xj[:, None]
                        xs = xj
                    else:
                        tf += f * xj[:, None]
                        if NH == 2:
                            tf2 += f2 * xj[:, None]
                        xs += xj
        if JPG > 2:
            acc += tf * s[None, :]  # two separate updates: two FFMAs, not FMUL + FFMA + FADD
            if not (SLOT and SYM):
                acc += xs[:, None] * o[None, :]
            if NH == 2:
                acc2 += tf2 * s2[None, :]
                if not (SLOT and SYM):
                    acc2 += xs[:, None] * o2[None, :]
    return acc, acc2


@triton.jit
def gemv_tile_rs(
    acc,
    acc2,
    wa,
    wb,
    wa2,
    wb2,
    xb,
    s_ptr,
    o_ptr,
    sp,
    rn,
    rc,
    nmask,
    nmask2,
    kb,
    K,
    ONE,
    G: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BNH: tl.constexpr,
    SYM: tl.constexpr,
):
    """`gemv_tile` for 4-bit groups >= 64 with NH = 2, the K-tile's 16 word rows as two `[8, BNH]` halves (`wa`:
    rows 0-7, `wb`: 8-15; `wa2`, `wb2` the columns BNH further on): a thread holds one row of each half and chains
    both into one `[8, BNH]` sum per column tile, so the per-group scale updates and the accumulators are half
    of `gemv_tile`'s (fields as `field_slot`)."""
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // 16
    NG: tl.constexpr = 128 // GW
    for gi in tl.static_range(NG):
        row = (kb + gi * GW) // G * sp
        s, o = _scale_rows(s_ptr, o_ptr, row + rn, nmask, 4, EVEN_N, True)
        s2, o2 = _scale_rows(s_ptr, o_ptr, row + BNH + rn, nmask2, 4, EVEN_N, True)
        for jj in tl.static_range(JPG):  # x sums first (the loads below are the same, CSE'd)
            xa = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
            xc = _x_field(xb + 8, kb + 8, rc, K, gi * JPG + jj, EVEN_K)
            if jj == 0:
                xsp = x_start(xa, gi * JPG + jj, SYM) + x_start(xc, gi * JPG + jj, SYM)
                if not SYM:
                    xs = x_unslot(xa, gi * JPG + jj) + x_unslot(xc, gi * JPG + jj)
            else:
                xsp += x_start(xa, gi * JPG + jj, SYM) + x_start(xc, gi * JPG + jj, SYM)
                if not SYM:
                    xs += x_unslot(xa, gi * JPG + jj) + x_unslot(xc, gi * JPG + jj)
        tf = tl.zeros_like(acc) - xsp[:, None]
        tf2 = tf
        for jj in tl.static_range(JPG):
            xa = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
            xc = _x_field(xb + 8, kb + 8, rc, K, gi * JPG + jj, EVEN_K)
            tf += field_slot(wa, gi * JPG + jj, ONE) * xa[:, None]
            tf += field_slot(wb, gi * JPG + jj, ONE) * xc[:, None]
            tf2 += field_slot(wa2, gi * JPG + jj, ONE) * xa[:, None]
            tf2 += field_slot(wb2, gi * JPG + jj, ONE) * xc[:, None]
        acc += tf * s[None, :]
        acc2 += tf2 * s2[None, :]
        if not SYM:
            acc += xs[:, None] * o[None, :]
            acc2 += xs[:, None] * o2[None, :]
    return acc, acc2
