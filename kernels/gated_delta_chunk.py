"""The chunked (prefill) form of the gated delta rule in Triton: `chunk_gated_delta_rule`, three kernels over chunks
of `BT = 64` tokens. The entry point, the plain-PyTorch reference and the recurrent (decode) kernel are in
`gated_delta_rule`, which also states the recurrence and the batch layout.

The chunk algebra (one value head; a chunk's tokens t = 0..L-1, S0 its incoming state `[Dk, Dv]`, gamma_t = g_0 + ...
+ g_t the in-chunk cumulative log decay, q already normalized and scaled, k normalized). Unrolling the token recurrence
`S_t = e^{g_t} S_{t-1} + k_t d_t^T`, `d_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t)` inside the chunk gives

    S_t = e^{gamma_t} S0 + sum_{j<=t} e^{gamma_t - gamma_j} k_j d_j^T
    (I + A) D = diag(beta) V - diag(beta e^gamma) K S0,   A_ij = beta_i e^{gamma_i - gamma_j} k_i . k_j  (j < i)

so with the UT transform `Ai = (I + A)^-1` (unit lower triangular) the deltas are `D = U - W S0`, where
`U = Ai (beta V)` and `W = Ai (beta e^gamma K)` (the WY representation) do not depend on S0. Then

    o_t   = e^{gamma_t} S0^T q_t + sum_{j<=t} e^{gamma_t - gamma_j} (q_t . k_j) d_j
    S_L   = e^{gamma_{L-1}} S0 + sum_j e^{gamma_{L-1} - gamma_j} k_j d_j^T

Only the second line is sequential over chunks; everything else is per chunk, in parallel.

| kernel                    | grid                              | one program                                     |
|---------------------------|-----------------------------------|-------------------------------------------------|
| `gdn_chunk_wy_kernel`     | `(T // BT + B, Hv)`               | a chunk: gamma, A, Ai (forward substitution), W, U |
| `gdn_chunk_state_kernel`  | `(B, Hv, cdiv(Dv, BV))`           | a sequence's chunks in order: S0s, D, S_L       |
| `gdn_chunk_output_kernel` | `(T // BT + B, Hv, cdiv(Dv, BV))` | a chunk's outputs from its S0, D and q k^T      |

Chunks are cut per sequence from its first token. Sequence b's chunks are the global chunk tiles starting at
`qsl[b] // BT + b` (monotone in b, room for ceil(len / BT) tiles), so `T // BT + B` tiles cover any batch, a tile
finds its sequence by binary search over `query_start_loc`, and the buffers are sized from T and B: no host sync,
no per-step chunk index tensor. The tile index also names the chunk's slot in the `h` buffer of incoming states.

Data flow: q, k, v, g, beta -> `gdn_chunk_wy_kernel` -> gamma `[T, Hv]` fp32, W `[T, Hv, Dk]`, U `[T, Hv, Dv]` ->
`gdn_chunk_state_kernel` (state pool slot in, S0 per chunk -> h `[T // BT + B, Hv, Dk, Dv]`, D over U in place,
S_L -> slot) -> `gdn_chunk_output_kernel` -> o `[T, Hv, Dv]`.

q and k are L2-normalized in fp32 where they are loaded (each kernel loads whole Dk rows anyway), so no normalized
copy is written. Intermediates (W, U/D, h) are in the model's dtype, fp32 for fp32 models, whose dots then run in
IEEE fp32 (tf32 would cost the 1e-4 agreement with the fp32 reference); the solve, gamma, the carried state and all
accumulation are fp32. The state pass multiplies the carried state and the deltas as fp32 operands (tf32 on 16-bit
models), not rounded to bf16: it is a latency-bound chain, and that took a quarter off the bf16 state error.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

__all__ = ['chunk_gated_delta_rule', 'gdn_chunk_wy_kernel', 'gdn_chunk_state_kernel', 'gdn_chunk_output_kernel', 'BT']

BT = 64  # tokens per chunk
SB = 16  # the solve's diagonal blocks (`_solve_unit_lower`)


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _seq_of_tile(qsl_ptr, tile, num_seqs, BT: tl.constexpr):
    # sequence b's chunk tiles start at qsl[b] // BT + b: the last sequence whose first tile is <= `tile`
    lo = tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BT + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo, tile - (tl.load(qsl_ptr + lo) // BT + lo)


@triton.jit
def _rows(ptr, rows, row_ok, stride_t, offs_d, d_ok, L2NORM: tl.constexpr):
    # [BT, D_P] fp32 tile of a head's rows (`ptr` at the head), L2-normalized per row as transformers' l2norm
    x = tl.load(ptr + rows[:, None] * stride_t + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _dot(a, b, DT: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # a @ b with both operands rounded to the intermediates' dtype DT, accumulated in fp32; under the interpreter
    # 16-bit operands are multiplied as fp32 (it mis-multiplies bf16), after the same rounding
    a = a.to(DT)
    b = b.to(DT)
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _solve_unit_lower(A, BT: tl.constexpr, SB: tl.constexpr, LOG2_BLOCKS: tl.constexpr, PRECISION: tl.constexpr):
    # (I + A)^-1 for A [BT, BT] strictly lower, fp32. Split I + A = D + L, D block diagonal (blocks of SB), L the
    # blocks below them: (D + L)^-1 = (I + N')^-1 D^-1 with N' = D^-1 L nilpotent (N'^(BT/SB) = 0), so
    # (I + N')^-1 = prod_m (I + N^(2^m)), N = -N', m < log2(BT/SB): the terms of block forward substitution, in a
    # few tensor-core products instead of BT dependent steps (row-by-row substitution made this kernel 4x slower).
    offs = tl.arange(0, BT)
    sub = offs % SB  # row within its block
    same = (offs // SB)[:, None] == (offs // SB)[None, :]
    Ad = tl.where(same, A, 0.0)
    # D^-1 by forward substitution on all diagonal blocks at once: step i finishes row i of every block. As Ad and
    # D^-1 are block diagonal, one reduction gathers the BT/SB rows' coefficients (disjoint columns) and the next
    # gives row i of each block's update, each in its own block's columns.
    X = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    for i in range(1, SB):
        rows_i = (sub == i)[:, None]
        a = tl.sum(tl.where(rows_i, Ad, 0.0), 0)  # a[j] = Ad[row i of j's block, j]
        X = X - tl.where(rows_i & same, tl.sum(a[:, None] * X, 0)[None, :], 0.0)
    eye = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    N = -tl.dot(X, tl.where(same, 0.0, A), input_precision=PRECISION)
    M = eye + N
    P = N
    for _ in tl.static_range(LOG2_BLOCKS - 1):
        P = tl.dot(P, P, input_precision=PRECISION)
        M = tl.dot(M, eye + P, input_precision=PRECISION)
    return tl.dot(M, X, input_precision=PRECISION)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['num_seqs'])
def gdn_chunk_wy_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    qsl_ptr,
    gcum_ptr,  # out: gamma [T, Hv] fp32
    w_ptr,  # out: W [T, Hv, Dk]
    u_ptr,  # out: U [T, Hv, Dv]
    num_seqs,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    HV: tl.constexpr,
    HEADS_PER_K: tl.constexpr,  # Hv // Hk: value heads sharing a key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_P: tl.constexpr,
    DV_P: tl.constexpr,
    BT: tl.constexpr,
    SB: tl.constexpr,  # diagonal block of the solve
    LOG2_BLOCKS: tl.constexpr,  # log2(BT // SB)
    L2NORM: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seq, c = _seq_of_tile(qsl_ptr, tile, num_seqs, BT)
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    if c * BT < n:
        L = tl.minimum(n - c * BT, BT)  # tokens in this chunk
        DT: tl.constexpr = w_ptr.dtype.element_ty
        offs_t = tl.arange(0, BT)
        t_ok = offs_t < L
        rows = (start + c * BT + offs_t).to(tl.int64)
        offs_k = tl.arange(0, DK_P)
        offs_v = tl.arange(0, DV_P)
        k = _rows(k_ptr + (h // HEADS_PER_K) * stride_kh, rows, t_ok, stride_kt, offs_k, offs_k < DK, L2NORM)
        v = _rows(v_ptr + h * stride_vh, rows, t_ok, stride_vt, offs_v, offs_v < DV, False)
        # padded rows: g = 0 keeps gamma flat (no overflow below), beta = 0 zeroes their rows of A, W and U
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=t_ok, other=0.0).to(tl.float32)
        gam = tl.cumsum(g, 0)
        tl.store(gcum_ptr + rows * HV + h, gam, mask=t_ok)

        # A (strictly lower): beta_i e^{gamma_i - gamma_j} k_i . k_j; the exponent is selected before exp, since
        # above the diagonal it is >= 0 and may overflow
        lower = offs_t[:, None] > offs_t[None, :]
        decay = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0))
        kk = _dot(k, tl.trans(k), DT, DOT_F32, PRECISION)
        A = tl.where(lower, kk * beta[:, None] * decay, 0.0)

        Ai = _solve_unit_lower(A, BT, SB, LOG2_BLOCKS, PRECISION)

        w = _dot(Ai, k * (beta * tl.exp(gam))[:, None], DT, DOT_F32, PRECISION)
        u = _dot(Ai, v * beta[:, None], DT, DOT_F32, PRECISION)
        tl.store(w_ptr + (rows * HV + h)[:, None] * DK + offs_k[None, :], w.to(DT), mask=t_ok[:, None] & (offs_k < DK))
        tl.store(u_ptr + (rows * HV + h)[:, None] * DV + offs_v[None, :], u.to(DT), mask=t_ok[:, None] & (offs_v < DV))


@triton.jit(do_not_specialize=['stride_ss'])
def gdn_chunk_state_kernel(
    k_ptr,
    gcum_ptr,
    w_ptr,
    u_ptr,  # in: U; out: the deltas D = U - W S0, in place
    h_ptr,  # out: each chunk's incoming state [T // BT + B, Hv, Dk, Dv], at its chunk tile
    state_ptr,  # the pool [S, Hv, Dk, Dv] fp32: read (initial state), written (final state)
    qsl_ptr,
    state_idx_ptr,
    init_ptr,
    stride_kt,
    stride_kh,
    stride_ss,
    HV: tl.constexpr,
    HEADS_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_P: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)  # < 0: a padding entry, whose state is neither read nor written
    use_init = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    # the slot's rows to read and to write, as row limits: the interpreter cannot AND a scalar into a tensor mask
    k_read = tl.where(use_init, DK, 0)
    k_write = tl.where(slot >= 0, DK, 0)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_P)
    offs_v = vb * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    hv_mask = k_ok[:, None] & v_ok[None, :]
    hv_offs = offs_k[:, None] * DV + offs_v[None, :]
    s_ptrs = state_ptr + slot * stride_ss + h * (DK * DV) + hv_offs
    S = tl.load(
        s_ptrs, mask=(offs_k < k_read)[:, None] & v_ok[None, :], other=0.0
    )  # [DK_P, BV] fp32, carried over the chunks
    first = start // BT + seq  # the sequence's first chunk tile
    k_head = k_ptr + (h // HEADS_PER_K) * stride_kh
    for c in range(0, tl.cdiv(n, BT)):
        tl.store(h_ptr + ((first + c).to(tl.int64) * HV + h) * (DK * DV) + hv_offs, S.to(DT), mask=hv_mask)
        t_ok = c * BT + offs_t < n
        rows = (start + c * BT + offs_t).to(tl.int64)
        w = tl.load(w_ptr + (rows * HV + h)[:, None] * DK + offs_k[None, :], mask=t_ok[:, None] & k_ok, other=0.0)
        u_ptrs = u_ptr + (rows * HV + h)[:, None] * DV + offs_v[None, :]
        uv_mask = t_ok[:, None] & v_ok[None, :]
        d = tl.load(u_ptrs, mask=uv_mask, other=0.0).to(tl.float32) - tl.dot(
            w.to(tl.float32), S, input_precision=PRECISION
        )
        tl.store(u_ptrs, d.to(DT), mask=uv_mask)
        # S_L = e^{gamma_last} S0 + sum_j e^{gamma_last - gamma_j} k_j d_j^T
        gam = tl.load(gcum_ptr + rows * HV + h, mask=t_ok, other=0.0)
        g_last = tl.load(gcum_ptr + (start + tl.minimum(n, (c + 1) * BT) - 1).to(tl.int64) * HV + h)
        k = _rows(k_head, rows, t_ok, stride_kt, offs_k, k_ok, L2NORM)
        k = k * tl.where(t_ok, tl.exp(g_last - gam), 0.0)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k), d, input_precision=PRECISION)
    tl.store(s_ptrs, S, mask=(offs_k < k_write)[:, None] & v_ok[None, :])


@triton.jit(do_not_specialize=['num_seqs'])
def gdn_chunk_output_kernel(
    q_ptr,
    k_ptr,
    gcum_ptr,
    d_ptr,  # the deltas D [T, Hv, Dv]
    h_ptr,  # the chunks' incoming states
    o_ptr,
    qsl_ptr,
    scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    HV: tl.constexpr,
    HEADS_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_P: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    L2NORM: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    seq, c = _seq_of_tile(qsl_ptr, tile, num_seqs, BT)
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    if c * BT < n:
        DT: tl.constexpr = d_ptr.dtype.element_ty
        offs_t = tl.arange(0, BT)
        t_ok = c * BT + offs_t < n
        rows = (start + c * BT + offs_t).to(tl.int64)
        offs_k = tl.arange(0, DK_P)
        offs_v = vb * BV + tl.arange(0, BV)
        k_ok = offs_k < DK
        v_ok = offs_v < DV
        hk = h // HEADS_PER_K
        q = _rows(q_ptr + hk * stride_qh, rows, t_ok, stride_qt, offs_k, k_ok, L2NORM) * scale
        k = _rows(k_ptr + hk * stride_kh, rows, t_ok, stride_kt, offs_k, k_ok, L2NORM)
        gam = tl.load(gcum_ptr + rows * HV + h, mask=t_ok, other=0.0)
        S0 = tl.load(
            h_ptr + (tile.to(tl.int64) * HV + h) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :],
            mask=k_ok[:, None] & v_ok[None, :],
            other=0.0,
        )
        d = tl.load(d_ptr + (rows * HV + h)[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok, other=0.0)
        # o_t = e^{gamma_t} S0^T q_t + sum_{j<=t} e^{gamma_t - gamma_j} (q_t . k_j) d_j
        causal = offs_t[:, None] >= offs_t[None, :]
        qk = _dot(q, tl.trans(k), DT, DOT_F32, PRECISION)
        P = tl.where(causal, qk * tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0)
        o = _dot(q * tl.exp(gam)[:, None], S0, DT, DOT_F32, PRECISION) + _dot(P, d, DT, DOT_F32, PRECISION)
        tl.store(
            o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=t_ok[:, None] & v_ok[None, :],
        )


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------


def chunk_gated_delta_rule(
    q, k, v, g, beta, query_start_loc, state, state_idx, has_initial_state, scale, use_qk_l2norm, out
):
    """The chunked path of `gated_delta_rule` (arguments as there, checked there; `scale` resolved): writes `out`
    `[T, Hv, Dv]` and each sequence's final state into its slot. Launches depend on T, B and the head sizes only."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    B = state_idx.shape[0]
    dt = torch.float32 if v.dtype == torch.float32 else v.dtype
    dev = v.device
    DK_P = max(16, triton.next_power_of_2(Dk))
    DV_P = max(16, triton.next_power_of_2(Dv))
    BV = min(DV_P, 64)  # output tiles split Dv: more programs, fewer registers per program
    # the state pass is a chain of dependent chunk steps per program: narrower blocks, more chains in parallel
    BV_S = min(DV_P, 32)
    common = dict(
        HV=Hv,
        HEADS_PER_K=Hv // Hk,
        DK=Dk,
        DV=Dv,
        DK_P=DK_P,
        BT=BT,
        L2NORM=bool(use_qk_l2norm),
        DOT_F32=_INTERPRET and dt != torch.float32,
        PRECISION='ieee' if dt == torch.float32 else 'tf32',  # 'tf32' is ignored for 16-bit operands
    )
    n_tiles = T // BT + B
    gcum = torch.empty(T, Hv, dtype=torch.float32, device=dev)
    w = torch.empty(T, Hv, Dk, dtype=dt, device=dev)
    u = torch.empty(T, Hv, Dv, dtype=dt, device=dev)
    hbuf = torch.empty(n_tiles, Hv, Dk, Dv, dtype=dt, device=dev)
    gdn_chunk_wy_kernel[(n_tiles, Hv)](
        k,
        v,
        g,
        beta,
        query_start_loc,
        gcum,
        w,
        u,
        B,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        DV_P=DV_P,
        SB=SB,
        LOG2_BLOCKS=(BT // SB).bit_length() - 1,
        num_warps=4,
        **common,
    )
    gdn_chunk_state_kernel[(B, Hv, triton.cdiv(Dv, BV_S))](
        k,
        gcum,
        w,
        u,
        hbuf,
        state,
        query_start_loc,
        state_idx,
        has_initial_state,
        k.stride(0),
        k.stride(1),
        state.stride(0),
        BV=BV_S,
        num_warps=4,
        **common,
    )
    gdn_chunk_output_kernel[(n_tiles, Hv, triton.cdiv(Dv, BV))](
        q,
        k,
        gcum,
        u,
        hbuf,
        out,
        query_start_loc,
        scale,
        B,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        BV=BV,
        num_warps=4,
        **common,
    )
    return out
