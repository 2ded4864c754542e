"""Gated DeltaNet (the linear-attention layers of Qwen3-Next / Qwen3.5) over the serving engine's varlen batches:
the entry point `gated_delta_rule`, its plain-PyTorch reference `gated_delta_rule_ref`, and the recurrent (decode)
Triton kernel. The chunked (prefill) kernels are in `gated_delta_chunk`.

The recurrence (transformers' `torch_recurrent_gated_delta_rule`), per value head with state S `[Dk, Dv]` fp32 and
per token t, q and k L2-normalized in fp32 (`x * rsqrt(sum(x*x) + 1e-6)`) when `use_qk_l2norm`, q times `scale`:

    S = S * exp(g_t);   d = beta_t * (v_t - S^T k_t);   S = S + k_t d^T;   o_t = S^T q_t

`g` is the log decay (<= 0), `beta` the write strength. Grouped heads: key/query head i serves the Hv / Hk
consecutive value heads i * Hv / Hk ... (transformers' `repeat_interleave`).

Layout: a step's tokens are packed along the first dimension: q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g, beta
`[T, Hv]`; sequence b owns rows `query_start_loc[b]:query_start_loc[b+1]`. The recurrent states live in a pool
`state [S, Hv, Dk, Dv]` fp32; sequence b's is slot `state_idx[b]`, read when `has_initial_state[b]` (else the
sequence starts from zeros: a prompt's first chunk) and overwritten with the state after its last token. A
negative slot marks a padding entry: it starts from zeros and its state is not written.

| kernel                    | module              | grid                          | one program                      |
|---------------------------|---------------------|-------------------------------|----------------------------------|
| `gdn_recurrent_kernel`    | here                | `(B, Hv, NV)`                 | a sequence's tokens, S in regs   |
| `gdn_chunk_wy_kernel`     | `gated_delta_chunk` | `(T // 64 + B, Hv)`           | a chunk's WY representation      |
| `gdn_chunk_state_kernel`  | `gated_delta_chunk` | `(B, Hv, NV)`                 | state passing over the chunks    |
| `gdn_chunk_output_kernel` | `gated_delta_chunk` | `(T // 64 + B, Hv, NV)`       | a chunk's outputs                |

(NV = cdiv(Dv, BV): programs split Dv into blocks, the columns of S being independent.)

Data flow: `gated_delta_rule(q, k, v, g, beta, query_start_loc, state, state_idx, has_initial_state)` -> path:
decode (every sequence one token: `max_query_len <= RECURRENT_MAX_QUERY_LEN`, or T == B when no bound is given)
-> `gdn_recurrent_kernel`; else -> `chunk_gated_delta_rule` (three launches) -> o `[T, Hv, Dv]` in v's dtype, and
the final states in their slots. Neither path syncs with the host: grids and buffers depend on T, B and the head
sizes only, so both can be captured in CUDA graphs.

Speculative decoding (`state_out_idx [B, P]` int32, notebook 51g): the state after token j of sequence b is also
written to slot `state_out_idx[b, j]` (j < P; a negative entry writes nothing), so that a verification step of
1 + k tokens leaves the state after every position and the engine keeps the one after the last accepted token.
A verification batch (`max_query_len` at most P) takes the recurrent kernel, outputs and states in one pass; a
batch with longer queries (a prefill chunk beside verifications) runs it first in a states-only mode (the first P
tokens of each sequence, nothing else written), then the usual path: the chunked form keeps no per-token states.

The recurrent kernel is decode's cost: each program reads its `[Dk, BV]` block of S once, carries it in registers
over the sequence's tokens (so it serves short multi-token queries correctly too) and writes it back once; the
per-token work is a few `Dk x BV` multiply-adds and two reductions. It is bandwidth-bound on the state (measured:
`results/NOTES.md`, stop 43).
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.gated_delta_chunk import chunk_gated_delta_rule

__all__ = ['gated_delta_rule', 'gated_delta_rule_ref', 'gdn_recurrent_kernel', 'RECURRENT_MAX_QUERY_LEN']

# batches whose longest query is at most this many tokens take the recurrent kernel (it is exact for any length;
# the chunked path wins once queries are long enough to feed its matrix products)
RECURRENT_MAX_QUERY_LEN = 1


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def _l2norm(x):
    "transformers' (and FLA's) l2norm, in the caller's dtype (fp32 here)."
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(
    q,
    k,
    v,
    g,
    beta,
    query_start_loc,
    state,
    state_idx,
    has_initial_state,
    scale=None,
    use_qk_l2norm=True,
    max_query_len=None,
    state_out_idx=None,
):
    """The definition: each sequence's tokens in order, in fp32, all heads at once, as transformers'
    `torch_recurrent_gated_delta_rule` computes them. Arguments and effects as `gated_delta_rule`; rows past
    `query_start_loc[-1]` are zero. `max_query_len` is accepted for parity and not needed."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    G = Hv // Hk
    out = torch.zeros(T, Hv, Dv, dtype=v.dtype, device=v.device)
    qsl, slots, init = query_start_loc.tolist(), state_idx.tolist(), has_initial_state.tolist()
    per_pos = None if state_out_idx is None else state_out_idx.tolist()
    for b, slot in enumerate(slots):
        s, e = qsl[b], qsl[b + 1]
        qb, kb = (x[s:e].float().repeat_interleave(G, 1) for x in (q, k))  # [n, Hv, Dk]
        if use_qk_l2norm:
            qb, kb = _l2norm(qb), _l2norm(kb)
        qb = qb / Dk**0.5 if scale is None else qb * scale  # transformers divides by sqrt(Dk)
        vb, gb, bb = v[s:e].float(), g[s:e].float(), beta[s:e].float()
        S = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
        if init[b] and slot >= 0:
            S = state[slot].float().clone()
        for t in range(e - s):
            S = S * gb[t].exp()[:, None, None]
            kv_mem = (S * kb[t][:, :, None]).sum(1)  # S^T k: [Hv, Dv]
            delta = (vb[t] - kv_mem) * bb[t][:, None]
            S = S + kb[t][:, :, None] * delta[:, None, :]
            out[s + t] = (S * qb[t][:, :, None]).sum(1).to(v.dtype)
            if per_pos is not None and t < len(per_pos[b]) and per_pos[b][t] >= 0:
                state[per_pos[b][t]] = S  # the state after token t (speculative decoding)
        if slot >= 0:
            state[slot] = S
    return out


# ---------------------------------------------------------------------------------------------------------------
# Recurrent kernel
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['stride_ss'])
def gdn_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    state_ptr,  # the pool [S, Hv, Dk, Dv] fp32, updated in place
    qsl_ptr,
    state_idx_ptr,
    init_ptr,
    out_idx_ptr,  # [B, P] int32: the slot that takes the state after token j (PER_POS only)
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_oi,
    P,
    HEADS_PER_K: tl.constexpr,  # Hv // Hk
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_P: tl.constexpr,
    BV: tl.constexpr,  # the program's block of Dv: a column block of S, independent of the others
    L2NORM: tl.constexpr,
    PER_POS: tl.constexpr,  # write the state after every token to its `out_idx` slot too
    STATES_ONLY: tl.constexpr,  # only those states, over the first P tokens: no outputs, no final state
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // HEADS_PER_K
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)  # < 0: padding, state neither read nor written
    use_init = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    # the slot's rows to read and to write, as row limits: the interpreter cannot AND a scalar into a tensor mask
    k_read = tl.where(use_init, DK, 0)
    k_write = tl.where(slot >= 0, DK, 0)

    offs_k = tl.arange(0, DK_P)
    offs_v = vb * BV + tl.arange(0, BV)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    s_off = h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s_ptrs = state_ptr + slot * stride_ss + s_off
    S = tl.load(s_ptrs, mask=(offs_k < k_read)[:, None] & v_ok[None, :], other=0.0)  # [DK_P, BV], read once

    # pointers walk the sequence's rows (64-bit pointer arithmetic: no int32 overflow of token * stride)
    row = start.to(tl.int64)
    p_q = q_ptr + row * stride_qt + hk * stride_qh + offs_k
    p_k = k_ptr + row * stride_kt + hk * stride_kh + offs_k
    p_v = v_ptr + row * stride_vt + h * stride_vh + offs_v
    p_g = g_ptr + row * stride_gt + h * stride_gh
    p_b = beta_ptr + row * stride_bt + h * stride_bh
    p_o = o_ptr + row * stride_ot + h * stride_oh + offs_v
    n = end - start
    if STATES_ONLY:
        n = tl.minimum(n, P)
    for t in range(0, n):
        q = tl.load(p_q, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(p_k, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(p_v, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(p_g).to(tl.float32)
        beta = tl.load(p_b).to(tl.float32)
        if L2NORM:  # every Dv block normalizes the whole of q and k: Dk values, not worth a pass of its own
            q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        S = S * tl.exp(g)
        d = (v - tl.sum(S * k[:, None], 0)) * beta  # beta (v - S^T k)
        S = S + k[:, None] * d[None, :]
        o = tl.sum(S * q[:, None], 0)  # S^T q
        if not STATES_ONLY:
            tl.store(p_o, o.to(p_o.dtype.element_ty), mask=v_ok)
        if PER_POS:  # the state after token t into its own slot (rows as a limit: see k_read)
            o_slot = tl.load(out_idx_ptr + seq * stride_oi + t, mask=t < P, other=-1).to(tl.int64)
            o_rows = tl.where(o_slot >= 0, DK, 0)
            tl.store(state_ptr + o_slot * stride_ss + s_off, S, mask=(offs_k < o_rows)[:, None] & v_ok[None, :])
        p_q += stride_qt
        p_k += stride_kt
        p_v += stride_vt
        p_g += stride_gt
        p_b += stride_bt
        p_o += stride_ot
    if not STATES_ONLY:
        tl.store(s_ptrs, S, mask=(offs_k < k_write)[:, None] & v_ok[None, :])  # written once


def _recurrent(q, k, v, g, beta, out, state, qsl, state_idx, init, scale, l2norm, out_idx, states_only):
    "One launch of `gdn_recurrent_kernel` (`out_idx`: keep per-position states; `states_only`: nothing else)."
    Hk, Dk = q.shape[1:]
    Hv, Dv = v.shape[1:]
    B = state_idx.shape[0]
    DK_P = max(16, triton.next_power_of_2(Dk))
    DV_P = max(16, triton.next_power_of_2(Dv))
    BV = _recurrent_bv(B, Hv, DV_P)
    per_pos = out_idx is not None
    gdn_recurrent_kernel[(B, Hv, triton.cdiv(Dv, BV))](
        q,
        k,
        v,
        g,
        beta,
        out,
        state,
        qsl,
        state_idx,
        init,
        out_idx if per_pos else state_idx,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        out_idx.stride(0) if per_pos else 0,
        out_idx.shape[1] if per_pos else 0,
        HEADS_PER_K=Hv // Hk,
        DK=Dk,
        DV=Dv,
        DK_P=DK_P,
        BV=BV,
        L2NORM=bool(l2norm),
        PER_POS=per_pos,
        STATES_ONLY=states_only,
        num_warps=4 if DK_P * BV >= 4096 else 2,
    )


def _recurrent_bv(B, Hv, DV_P):
    "Dv block of the recurrent kernel: 32, halved to 16 while the grid is under ~4 programs per SM of an H100."
    bv = min(DV_P, 32)
    if bv > 16 and B * Hv * triton.cdiv(DV_P, bv) < 512:
        bv = 16
    return bv


# ---------------------------------------------------------------------------------------------------------------
# gated_delta_rule
# ---------------------------------------------------------------------------------------------------------------


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    query_start_loc,
    state,
    state_idx,
    has_initial_state,
    scale=None,
    use_qk_l2norm=True,
    max_query_len=None,
    state_out_idx=None,
) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] (model dtype: fp32/fp16/bf16), g [T, Hv] fp32 (log decay, <= 0), beta [T, Hv]
    (any float dtype), query_start_loc [B+1] int32 (sequence b owns rows qsl[b]:qsl[b+1]), state [S, Hv, Dk, Dv]
    fp32 pool, state_idx [B] int32 (sequence b's slot), has_initial_state [B] bool (False: start from zeros, e.g. a
    prompt's first chunk). Returns o [T, Hv, Dv] in v's dtype; writes each sequence's final state into its slot.

    `scale` defaults to Dk ** -0.5. `max_query_len` is an optional host-side upper bound on the query lengths: at
    most `RECURRENT_MAX_QUERY_LEN` picks the recurrent kernel (without it, T == B does: every sequence one token).
    `state_out_idx [B, P]` int32 (speculative decoding): also write the state after token j of sequence b to slot
    `state_out_idx[b, j]` (negative: none); see the module docstring for the path it takes.
    Nothing here reads a device value on the host. Rows past `query_start_loc[-1]` are left unwritten. q, k, v,
    g, beta may be strided views (last dimension contiguous); a negative slot is a padding entry (see above)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    B = state_idx.shape[0]
    assert k.shape == q.shape and v.shape[0] == T and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == (T, Hv) and beta.shape == (T, Hv), (g.shape, beta.shape)
    assert state.dtype == torch.float32 and state.shape[1:] == (Hv, Dk, Dv), (state.dtype, state.shape)
    assert state[0].is_contiguous(), 'each slot must be contiguous: [Hv, Dk, Dv]'
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert query_start_loc.shape == (B + 1,) and has_initial_state.shape == (B,)
    scale = Dk**-0.5 if scale is None else float(scale)
    out = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    if T == 0 or B == 0:
        return out
    decode = max_query_len <= RECURRENT_MAX_QUERY_LEN if max_query_len is not None else T == B
    args = (q, k, v, g, beta, out, state, query_start_loc, state_idx, has_initial_state, scale, use_qk_l2norm)
    if state_out_idx is not None:
        assert state_out_idx.dtype == torch.int32 and state_out_idx.dim() == 2 and state_out_idx.shape[0] == B
        assert state_out_idx.stride(1) == 1
        if max_query_len is not None and max_query_len <= state_out_idx.shape[1]:  # a verification batch
            _recurrent(*args, state_out_idx, False)
            return out
        _recurrent(*args, state_out_idx, True)  # the kept states first: the pass below overwrites the old ones
    if not decode:
        return chunk_gated_delta_rule(
            q, k, v, g, beta, query_start_loc, state, state_idx, has_initial_state, scale, use_qk_l2norm, out
        )
    _recurrent(*args, None, False)
    return out
