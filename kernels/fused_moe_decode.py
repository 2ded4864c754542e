"""The MoE decode path for few tokens: two GEMV launches, no sort, no alignment, no separate activation or sum.

With `T*k` small (a decode step of a few sequences), grouping assignments by expert buys nothing: almost every
(token, expert) pair is alone in its expert, and the grouped GEMM of `fused_moe` pays for it with the alignment
launch, 15 padding rows per 16-row tile, the `silu_and_mul` launch and the per-token sum. Here each assignment
`a = t * k + j` is its own row group and its expert `e = topk_ids[a]` is read straight from the router's output:

    launch 1  _moe_gemv_act_kernel   grid (ceil(I / BN1), T*k)
              program (n, a): rows n..n+BN1 of gate_e and of up_e  (both in w13[e]: gate rows, then up rows)
              g = gate_e @ x[t], u = up_e @ x[t]  ->  inter[a, n..] = silu(g) * u            [T*k, I]
    launch 2  _moe_gemv_down_kernel  grid (ceil(H / BN2), SPLIT2, T)
              program (n, s, t): rows n..n+BN2 of down_e for the k / SPLIT2 experts j of split s
              out[t, n..] = sum_j w_tj * (down_{e_tj} @ inter[t*k + j])                       [T, H]

Each program reads its weight rows once, as `[BN, BK]` tiles with BK contiguous (16-byte loads), multiplies them
by the broadcast activation into an fp32 `[BN, BK]` register tile and reduces across the tile once, after the K
loop (no tensor cores: at one row per assignment the bytes are the cost, not the FMAs). The router weight scales
the activation row before the down GEMV, so the k experts of a token accumulate into one register tile and the
top-k sum costs nothing. With `SPLIT2 > 1` the experts of a token are split over programs (more programs to fill
the SMs when T is 1), and the partial sums meet in `split_k`'s self-zeroing fp32 workspace: still one launch.

Launch sizes are data: the `decode` entry of a `configs/fused_moe` row (`BN1`, `BK1`, `W1` warps of launch 1;
`BN2`, `BK2`, `W2`, `SPLIT2` of launch 2). `fused_moe` takes this path where the row for the token bucket has one
(`benchmarks/kernels/tune_fused_moe.py` keeps it only where it beats the grouped GEMM).
"""

import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import split_k_workspace, store_out

__all__ = ['fused_moe_decode', 'DECODE_DEFAULT']
DECODE_DEFAULT = dict(BN1=16, BK1=256, W1=4, BN2=16, BK2=256, W2=4, SPLIT2=2)


@triton.jit
def _moe_gemv_act_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    I,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    "out[a, n] = silu(gate_e[n] . x[a // TOP_K]) * (up_e[n] . x[a // TOP_K]) for BN rows n, e = ids[a]."
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < I
    rn_c = tl.minimum(rn, I - 1)
    rk = tl.arange(0, BK)
    pdl_wait(PDL)  # the expert ids come from the router kernel
    pdl_launch(PDL)
    e = tl.load(ids_ptr + a).to(tl.int64)
    gp = w_ptr + e * stride_we + rn_c.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    up = gp + I * stride_wn
    xp = x_ptr + (a // TOP_K).to(tl.int64) * stride_xm + rk
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            xv = tl.load(xp + k0).to(tl.float32)
            g = tl.load(gp + k0, eviction_policy='evict_first')
            u = tl.load(up + k0, eviction_policy='evict_first')
        else:
            km = k0 + rk < K
            xv = tl.load(xp + k0, mask=km, other=0.0).to(tl.float32)
            g = tl.load(gp + k0, mask=km[None, :], other=0.0, eviction_policy='evict_first')
            u = tl.load(up + k0, mask=km[None, :], other=0.0, eviction_policy='evict_first')
        acc_g += g.to(tl.float32) * xv[None, :]
        acc_u += u.to(tl.float32) * xv[None, :]
    gate = tl.sum(acc_g, axis=1)
    y = gate * tl.sigmoid(gate) * tl.sum(acc_u, axis=1)
    tl.store(out_ptr + a.to(tl.int64) * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _moe_gemv_down_kernel(
    a_ptr,
    w_ptr,
    ids_ptr,
    tw_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, n] = sum over this split's experts j of tw[t, j] * (down_e[n] . inter[t * TOP_K + j]), BN rows n;
    the SPLIT programs of a (t, n-block) add up in the workspace (`store_out`)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BK)
    pdl_wait(PDL)
    pdl_launch(PDL)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for jj in range(TOP_K // SPLIT):
        a = t * TOP_K + pid_s * (TOP_K // SPLIT) + jj
        e = tl.load(ids_ptr + a).to(tl.int64)
        wt = tl.load(tw_ptr + a)
        wp = w_ptr + e * stride_we + rn_c.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        ap = a_ptr + a.to(tl.int64) * stride_am + rk
        for k0 in range(0, K, BK):
            if EVEN_K:
                xv = tl.load(ap + k0).to(tl.float32) * wt
                w = tl.load(wp + k0, eviction_policy='evict_first')
            else:
                km = k0 + rk < K
                xv = tl.load(ap + k0, mask=km, other=0.0).to(tl.float32) * wt
                w = tl.load(wp + k0, mask=km[None, :], other=0.0, eviction_policy='evict_first')
            acc += w.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    store_out(
        y,
        out_ptr + t.to(tl.int64) * stride_om + rn,
        nmask,
        ws_ptr + t * N + rn,
        cnt_ptr + t * tl.num_programs(0) + pid_n,
        SPLIT,
    )


def fused_moe_decode(x, w13, w2, topk_weights, topk_ids, cfg: dict | None = None, pdl=None):
    """`fused_moe` for few tokens in two GEMV launches (see the module docstring). `x [T, H]`, `w13 [E, 2I, H]`,
    `w2 [E, H, I]` in x's dtype, `topk_weights` fp32 `[T, k]` (already renormalized), `topk_ids [T, k]`;
    `cfg` overrides keys of `DECODE_DEFAULT`. Returns `[T, H]` in x's dtype."""
    c = {**DECODE_DEFAULT, **(cfg or {})}
    T, H = x.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    split = c['SPLIT2'] if k % c['SPLIT2'] == 0 else 1
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    tw = topk_weights.reshape(-1).float()
    tw = tw if tw.is_contiguous() else tw.contiguous()
    kw = pdl_kw(x.device, pdl)
    inter = x.new_empty(T * k, I)
    _moe_gemv_act_kernel[(triton.cdiv(I, c['BN1']), T * k)](
        x,
        w13,
        ids,
        inter,
        I,
        H,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        TOP_K=k,
        BN=c['BN1'],
        BK=c['BK1'],
        EVEN_K=H % c['BK1'] == 0,
        num_warps=c['W1'],
        num_stages=1,
        **kw,
    )
    out = x.new_empty(T, H)
    n_blocks = triton.cdiv(H, c['BN2'])
    ws, cnt = split_k_workspace(x.device, T * H, T * n_blocks)
    _moe_gemv_down_kernel[(n_blocks, split, T)](
        inter,
        w2,
        ids,
        tw,
        out,
        ws,
        cnt,
        H,
        I,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=k,
        SPLIT=split,
        BN=c['BN2'],
        BK=c['BK2'],
        EVEN_K=I % c['BK2'] == 0,
        num_warps=c['W2'],
        num_stages=1,
        **kw,
    )
    return out
