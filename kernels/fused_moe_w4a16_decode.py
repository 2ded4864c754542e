"""The decode path of `fused_moe_w4a16` for few tokens: two GEMV launches over only the selected W4A16 experts.

As `fused_moe_decode` does for 16-bit experts (no alignment, no padding rows, no separate activation or sum), with
the experts in the stacked packed layout of `fused_moe_w4a16`; `w4a16_moe_decode` launches them for
`fused_moe_w4a16` where the token count is at most `DECODE_MAX_T` and the config has a `decode` entry:

    launch 1  _w4a16_gemv_act_kernel   grid (ceil(I / BN1), T*k)
              program (n, a): gate rows n..n+BN1 of w13[e] (e = ids[a]), up rows I on -> inter[a, n..] = silu(g) * u
    launch 2  _w4a16_gemv_down_kernel  grid (ceil(H / BN2), SPLIT2, T)
              program (n, s, t): columns n..n+BN2 of w2[e] for the k / SPLIT2 experts of split s
              out[t, n..] = sum_j tw[t, j] * (down_e . inter[t*k + j])  (splits meet in `split_k`'s workspace)

Per 128-wide K-tile a program loads the `[C, BN]` words once (C = 4 * BITS word rows) and `_gemv_tile` turns each
bit field into fp32 weights (`field_f`, then `W = S f + B` with the group's `S`, `B` from `group_sb`) multiplied by
the field's run of x into an fp32 `[C, BN]` register tile, reduced over the rows once, after the K loop. The router
weight scales x of the down GEMV, so a token's experts share one register tile. `group_sb` is shared with the
grouped GEMM kernel of `fused_moe_w4a16`.
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.split_k import split_k_workspace, store_out
from cvllm_lab.kernels.w4a16_fields import F32_ONE, field_f
from cvllm_lab.kernels.w4a16_layout import TILE_K

__all__ = ['group_sb', 'w4a16_moe_decode']

TK = tl.constexpr(TILE_K)  # the K-tile, as a global the kernels may read


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def group_sb(s_ptrs, o_ptrs, go, NW, BITS: tl.constexpr):
    "The group's `S = 2**BITS scale` and `B = offset - S` (fp32 `[BLOCK_N]`): `W = S f + B` for `f = field_f`."
    s = tl.load(s_ptrs + go * NW).to(tl.float32) * (1 << BITS)
    return s, tl.load(o_ptrs + go * NW).to(tl.float32) - s


@triton.jit
def _gemv_tile(
    acc,
    xp,
    words,
    s,
    b,
    t,
    K,
    ONE,
    BITS: tl.constexpr,
    EVEN_K: tl.constexpr,
    G: tl.constexpr,
    s_ptrs,
    o_ptrs,
    NW,
    XSCALE,
):
    "acc [C, BN] += W_e[n, k].T * x[k] * XSCALE over the K-tile `t` (fields of `words`, dequantized in fp32)."
    C: tl.constexpr = 4 * BITS
    rc = tl.arange(0, C)
    for j in tl.static_range(32 // BITS):
        k0 = t * TK + j * C
        if G < TK:
            s, b = group_sb(s_ptrs, o_ptrs, k0 // G, NW, BITS)
        if EVEN_K:
            xv = tl.load(xp + k0 + rc).to(tl.float32)
        else:
            xv = tl.load(xp + k0 + rc, mask=k0 + rc < K, other=0.0).to(tl.float32)
        acc += (field_f(words, j, BITS, ONE) * s[None, :] + b[None, :]) * (xv * XSCALE)[:, None]
    return acc


@triton.jit
def _w4a16_gemv_act_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    ids_ptr,
    out_ptr,
    I,
    K,
    NW,
    ONE,
    stride_xm,
    stride_om,
    stride_qe,
    stride_se,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    "out[a, n] = silu(gate_e[n] . x[a // TOP_K]) * (up_e[n] . x[a // TOP_K]) for BN columns n, e = ids[a]."
    C: tl.constexpr = 4 * BITS
    a = tl.program_id(1)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = rn % I
    rc = tl.arange(0, C)
    e = tl.load(ids_ptr + a).to(tl.int64)
    wp = qw_ptr + e * stride_qe + rc[:, None] * NW + cols[None, :]
    sp = s_ptr + e * stride_se + cols
    op = o_ptr + e * stride_se + cols
    xp = x_ptr + (a // TOP_K).to(tl.int64) * stride_xm
    acc_g = tl.zeros([C, BN], dtype=tl.float32)
    acc_u = tl.zeros([C, BN], dtype=tl.float32)
    s = tl.zeros([BN], dtype=tl.float32)
    b = s
    s2 = s
    b2 = s
    for t in range(0, tl.cdiv(K, TK)):
        if G >= TK:
            s, b = group_sb(sp, op, (t * TK) // G, NW, BITS)
            s2, b2 = group_sb(sp + I, op + I, (t * TK) // G, NW, BITS)
        g = tl.load(wp + t * C * NW, eviction_policy='evict_first')
        u = tl.load(wp + t * C * NW + I, eviction_policy='evict_first')
        acc_g = _gemv_tile(acc_g, xp, g, s, b, t, K, ONE, BITS, EVEN_K, G, sp, op, NW, 1.0)
        acc_u = _gemv_tile(acc_u, xp, u, s2, b2, t, K, ONE, BITS, EVEN_K, G, sp + I, op + I, NW, 1.0)
    gate = tl.sum(acc_g, axis=0)
    y = gate * tl.sigmoid(gate) * tl.sum(acc_u, axis=0)
    tl.store(out_ptr + a.to(tl.int64) * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=rn < I)


@triton.jit
def _w4a16_gemv_down_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    ids_ptr,
    tw_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    ONE,
    stride_am,
    stride_om,
    stride_qe,
    stride_se,
    TOP_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[t, n] = sum over this split's experts j of tw[t, j] * (down_e[n] . inter[t * TOP_K + j]) for BN columns
    n; the SPLIT programs of a (token, column block) add up in the `split_k` workspace."""
    C: tl.constexpr = 4 * BITS
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    cols = rn % N
    rc = tl.arange(0, C)
    acc = tl.zeros([C, BN], dtype=tl.float32)
    s = tl.zeros([BN], dtype=tl.float32)
    b = s
    for jj in range(TOP_K // SPLIT):
        a = t * TOP_K + pid_s * (TOP_K // SPLIT) + jj
        e = tl.load(ids_ptr + a).to(tl.int64)
        wt = tl.load(tw_ptr + a)
        wp = qw_ptr + e * stride_qe + rc[:, None] * N + cols[None, :]
        sp = s_ptr + e * stride_se + cols
        op = o_ptr + e * stride_se + cols
        xp = a_ptr + a.to(tl.int64) * stride_am
        for kt in range(0, tl.cdiv(K, TK)):
            if G >= TK:
                s, b = group_sb(sp, op, (kt * TK) // G, N, BITS)
            words = tl.load(wp + kt * C * N, eviction_policy='evict_first')
            acc = _gemv_tile(acc, xp, words, s, b, kt, K, ONE, BITS, EVEN_K, G, sp, op, N, wt)
    store_out(
        tl.sum(acc, axis=0),
        out_ptr + t.to(tl.int64) * stride_om + rn,
        nmask,
        ws_ptr + t * N + rn,
        cnt_ptr + t * tl.num_programs(0) + pid_n,
        SPLIT,
    )


# ------------------------------------------------------------------------------------------------ host


def w4a16_moe_decode(x, w13, w2, tw, ids, bits, G, H, I, c):
    """The two GEMV launches of the decode path (`c`: a `decode` config), as `fused_moe_w4a16` prepares them: `x`
    `[T, H]` contiguous, `w13` / `w2` the contiguous `(qweight, scales, offsets)` of the stacked experts, `tw` fp32
    router weights and `ids` `[T, k]`, `G` the scale group (`check_layout`'s). Returns `out [T, H]` in x's dtype."""
    T, k = ids.shape
    inter = x.new_empty(T * k, I)
    _w4a16_gemv_act_kernel[(triton.cdiv(I, c['BN1']), T * k)](
        x,
        *w13,
        ids,
        inter,
        I,
        H,
        2 * I,
        F32_ONE,
        x.stride(0),
        inter.stride(0),
        w13[0].stride(0),
        w13[1].stride(0),
        TOP_K=k,
        BITS=bits,
        G=G,
        BN=c['BN1'],
        EVEN_K=H % TILE_K == 0,
        num_warps=c['W1'],
        num_stages=1,
    )
    split = c['SPLIT2'] if k % c['SPLIT2'] == 0 else 1
    out = x.new_empty(T, H)
    n_blocks = triton.cdiv(H, c['BN2'])
    ws, cnt = split_k_workspace(x.device, T * H, T * n_blocks)
    _w4a16_gemv_down_kernel[(n_blocks, split, T)](
        inter,
        *w2,
        ids,
        tw,
        out,
        ws,
        cnt,
        H,
        I,
        F32_ONE,
        inter.stride(0),
        out.stride(0),
        w2[0].stride(0),
        w2[1].stride(0),
        TOP_K=k,
        SPLIT=split,
        BITS=bits,
        G=G,
        BN=c['BN2'],
        EVEN_K=I % TILE_K == 0,
        num_warps=c['W2'],
        num_stages=1,
    )
    return out
