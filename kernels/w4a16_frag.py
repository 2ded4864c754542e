"""The register-level operations of the W4A16 MMA kernel (`w4a16_mma`): inline PTX, and its emulation in plain
Triton for the interpreter.

Data flow per word row of a K-tile (lane `(g, t)` = `4g + t` of a warp; every operand an `[R, 4]` tensor whose 4
elements sit in one thread, `pack=4`):

    words w [R, 4] (columns n .. n+3) --LOP3/SHF--> A fragments of two m16n8k16 tiles --+
    x runs (8 x 8-byte loads per K-tile) --PRMT (`_b_regs`)--> B fragment -------------+--> mma.sync (`_mma_pair`)
    B fragment --mma.sync with A = 1 (`_mma_ones`)--> sum x
    per K-tile: D, sum x, scales (and offsets) --FMA (`_epilogue`)--> the running totals

Under `TRITON_INTERPRET=1` (no PTX) the same functions compute the same per-lane values with tensor ops: the A
rows of lane group g and B columns of lane group n are gathered by reshaping `[R]` to `[warps, 8, 4]`
(`_mma_emul`), and D is handed back in the lanes' order (`_lanes_out`).
"""

import struct

import triton
import triton.language as tl

from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

_LOP = 'lop3.b32 {d}, {s}, 0x000F000F, m, 0xEA; '


def _tile_asm(w0, w1, d, c, mma):
    "PTX: one m16n8k16 tile (rows g, g+8 from words w0, w1) over both field blocks, accumulator c -> d."
    return (
        _LOP.format(d='a0', s=w0)
        + _LOP.format(d='a1', s=w1)
        + f'shr.b32 s0, {w0}, 4; shr.b32 s1, {w1}, 4; '
        + _LOP.format(d='a2', s='s0')
        + _LOP.format(d='a3', s='s1')
        + f'{mma} {{{d}}}, {{a0, a1, a2, a3}}, {{$12, $13}}, {{{c}}}; '
        + f'shr.b32 s0, {w0}, 8; shr.b32 s1, {w1}, 8; '
        + _LOP.format(d='a0', s='s0')
        + _LOP.format(d='a1', s='s1')
        + f'shr.b32 s0, {w0}, 12; shr.b32 s1, {w1}, 12; '
        + _LOP.format(d='a2', s='s0')
        + _LOP.format(d='a3', s='s1')
        + f'{mma} {{{d}}}, {{a0, a1, a2, a3}}, {{$14, $15}}, {{{d}}}; '
    )


def _mma(f16):
    "The MMA instruction: bf16 or fp16 operands, fp32 accumulators."
    return f'mma.sync.aligned.m16n8k16.row.col.f32.{"f16.f16" if f16 else "bf16.bf16"}.f32'


def _magic(f16):
    "Two 16-bit halves holding the exponent of 128 (bf16) or 1024 (fp16), where a nibble ORed in adds exactly q."
    return '0x64006400' if f16 else '0x43004300'


# $0-$3, $4-$7: the two tiles' D; $8-$11 the 4 words; $12-$13 x for fields 0,4 | 1,5; $14-$15 for 2,6 | 3,7;
# $16-$19, $20-$23 the two tiles' C.
_PAIR_BF16 = tl.constexpr(
    '{ .reg .b32 a0, a1, a2, a3, s0, s1, m; mov.b32 m, '
    + _magic(False)
    + '; '
    + _tile_asm('$8', '$9', '$0, $1, $2, $3', '$16, $17, $18, $19', _mma(False))
    + _tile_asm('$10', '$11', '$4, $5, $6, $7', '$20, $21, $22, $23', _mma(False))
    + '}'
)
_PAIR_F16 = tl.constexpr(
    '{ .reg .b32 a0, a1, a2, a3, s0, s1, m; mov.b32 m, '
    + _magic(True)
    + '; '
    + _tile_asm('$8', '$9', '$0, $1, $2, $3', '$16, $17, $18, $19', _mma(True))
    + _tile_asm('$10', '$11', '$4, $5, $6, $7', '$20, $21, $22, $23', _mma(True))
    + '}'
)
_PAIR_CONS = tl.constexpr('=f,' * 8 + 'r,' * 8 + 'f,' * 7 + 'f')


def _ones_asm(f16):
    "PTX: $0-$3 D; $4-$5, $6-$7 the x pairs; $8-$11 C. With A = 1, D = C + the sum of the iteration's 32 x."
    return (
        '{ .reg .b32 o; mov.b32 o, '
        + ('0x3C003C00' if f16 else '0x3F803F80')
        + '; '
        + f'{_mma(f16)} {{$0, $1, $2, $3}}, {{o, o, o, o}}, {{$4, $5}}, {{$8, $9, $10, $11}}; '
        + f'{_mma(f16)} {{$0, $1, $2, $3}}, {{o, o, o, o}}, {{$6, $7}}, {{$0, $1, $2, $3}}; }}'
    )


_ONES_BF16 = tl.constexpr(_ones_asm(False))
_ONES_F16 = tl.constexpr(_ones_asm(True))
_ONES_CONS = tl.constexpr('=f,=f,=f,=f,r,r,r,r,f,f,f,f')


def _f32(v: float) -> str:
    "A PTX fp32 immediate."
    return '0f%08X' % struct.unpack('<I', struct.pack('<f', v))[0]


def _epi_asm(magic: int, sym: bool) -> str:
    """PTX of a K-tile's epilogue: `T += s (D - (magic + 8) sum x)` (sym) or `T += s D + (o - magic s) sum x`.
    $0-$7 the new totals of the two tiles; $8-$11, $12-$15 their D; $16-$19 sum x; $20-$21 the 4 columns' scales
    (fp16 pairs); sym: $22-$25, $26-$29 the totals; else $22-$23 the offsets, $24-$27, $28-$31 the totals."""
    s = (
        '{ .reg .b16 h0, h1, h2, h3; .reg .f32 f0, f1, f2, f3, e0, e1, e2, e3; '
        'mov.b32 {h0, h1}, $20; mov.b32 {h2, h3}, $21; '
        'cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3; '
    )
    t = 22 if sym else 24
    if not sym:
        s += (
            'mov.b32 {h0, h1}, $22; mov.b32 {h2, h3}, $23; .reg .f32 b0, b1, b2, b3; '
            'cvt.f32.f16 b0, h0; cvt.f32.f16 b1, h1; cvt.f32.f16 b2, h2; cvt.f32.f16 b3, h3; '
        )
        for j in range(4):
            s += f'fma.rn.f32 b{j}, f{j}, {_f32(-magic)}, b{j}; '  # offset - magic * scale
    for tile in (0, 1):
        d, o = 8 + 4 * tile, 4 * tile
        sc = (2 * tile, 2 * tile, 2 * tile + 1, 2 * tile + 1)  # element c: column 2 * tile + c // 2
        for c in range(4):
            if sym:
                s += f'fma.rn.f32 e{c}, ${16 + c}, {_f32(-(magic + 8))}, ${d + c}; '
                s += f'fma.rn.f32 ${o + c}, f{sc[c]}, e{c}, ${t + 4 * tile + c}; '
            else:
                s += f'fma.rn.f32 e{c}, f{sc[c]}, ${d + c}, ${t + 4 * tile + c}; '
                s += f'fma.rn.f32 ${o + c}, b{sc[c]}, ${16 + c}, e{c}; '
    return s + '}'


_EPI_SYM_BF16 = tl.constexpr(_epi_asm(128, True))
_EPI_SYM_F16 = tl.constexpr(_epi_asm(1024, True))
_EPI_BF16 = tl.constexpr(_epi_asm(128, False))
_EPI_F16 = tl.constexpr(_epi_asm(1024, False))
_EPI_SYM_CONS = tl.constexpr('=f,' * 8 + 'f,' * 12 + 'r,r,' + 'f,' * 7 + 'f')
_EPI_CONS = tl.constexpr('=f,' * 8 + 'f,' * 12 + 'r,r,r,r,' + 'f,' * 7 + 'f')


_ASM = tl.constexpr(not _INTERPRET)


@triton.jit
def _elem(t, j: tl.constexpr):
    "Element j of every row of an [R, 4] tensor: [R], same dtype (emulation only)."
    e = tl.arange(0, 4)[None, :]
    return tl.sum(tl.where(e == j, t, tl.zeros_like(t)), 1)


@triton.jit
def _x_of(xa, xb, j: tl.constexpr):
    "x of field j from B's two registers: xa holds fields (0, 4, 1, 5), xb (2, 6, 3, 7) (emulation only)."
    if j % 4 < 2:
        return _elem(xa, 2 * (j % 4) + j // 4)
    else:
        return _elem(xb, 2 * (j % 4 - 2) + j // 4)


@triton.jit
def _lanes_out(p_lo, p_hi, NW: tl.constexpr):
    """An MMA's D as the lanes hold it: lane (g, t) element c is row g (c < 2; `p_lo`) or g + 8 (`p_hi`), column
    2t + c % 2; `p_*` [NW, 8 rows, 8 columns] -> [R, 4] (emulation only)."""
    tq = tl.arange(0, 4)[:, None, None]
    c = tl.arange(0, 4)[None, :, None]
    n = tl.arange(0, 8)[None, None, :]
    hot = tl.where(n == 2 * tq + c % 2, 1.0, 0.0)  # [t, c, n]
    sel = tl.where(c[None, None] < 2, p_lo[:, :, None, None, :], p_hi[:, :, None, None, :])  # [NW, g, 1, c, n]
    return tl.reshape(tl.sum(sel * hot[None, None], 4), [NW * 32, 4])


@triton.jit
def _mma_emul(w, xa, xb, ea: tl.constexpr, eb: tl.constexpr, MAGIC: tl.constexpr):
    """`sum over the warp's 4 lanes t and 8 fields j of (MAGIC + q_j) x_j` for A rows g <- word `ea`, g + 8 <- word
    `eb` of lane (g, t), B column n <- x of lane (n, t): [NW, 8, 8] twice (emulation only)."""
    NW: tl.constexpr = w.shape[0] // 32
    wa = tl.reshape(_elem(w, ea), [NW, 8, 1, 4])
    wb = tl.reshape(_elem(w, eb), [NW, 8, 1, 4])
    p_lo = tl.zeros([NW, 8, 8], dtype=tl.float32)
    p_hi = tl.zeros([NW, 8, 8], dtype=tl.float32)
    for j in tl.static_range(8):
        xj = tl.reshape(_x_of(xa, xb, j).to(tl.float32), [NW, 1, 8, 4])
        p_lo += tl.sum((MAGIC + ((wa >> (4 * j)) & 15)).to(tl.float32) * xj, 3)
        p_hi += tl.sum((MAGIC + ((wb >> (4 * j)) & 15)).to(tl.float32) * xj, 3)
    return p_lo, p_hi


@triton.jit
def _mma_pair(w, xa, xb, d0, d1, F16: tl.constexpr):
    "Two tiles' MMAs over one word row: words `w` [R, 4] (columns n .. n+3), x pairs `xa`, `xb`; returns D0, D1."
    if not _ASM:
        NW: tl.constexpr = w.shape[0] // 32
        MAGIC: tl.constexpr = 1024 if F16 else 128
        p0, p1 = _mma_emul(w, xa, xb, 0, 1, MAGIC)
        p2, p3 = _mma_emul(w, xa, xb, 2, 3, MAGIC)
        return d0 + _lanes_out(p0, p1, NW), d1 + _lanes_out(p2, p3, NW)
    elif F16:
        return tl.inline_asm_elementwise(
            _PAIR_F16, _PAIR_CONS, [w, xa, xb, d0, d1], dtype=(tl.float32, tl.float32), is_pure=True, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            _PAIR_BF16, _PAIR_CONS, [w, xa, xb, d0, d1], dtype=(tl.float32, tl.float32), is_pure=True, pack=4
        )


@triton.jit
def _mma_ones(xa, xb, d, F16: tl.constexpr):
    "`d + sum x` over the iteration's 32 K (A = 1), per column of B (row of x)."
    if not _ASM:
        NW: tl.constexpr = xa.shape[0] // 32
        p = tl.zeros([NW, 8, 8], dtype=tl.float32)
        for j in tl.static_range(8):
            p += tl.sum(tl.reshape(_x_of(xa, xb, j).to(tl.float32), [NW, 8, 4]), 2)[:, None, :]
        return d + _lanes_out(p, p, NW)
    elif F16:
        return tl.inline_asm_elementwise(_ONES_F16, _ONES_CONS, [xa, xb, d], dtype=tl.float32, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_ONES_BF16, _ONES_CONS, [xa, xb, d], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _epilogue(d0, d1, sx, sc, of, t0, t1, F16: tl.constexpr, SYM: tl.constexpr):
    "A K-tile's scales on the two tiles' D (`_epi_asm`); returns the new totals."
    if not _ASM:
        MAGIC: tl.constexpr = 1024 if F16 else 128
        c = tl.arange(0, 4)[None, :]
        s0 = tl.where(c < 2, _elem(sc, 0)[:, None], _elem(sc, 1)[:, None]).to(tl.float32)
        s1 = tl.where(c < 2, _elem(sc, 2)[:, None], _elem(sc, 3)[:, None]).to(tl.float32)
        if SYM:
            return t0 + s0 * (d0 - (MAGIC + 8) * sx), t1 + s1 * (d1 - (MAGIC + 8) * sx)
        else:
            o0 = tl.where(c < 2, _elem(of, 0)[:, None], _elem(of, 1)[:, None]).to(tl.float32)
            o1 = tl.where(c < 2, _elem(of, 2)[:, None], _elem(of, 3)[:, None]).to(tl.float32)
            return t0 + s0 * d0 + (o0 - MAGIC * s0) * sx, t1 + s1 * d1 + (o1 - MAGIC * s1) * sx
    elif SYM:
        if F16:
            return tl.inline_asm_elementwise(
                _EPI_SYM_F16,
                _EPI_SYM_CONS,
                [d0, d1, sx, sc, t0, t1],
                dtype=(tl.float32, tl.float32),
                is_pure=True,
                pack=4,
            )
        else:
            return tl.inline_asm_elementwise(
                _EPI_SYM_BF16,
                _EPI_SYM_CONS,
                [d0, d1, sx, sc, t0, t1],
                dtype=(tl.float32, tl.float32),
                is_pure=True,
                pack=4,
            )
    else:
        if F16:
            return tl.inline_asm_elementwise(
                _EPI_F16, _EPI_CONS, [d0, d1, sx, sc, of, t0, t1], dtype=(tl.float32, tl.float32), is_pure=True, pack=4
            )
        else:
            return tl.inline_asm_elementwise(
                _EPI_BF16, _EPI_CONS, [d0, d1, sx, sc, of, t0, t1], dtype=(tl.float32, tl.float32), is_pure=True, pack=4
            )


def _b_asm(i):
    """PTX: B's two registers for word row `4t + i` from four 8-byte x runs (fields j, j + 4, j + 1, j + 5): element i
    of each run is half `i % 2` of its register `i // 2`; one PRMT pairs two runs' halves."""
    r, h = i // 2, i % 2
    sel = (2 * h) | (2 * h + 1) << 4 | (4 + 2 * h) << 8 | (5 + 2 * h) << 12
    return f'prmt.b32 $0, ${2 + r}, ${4 + r}, {sel:#x}; prmt.b32 $1, ${6 + r}, ${8 + r}, {sel:#x};'


_B0 = tl.constexpr(_b_asm(0))
_B1 = tl.constexpr(_b_asm(1))
_B2 = tl.constexpr(_b_asm(2))
_B3 = tl.constexpr(_b_asm(3))


@triton.jit
def _b_regs(xj, xj4, xj1, xj5, i: tl.constexpr):
    "x pairs `(x_j, x_j+4)`, `(x_j+1, x_j+5)` of word row `4t + i`, as one bf16/fp16 [R, 4] tensor (B's registers)."
    if not _ASM:
        e = tl.arange(0, 4)[None, :]
        v = tl.where(
            e == 0,
            _elem(xj, i)[:, None],
            tl.where(e == 1, _elem(xj4, i)[:, None], tl.where(e == 2, _elem(xj1, i)[:, None], _elem(xj5, i)[:, None])),
        )
        return v.to(xj.dtype)
    elif i == 0:
        return tl.inline_asm_elementwise(
            _B0, '=r,=r,r,r,r,r,r,r,r,r', [xj, xj4, xj1, xj5], dtype=xj.dtype, is_pure=True, pack=4
        )
    elif i == 1:
        return tl.inline_asm_elementwise(
            _B1, '=r,=r,r,r,r,r,r,r,r,r', [xj, xj4, xj1, xj5], dtype=xj.dtype, is_pure=True, pack=4
        )
    elif i == 2:
        return tl.inline_asm_elementwise(
            _B2, '=r,=r,r,r,r,r,r,r,r,r', [xj, xj4, xj1, xj5], dtype=xj.dtype, is_pure=True, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            _B3, '=r,=r,r,r,r,r,r,r,r,r', [xj, xj4, xj1, xj5], dtype=xj.dtype, is_pure=True, pack=4
        )


# silu(g) * u = g * u / (1 + 2^(-g log2 e)): one MUFU.EX2 and one MUFU.RCP (approximate, flush-to-zero; the result
# is rounded to 16 bits) instead of the range-checked exp and division of `tl.sigmoid`
def _silu_mul_asm(scaled: bool) -> str:
    "PTX of `silu(g) * u` (`$1`, `$2`); scaled: of `s g` and `s u` (`$3`: s, a norm's 1/rms), the products made first."
    g, u = ('g', 'u') if scaled else ('$1', '$2')
    pre = 'mul.f32 g, $1, $3; mul.f32 u, $2, $3; ' if scaled else ''
    return (
        '{ .reg .f32 e, d, g, u; ' + pre + f'mul.f32 e, {g}, ' + _f32(-1.4426950408889634) + '; '
        'ex2.approx.ftz.f32 e, e; add.f32 d, e, ' + _f32(1.0) + '; rcp.approx.ftz.f32 d, d; '
        f'mul.f32 e, {g}, {u}; mul.f32 $0, e, d; }}'
    )


_SILU_MUL = tl.constexpr(_silu_mul_asm(False))
_SILU_MUL_S = tl.constexpr(_silu_mul_asm(True))


@triton.jit
def _silu_mul(gate, up):
    "`silu(gate) * up` of fp32 tensors (`_SILU_MUL`; the interpreter: `tl.sigmoid`)."
    if not _ASM:
        return gate * tl.sigmoid(gate) * up
    else:
        return tl.inline_asm_elementwise(_SILU_MUL, '=f,f,f', [gate, up], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _silu_mul_scaled(gate, up, s):
    "`silu(s gate) * s up` of fp32 tensors, `s` broadcast (`_SILU_MUL_S`; the interpreter: `tl.sigmoid`)."
    if not _ASM:
        return (s * gate) * tl.sigmoid(s * gate) * (s * up)
    else:
        return tl.inline_asm_elementwise(_SILU_MUL_S, '=f,f,f,f', [gate, up, s], dtype=tl.float32, is_pure=True, pack=1)
