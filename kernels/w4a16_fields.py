"""Triton helpers that turn the bit fields of the W4A16 layout into floats without an int -> float conversion.

`field_f`: field `j` of a word is shifted into the top mantissa bits of `1.0f` (`0x3F800000 | q << (23 - BITS)`),
a shift and one AND-OR (LOP3) per weight giving exactly `f = 1 + q / 2**BITS`; with `S = 2**BITS * scale` and
`B = offset - S`, `W = S * f + B`, so a kernel sums `x * f` per scale group and applies `S` and `B * sum(x)` once
per group.

`field_slot` (4-bit, used by the GEMV for groups >= 64): the nibble is masked where it lies after at most one of
two shifts per word, so 8 weights cost 2 shifts + 8 LOP3. Each field then stands for `1 + q * 2**(b - 23)` with
its own bit position `b`; x is pre-scaled by `2**(23 - b)` (`x_slot`, folded into x's bf16 -> fp32 conversion) so
that every field adds `x q`, and the sums start at `-sum(x * 2**(23 - b))` (`x_start`) to cancel the `1`s.
"""

import triton
import triton.language as tl

__all__ = ['F32_ONE', 'field_f', 'field_slot', 'x_slot', 'x_unslot', 'x_start']
F32_ONE = 0x3F800000  # the bits of 1.0f, passed to the kernels as their runtime argument `ONE` (`field_f`)


@triton.jit
def field_f(words, J: tl.constexpr, BITS: tl.constexpr, ONE):
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
def field_slot(words, J: tl.constexpr, ONE):
    """4-bit field `J` of `words` as fp32 `1 + q * 2**(b - 23)`, b in 11 .. 19: the nibble is masked where it lands
    after at most one of two shifts per word (fields 3, 4 in place at b = 12, 16; 0-2 after `<< 11`, 5-7 after
    `>> 9`: b = 11, 15, 19), so 8 weights cost 2 shifts + 8 LOP3 instead of a shift + LOP3 each. x is scaled by
    `2**(23 - b)` (`x_slot`) so that each field adds `x q`; the caller cancels the `1`s by starting the sum at
    `-sum(x * 2**(23 - b))` and applies `scale` as it is (`_scale_rows` with SLOT)."""
    B: tl.constexpr = 4 * J + 11 * (J < 3) - 9 * (J > 4)
    if J == 3 or J == 4:
        v = words
    elif J < 3:
        v = words << 11
    else:
        v = words >> 9
    return ((v & (15 << B)) | ONE).to(tl.float32, bitcast=True)


@triton.jit
def x_slot(xj, J: tl.constexpr):
    """fp32 `x * 2**E` for field `J` of `field_slot`, `E = 23 - b` (4 .. 12): for bf16 x the exponent add rides
    on the conversion (`x << 16 + E << 23`, one IMAD; a zero becomes the negligible `2**(E - 127)`)."""
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    if xj.dtype == tl.bfloat16:
        xi = xj.to(tl.uint16, bitcast=True).to(tl.uint32)
        return ((xi << 16) + (E << 23)).to(tl.float32, bitcast=True)
    else:
        return xj.to(tl.float32) * (1 << E)


@triton.jit
def x_unslot(xq, J: tl.constexpr):
    "`x` back from `x_slot`'s `x * 2**E` (an exact multiply)."
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    return xq * (1.0 / (1 << E))


@triton.jit
def x_start(xq, J: tl.constexpr, SYM: tl.constexpr):
    """A field's share of the `field_slot` sums' start: `x * 2**E` (its `1`), plus `8 x` for symmetric layers
    (offset = -8 scale: `sum x (q - 8)` then needs neither `sum x` nor the offsets)."""
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    if SYM:
        return xq * (1.0 + 8.0 / (1 << E))
    else:
        return xq
