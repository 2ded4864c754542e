"""The batched W4A16 kernels (M > 1): tensor cores, per-field `tl.dot`, and dequantize for cuBLAS.

- `_tc_kernel` (`w4a16_tc`; 4-bit, groups >= 128, 16-bit x): the weights are the tensor-core A operand,
  `out.T[BN, BM] = sum_j f_j[BN, 16] @ x_j.T[16, BM]`, x padded to 16 rows as B. Per K-tile the `[BN, 16]` word
  tile (the transposed view of the same layout) goes through shared memory into the dot-operand layout once
  (pipelined by `num_stages`), and each field is built from it in registers by inline PTX whose pairs of 16-bit
  results are exactly the MMA's register pairs: one PRMT gathers the field's byte of two words, one LOP3 masks the
  nibbles and ORs in 1.0, giving `1 + q / 128` (bf16) or `1 + q / 1024` (fp16) exactly, about one instruction per
  weight. The scales are applied to the `[BN, BM]` group sums.
- `_mm_kernel` (`w4a16_mm`; every other format): per bit field one `tl.dot` of `x[:, C]` with the exact
  `f = 1 + q / 2**BITS` in x's dtype, scales applied to the `[BM, BN]` group sums (`PERGROUP`; per weight in fp32
  where x's dtype cannot hold `f` exactly or groups are small).
- `_dequant_kernel` (`w4a16_dequantize`): W written once in 16-bit for a cuBLAS matmul (prefill).

Both matmul kernels run one program per (N-block, K-split, block of up to 64 rows), so each weight tile is read once
per 64 rows, and meet over K in the self-zeroing workspace of `split_k`. Launch configurations are per row bucket
(`m_bucket`) and shape.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import batched_plan, m_bucket, split_add, split_take, store_out
from cvllm_lab.kernels.tuned import configs_for
from cvllm_lab.kernels.w4a16_fields import F32_ONE, field_f
from cvllm_lab.kernels.w4a16_layout import TILE_K, check_layout, padded_k

__all__ = ['w4a16_mm', 'w4a16_tc', 'tc_supported', 'w4a16_dequantize']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)


@triton.jit(do_not_specialize=['M'])
def _mm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    TPS,
    ONE,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    PERGROUP: tl.constexpr,
):
    """out[BM, BN] = x[BM, K] @ W[BN, K].T, one tl.dot per bit field (K = C each); program axes: N-block, K-split,
    M-block. PERGROUP: the dot takes the exact `f = 1 + q / 2**BITS` in x's dtype and the scales are applied to the
    [BM, BN] group sums (`S * dot + B * sum(x)`: 2 ops per weight less); else W is dequantized in fp32 and rounded."""
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    nmask = rn < N
    mmask = rm < M
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rc[None, :]
    wp = qw_ptr + rc[:, None] * N + rn[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS):
        if EVEN_N:
            words = tl.load(wp + t * C * N, eviction_policy='evict_first')
        else:
            words = tl.load(wp + t * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
        kb = t * 128
        for gi in tl.static_range(NG):
            go = (kb + gi * GW) // G
            if EVEN_N:
                s = tl.load(s_ptr + go * N + rn).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn).to(tl.float32) - s
            else:
                s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
            if PERGROUP:
                d = tl.zeros([BM, BN], dtype=tl.float32)
                xs = tl.zeros([BM, C], dtype=tl.float32)
            for jj in tl.static_range(JPG):
                if EVEN_K:
                    xt = tl.load(xp + kb + (gi * JPG + jj) * C, mask=mmask[:, None], other=0.0)
                else:
                    xt = tl.load(
                        xp + kb + (gi * JPG + jj) * C,
                        mask=mmask[:, None] & ((kb + (gi * JPG + jj) * C + rc)[None, :] < K),
                        other=0.0,
                    )
                f = field_f(words, gi * JPG + jj, BITS, ONE)
                if PERGROUP:
                    d = tl.dot(xt, f.to(xt.dtype), d, input_precision=PREC)
                    xs += xt.to(tl.float32)
                else:
                    w = f * s[None, :] + o[None, :]
                    acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PREC)
            if PERGROUP:
                acc += d * s[None, :]
                acc += tl.sum(xs, 1)[:, None] * o[None, :]
    mask = mmask[:, None] & nmask[None, :]
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    store_out(
        acc, optr, mask, ws_ptr + rm[:, None] * N + rn[None, :], cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT
    )


@triton.jit
def _tc_field(words, J: tl.constexpr, DT: tl.constexpr, ONE, ASM: tl.constexpr, SYM: tl.constexpr):
    """Bit field `J` of the int32 `words` as the MMA operand `f` in `DT`: `1 + q / 16` by `field_f` (ASM off), or
    with inline PTX two weights at a time as `1 + q / 128` (bf16) / `1 + q / 1024` (fp16): one PRMT gathers the
    field's byte of two words into the two 16-bit halves, one LOP3 keeps the nibbles and ORs in 1.0 (`_tc_scale`).
    SYM: `q - 8` exactly (the symmetric weight over its scale), in PTX the nibbles ORed into 128.0 / 1024.0 (whose
    last mantissa bit is worth 1) and one packed FMA adding -136 / -1032."""
    if ASM:
        B: tl.constexpr = J // 2
        SEL: tl.constexpr = B | (B << 4) | ((4 + B) << 8) | ((4 + B) << 12)
        sel = tl.full(words.shape, SEL, tl.int32)
        if SYM:
            if DT == tl.bfloat16:
                c1 = tl.full(words.shape, 0x43004300, tl.int32)
                one = tl.full(words.shape, 0x3F803F80, tl.int32)
                neg = tl.full(words.shape, -0x3CF73CF8, tl.int32)  # 0xC308C308: -136, -136 in bf16
                FMA: tl.constexpr = 'fma.rn.bf16x2'
            else:
                c1 = tl.full(words.shape, 0x64006400, tl.int32)
                one = tl.full(words.shape, 0x3C003C00, tl.int32)
                neg = tl.full(words.shape, -0x1BF71BF8, tl.int32)  # 0xE408E408: -1032, -1032 in fp16
                FMA: tl.constexpr = 'fma.rn.f16x2'
            SHR: tl.constexpr = 'shr.b32 p, p, 4; ' if J % 2 == 1 else ''
            f = tl.inline_asm_elementwise(
                '{ .reg .b32 p; prmt.b32 p, $1, $2, $3; '
                + SHR
                + 'lop3.b32 p, p, 0x000F000F, $5, 0xEA; '
                + FMA
                + ' $0, p, $7, $9; }',
                '=r,r,r,r,r,r,r,r,r,r,r',
                [words, sel, c1, one, neg],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
            return f.to(DT, bitcast=True)
        if DT == tl.bfloat16:
            c1 = tl.full(words.shape, 0x3F803F80, tl.int32)
        else:
            c1 = tl.full(words.shape, 0x3C003C00, tl.int32)
        if J % 2 == 0:
            f = tl.inline_asm_elementwise(
                '{ .reg .b32 p; prmt.b32 p, $1, $2, $3; lop3.b32 $0, p, 0x000F000F, $5, 0xEA; }',
                '=r,r,r,r,r,r,r',
                [words, sel, c1],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
        else:
            f = tl.inline_asm_elementwise(
                '{ .reg .b32 p; prmt.b32 p, $1, $2, $3; shr.b32 p, p, 4; lop3.b32 $0, p, 0x000F000F, $5, 0xEA; }',
                '=r,r,r,r,r,r,r',
                [words, sel, c1],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
        return f.to(DT, bitcast=True)
    else:
        f = field_f(words, J, 4, ONE)
        if SYM:
            f = (f - 1.0) * 16.0 - 8.0
        return f.to(DT)


@triton.jit
def _store_silu_mul(y, out_ptr, stride_om, pid_n, rm, N, M, BN: tl.constexpr, BM: tl.constexpr):
    """`silu(gate) * up` of the `[BN, BM]` sums `y` of N-block `pid_n`, whose rows interleave gate and up (rows `2i`,
    `2i + 1`), written as `[BN / 2, BM]` to output columns `pid_n * BN / 2 ..`."""
    gate, up = tl.split(tl.permute(tl.reshape(y, [BN // 2, 2, BM]), [0, 2, 1]))
    rh = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    mask = (rh < N // 2)[:, None] & (rm < M)[None, :]
    tl.store(
        out_ptr + rm.to(tl.int64)[None, :] * stride_om + rh[:, None],
        (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit(do_not_specialize=['M'])
def _tc_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    TPS,
    ONE,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
    SYM: tl.constexpr,
    ACT: tl.constexpr,
):
    """Tensor-core W4A16 for 1 <= M <= BM (4-bit, groups >= 128): `out.T[BN, BM] = sum_j f_j[BN, 16] @ x_j.T[16, BM]`.
    The weights are the MMA's A operand: the `[BN, 16]` word tile (transposed view of the packed layout) goes to the
    dot-operand layout once per K-tile and each bit field is dequantized there to the exact `f = 1 + q / 16` in x's
    dtype; x (zero rows up to BM) is the B operand. The `[BN, BM]` group sums get the scales (`S * dot + B * sum(x)`).
    SYM (offsets = -8 scales): `f = q - 8`, so the group sums only take the scale: no `sum(x)`, no offsets read.
    ACT: W's rows interleave gate and up; the epilogue writes `silu(gate) * up` `[M, N / 2]` (`_store_silu_mul`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, 16)
    rm = pid_m * BM + tl.arange(0, BM)
    nmask = rn < N
    mmask = rm < M
    wp = qw_ptr + rc[None, :] * N + rn[:, None]  # [BN, 16] words, tile 0
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[None, :] * stride_xm + rc[:, None]  # [16, BM]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    FS: tl.constexpr = (128 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024) if ASM else 16  # f = 1 + q / FS
    t0 = pid_k * TPS
    pdl_wait(PDL)
    pdl_launch(PDL)
    for t in range(t0, t0 + TPS):
        if EVEN_N:
            words = tl.load(wp + t * 16 * N, eviction_policy='evict_first')
        else:
            words = tl.load(wp + t * 16 * N, mask=nmask[:, None], other=0, eviction_policy='evict_first')
        kb = t * 128
        d = tl.zeros([BN, BM], dtype=tl.float32)
        xs = tl.zeros([16, BM], dtype=tl.float32)
        for j in tl.static_range(8):
            if EVEN_K:
                xt = tl.load(xp + kb + j * 16, mask=mmask[None, :], other=0.0)
            else:
                xt = tl.load(xp + kb + j * 16, mask=mmask[None, :] & ((kb + j * 16 + rc) < K)[:, None], other=0.0)
            d = tl.dot(_tc_field(words, j, xt.dtype, ONE, ASM, SYM), xt, d)
            if not SYM:
                xs += xt.to(tl.float32)
        go = kb // G
        if SYM:
            if EVEN_N:
                s = tl.load(s_ptr + go * N + rn).to(tl.float32)
            else:
                s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32)
            acc += d * s[:, None]
        elif EVEN_N:
            s = tl.load(s_ptr + go * N + rn).to(tl.float32) * FS
            o = tl.load(o_ptr + go * N + rn).to(tl.float32) - s
        else:
            s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * FS
            o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
        if not SYM:
            acc += d * s[:, None]
            acc += o[:, None] * tl.sum(xs, 0)[None, :]
    mask = nmask[:, None] & mmask[None, :]
    wsp = ws_ptr + rm[None, :] * N + rn[:, None]
    cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
    if ACT:
        if SPLIT == 1:
            _store_silu_mul(acc, out_ptr, stride_om, pid_n, rm, N, M, BN, BM)
        elif split_add(acc, mask, wsp, cnt, SPLIT):
            _store_silu_mul(split_take(acc, mask, wsp, cnt), out_ptr, stride_om, pid_n, rm, N, M, BN, BM)
    else:
        store_out(acc, out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None], mask, wsp, cnt, SPLIT)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, o_ptr, out_ptr, N, K, ONE, BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
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
            w = field_f(words, gi * JPG + jj, BITS, ONE) * s[None, :] + o[None, :]
            k = t * 128 + (gi * JPG + jj) * C + rc
            tl.store(
                out_ptr + rn[None, :].to(tl.int64) * K + k[:, None],
                w.to(out_ptr.dtype.element_ty),
                mask=nmask[None, :] & (k < K)[:, None],
            )


def w4a16_mm(
    x,
    qweight,
    scales,
    offsets,
    bits,
    group,
    N,
    K,
    out_dtype=None,
    bm=None,
    bn=None,
    num_warps=None,
    split_k=None,
    num_stages=None,
    target=None,
):
    """`x` `[M, K]` @ W.T -> `[M, N]` with the fused dequantize + `tl.dot` kernel: one program per (N-block, K-split,
    M-block of up to 64 rows), so each weight tile is read once per 64 rows."""
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    x = x.contiguous()
    tiles = Kp // TILE_K
    b = m_bucket(M)
    small = bits == 4 and G < TILE_K
    T = configs_for('w4a16_mm', x.device)
    cfg = T['small_group'] if small else T['shapes'].get((N, K, bits, b), T['default'][b])
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(
        x, N, tiles, cfg, bm, bn, num_warps, num_stages, split_k, target, out_dtype
    )
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    _mm_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x,
        qweight,
        scales,
        offsets,
        out,
        ws,
        cnt,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        tiles // split_k,
        F32_ONE,
        BITS=bits,
        G=G,
        BM=bm,
        BN=bn,
        EVEN_K=K == Kp,
        EVEN_N=N % bn == 0,
        SPLIT=split_k,
        PREC=prec,
        PERGROUP=not (small or (bits == 8 and x.dtype == torch.bfloat16)),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def tc_supported(x, bits, group, K) -> bool:
    "Whether `_tc_kernel` takes this call: 4-bit, groups of >= 128 (one per K-tile, or per channel), 16-bit x."
    Kp = padded_k(K)
    G = Kp if group in (-1, None) or group >= Kp else group
    return bits == 4 and G % TILE_K == 0 and x.dtype in (torch.float16, torch.bfloat16)


def w4a16_tc(
    x,
    qweight,
    scales,
    offsets,
    bits,
    group,
    N,
    K,
    out_dtype=None,
    bm=None,
    bn=None,
    num_warps=None,
    num_stages=None,
    split_k=None,
    target=None,
    pdl=None,
    asm=None,
    sym=False,
    act=None,
):
    """`x` `[M, K]` (16-bit) @ W.T -> `[M, N]` with the tensor-core kernel `_tc_kernel` (4-bit, groups >= 128): one
    program per (N-block, K-split, block of `bm` rows; configs per row bucket). `asm`: the inline-PTX
    dequantization (default: on a GPU); `sym`: `offsets == -8 * scales` (the offsets are then not read).
    `act='silu_and_mul'`: W's rows interleave gate and up; returns `silu(gate) * up` `[M, N / 2]` from the fp32
    sums (no activation kernel, half the output written)."""
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    if not tc_supported(x, bits, group, K):
        raise ValueError(
            f'_tc_kernel needs 4-bit weights, groups >= 128 and 16-bit x; got {bits}-bit, group {group}, {x.dtype}'
        )
    x = x.contiguous()
    tiles = Kp // TILE_K
    b = m_bucket(M)
    T = configs_for('w4a16_tc', x.device)
    cfg = T['shapes'].get((N, K, b), T['default'])
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(
        x, N, tiles, cfg, bm, bn, num_warps, num_stages, split_k, target, out_dtype
    )
    if cfg.get('sym') is False:
        sym = False  # a config may keep the general path for symmetric layers
    if act is not None:
        if act != 'silu_and_mul' or N % 2 or bn % 2:
            raise ValueError(f"act={act!r}: 'silu_and_mul' over an even N")
        out = torch.empty(M, N // 2, dtype=out_dtype or x.dtype, device=x.device)
    _tc_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x,
        qweight,
        scales,
        offsets,
        out,
        ws,
        cnt,
        M,
        N,
        K,
        x.stride(0),
        out.stride(0),
        tiles // split_k,
        F32_ONE,
        G=G,
        BM=bm,
        BN=bn,
        EVEN_K=K == Kp,
        EVEN_N=N % bn == 0,
        SPLIT=split_k,
        ASM=(not _INTERPRET) if asm is None else bool(asm),
        SYM=bool(sym),
        ACT=act is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kw(x.device, pdl),
    )
    return out


def w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=torch.float16, bn=None):
    "The weight `[N, K]` in `dtype`, written by the Triton dequantize kernel."
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    bn = bn or (16 if _INTERPRET else 64)
    out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    _dequant_kernel[(Kp // TILE_K, triton.cdiv(N, bn))](
        qweight, scales, offsets, out, N, K, F32_ONE, BITS=bits, G=G, BN=bn, num_warps=4
    )
    return out
