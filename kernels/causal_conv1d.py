"""The short causal depthwise conv1d of Gated DeltaNet / Mamba-style layers (Qwen3-Next, Qwen3.5) over the serving
engine's varlen batches, each sequence carrying a rolling conv state in a slot pool: the entry point
`causal_conv1d`, its per-sequence fp32 reference `causal_conv1d_ref` (the definition), and two Triton kernels.

Math (as `transformers`' `causal_conv1d_fn` / `causal_conv1d_update` in `models/qwen3_next`): C channels, kernel
width K (4 in the checkpoints), `weight [C, K]`, optional `bias [C]`. Sequence b's inputs are preceded by its K-1
previous inputs, the conv state (zeros for a fresh sequence), so that with `xin` = state ++ new tokens

    y[t, c] = act(bias[c] + sum_{j<K} w[c, j] * xin[t + j, c])        (t indexes the new tokens; act: None or SiLU)

and the new state is the last K-1 entries of `xin` (the old state's tail shifted in when a sequence brings fewer
than K-1 tokens).

Layout (one layer):
- `x [T, C]`: the step's tokens, sequence b's rows `query_start_loc[b]:query_start_loc[b+1]` (zero-length
  sequences allowed: padding). Any float dtype; may be a column slice of a wider projection (`x.stride(-1) == 1`).
- `conv_state [S, C, K-1]`: the pool, in the model dtype, any strides; sequence b owns slot `state_idx[b]`
  (a negative index is a padding entry: its state is neither read nor written). `has_initial_state[b]` False
  reads zeros instead of the slot (a fresh prompt into a recycled slot).
- `y [T, C]` in x's dtype. Accumulation is fp32; the state is stored in the pool's dtype.

Kernels (one entry point, `causal_conv1d`, picks by the `max_query_len` bound):

| batch                         | kernel               | grid                                     | one program       |
|-------------------------------|----------------------|------------------------------------------|-------------------|
| decode (`max_query_len` <= 1) | _conv_update_kernel  | `(num_seqs, C / BLOCK_C)`                | 1 token x BLOCK_C |
| prefill / mixed               | _conv_prefill_kernel | `(T // BLOCK_T + num_seqs, C / BLOCK_C)` | BLOCK_T x BLOCK_C |

The update program is a K-wide dot over state ++ x, then the state shifted by one. A prefill program is BLOCK_T
tokens of one sequence (the grid has a few idle ones); a sequence's first tile also writes its new state.

Both grids depend only on T, the number of sequences and C; lengths, slots and flags are read on the device, so
decode (given `max_query_len=1`) needs no host sync and can be captured in a CUDA graph. Without the bound, the
entry point reads it from `query_start_loc` (one sync).

Data flow: `causal_conv1d(x, weight, bias, query_start_loc, conv_state, state_idx, has_initial_state)` -> path
(`max_query_len`) -> one launch -> `y [T, C]`, and each sequence's slot of `conv_state` rewritten in place.

Speculative decoding (`state_out_idx [B, P]` int32, notebook 51g): the state after token j of sequence b (the last
K-1 entries of `xin[: K-1+j+1]`) is also written to slot `state_out_idx[b, j]` (j < P; negative: none), by
`_conv_states_kernel` launched before the conv (it reads the old state, which the conv then overwrites), so a
verification step of 1 + k tokens leaves the state after every position.

The prefill kernel maps program `tile` to (sequence, token tile) as `paged_attention_kernel` does: sequence b's tiles
start at `query_start_loc[b] // BLOCK_T + b` (monotone, with room for its ceil(len / BLOCK_T) tiles), found by a
binary search. Each token's output is independent of the others (the window is K loads of the tile shifted by one
row each, the first K-1 rows of a sequence taking the state instead of x), so tiles run in parallel; the shifted
loads of x hit L1. Only the sequence's first tile reads the old state, so the state write belongs to that tile too:
any other tile writing it could overwrite the state before tile 0 read it.
"""

import torch
import triton
import triton.language as tl

__all__ = [
    'causal_conv1d',
    'causal_conv1d_ref',
    'conv_states_ref',
    'PREFILL_BLOCK_T',
    'PREFILL_BLOCK_C',
    'UPDATE_BLOCK_C',
]

PREFILL_BLOCK_T = 32  # tokens per prefill tile (>= K-1: only a sequence's first tile reaches into the state)
PREFILL_BLOCK_C = 128  # channels per prefill tile: [32, 128] fp32 is 32 registers a thread at 4 warps
UPDATE_BLOCK_C = 256  # channels per decode program: the work is tiny, fewer programs per sequence
_ACTIVATIONS = (None, 'silu', 'swish')  # swish is SiLU (the name some configs use)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def conv_states_ref(x, query_start_loc, conv_state, state_idx, has_initial_state, state_out_idx):
    "The state after each token j of sequence b into slot `state_out_idx[b, j]` (the old states are read, not written)."
    K1 = conv_state.shape[-1]
    qsl, slots, init, outs = (t.tolist() for t in (query_start_loc, state_idx, has_initial_state, state_out_idx))
    for i, slot in enumerate(slots):
        s, e = qsl[i], qsl[i + 1]
        prev = conv_state[slot].float() if (init[i] and slot >= 0) else x.new_zeros(x.shape[1], K1, dtype=torch.float32)
        xin = torch.cat([prev, x[s:e].float().T], dim=1)
        for j, o in enumerate(outs[i][: e - s]):
            if o >= 0:
                conv_state[o] = xin[:, j + 1 : j + 1 + K1].to(conv_state.dtype)


def causal_conv1d_ref(
    x,
    weight,
    bias,
    query_start_loc,
    conv_state,
    state_idx,
    has_initial_state,
    activation='silu',
    max_query_len=None,
    state_out_idx=None,
):
    """The definition: one sequence at a time in fp32 (`F.conv1d` over state ++ inputs). Returns `y [T, C]` in x's
    dtype and writes each sequence's new state (last K-1 inputs) into its slot of `conv_state`, in its dtype.
    Zero-length sequences touch nothing; a negative slot reads zeros and is not written. `max_query_len` is
    accepted for parity with `causal_conv1d` and not needed here."""
    assert activation in _ACTIVATIONS, activation
    T, C = x.shape
    K = weight.shape[-1]
    w = weight.reshape(C, 1, K).float()
    b = None if bias is None else bias.float()
    y = torch.zeros(T, C, dtype=x.dtype, device=x.device)
    if state_out_idx is not None:
        conv_states_ref(x, query_start_loc, conv_state, state_idx, has_initial_state, state_out_idx)
    qsl, slots, init = query_start_loc.tolist(), state_idx.tolist(), has_initial_state.tolist()
    for i, slot in enumerate(slots):
        s, e = qsl[i], qsl[i + 1]
        if e == s:
            continue
        prev = conv_state[slot].float() if (init[i] and slot >= 0) else x.new_zeros(C, K - 1, dtype=torch.float32)
        xin = torch.cat([prev, x[s:e].float().T], dim=1)  # [C, K-1+L]
        o = torch.nn.functional.conv1d(xin[None], w, b, groups=C)[0]  # [C, L]
        if activation is not None:
            o = torch.nn.functional.silu(o)
        y[s:e] = o.T.to(x.dtype)
        if slot >= 0:
            conv_state[slot] = xin[:, -(K - 1) :].to(conv_state.dtype)
    return y


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

# per-step metadata: may be views into the runner's persistent buffers at any offset, so no alignment
# specialization (one binary whatever the offset)
_META = ['qsl_ptr', 'idx_ptr', 'init_ptr']


@triton.jit(do_not_specialize=['num_seqs'] + _META, do_not_specialize_on_alignment=_META)
def _conv_prefill_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    state_ptr,
    qsl_ptr,  # [num_seqs + 1] int32
    idx_ptr,  # [num_seqs] int32 slot (negative: padding, no state)
    init_ptr,  # [num_seqs] has_initial_state, as uint8
    num_seqs,
    C,
    stride_xt,
    stride_yt,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,  # kernel width
    STATE_P: tl.constexpr,  # K-1 rounded up to a power of 2
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tile = tl.program_id(0)
    cb = tl.program_id(1)

    # --- which sequence and which of its token tiles (binary search, as in paged_attention_kernel) -------------
    lo = tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_T + mid <= tile:
            lo = mid
        else:
            hi = mid
    seq = lo
    start = tl.load(qsl_ptr + seq)
    seq_len = tl.load(qsl_ptr + seq + 1) - start
    t0 = (tile - (start // BLOCK_T + seq)) * BLOCK_T  # first token of the tile, within the sequence

    if t0 < seq_len:  # else an idle program (the grid has a few spare tiles; zero-length sequences get one)
        slot = tl.load(idx_ptr + seq).to(tl.int64)
        use_state = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
        # the state's positions are p in [state_lo, 0): none without a state. Masks take this integer bound rather
        # than `& use_state`: the interpreter turns a scalar bool broadcast into a tensor into uint8, not a mask
        state_lo = -(K - 1) * use_state.to(tl.int32)
        offs_t = t0 + tl.arange(0, BLOCK_T)  # token positions within the sequence
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        x_seq = x_ptr + start.to(tl.int64) * stride_xt  # int64: T * stride can pass 2^31
        s_base = state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc

        if HAS_BIAS:
            acc = tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            acc = acc + tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        # tap j reads input position p = t - (K-1) + j: x at p >= 0, the state's entry K-1+p at p < 0 (only in
        # the sequence's first tile, as BLOCK_T >= K-1). The two masks are disjoint, so the sum is exact.
        for j in tl.static_range(K):
            p = offs_t - (K - 1) + j
            in_x = (p >= 0) & (p < seq_len)
            xv = tl.load(
                x_seq + p[:, None].to(tl.int64) * stride_xt + offs_c[None, :], mask=in_x[:, None] & c_ok, other=0.0
            )
            in_s = (p < 0) & (p >= state_lo)
            sv = tl.load(s_base + (p + (K - 1))[:, None] * stride_sk, mask=in_s[:, None] & c_ok[None, :], other=0.0)
            wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        y_ptrs = y_ptr + (start + offs_t)[:, None].to(tl.int64) * stride_yt + offs_c[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_t < seq_len)[:, None] & c_ok[None, :])

        # --- the new state: the last K-1 inputs of state ++ x (tile 0 only: the one program that reads the old) ---
        if (t0 == 0) & (slot >= 0):
            i = tl.arange(0, STATE_P)
            i_ok = i < K - 1
            # source position, q >= -(K-2) as seq_len >= 1 (a new name: Triton keeps one type per name across a branch)
            q = seq_len - (K - 1) + i
            from_x = (q >= 0) & i_ok
            xq = tl.load(x_seq + q[:, None].to(tl.int64) * stride_xt + offs_c[None, :], mask=from_x[:, None] & c_ok)
            from_s = (q < 0) & (q >= state_lo) & i_ok
            sq = tl.load(s_base + (q + (K - 1))[:, None] * stride_sk, mask=from_s[:, None] & c_ok[None, :], other=0.0)
            new = tl.where(from_x[:, None], xq.to(state_ptr.dtype.element_ty), sq.to(state_ptr.dtype.element_ty))
            # the shift moves entries between threads: every read of the old state above (the taps', these) must
            # land before any thread overwrites it
            tl.debug_barrier()
            tl.store(s_base + i[:, None] * stride_sk, new, mask=i_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=_META, do_not_specialize_on_alignment=_META)
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    state_ptr,
    qsl_ptr,
    idx_ptr,
    init_ptr,
    C,
    stride_xt,
    stride_yt,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,
    STATE_P: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    seq_len = tl.load(qsl_ptr + seq + 1) - start
    if seq_len > 0:  # one token (the launcher's bound); zero: a padding entry of a captured batch
        slot = tl.load(idx_ptr + seq).to(tl.int64)
        use_state = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        s_ok = offs_c < C * use_state.to(tl.int32)  # c_ok & use_state (as an integer bound: see the prefill kernel)
        s_base = state_ptr + slot * stride_ss + offs_c * stride_sc
        w_base = w_ptr + offs_c * stride_wc

        # the dot in the prefill kernel's order (bias, then taps 0..K-1), so that decoding a token gives what
        # prefilling it would, up to the compiler's contractions
        if HAS_BIAS:
            acc = tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(K - 1):
            sv = tl.load(s_base + j * stride_sk, mask=s_ok, other=0.0).to(tl.float32)
            acc += sv * tl.load(w_base + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + start.to(tl.int64) * stride_xt + offs_c, mask=c_ok, other=0.0)
        acc += xv.to(tl.float32) * tl.load(w_base + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + start.to(tl.int64) * stride_yt + offs_c, acc.to(y_ptr.dtype.element_ty), mask=c_ok)

        if slot >= 0:
            # shift by one: entry i takes old entry i+1, the last takes x
            i = tl.arange(0, STATE_P)
            i_ok = i < K - 1
            sh = tl.load(
                s_base[None, :] + (i + 1)[:, None] * stride_sk, mask=(i + 1 < K - 1)[:, None] & s_ok[None, :], other=0.0
            ).to(state_ptr.dtype.element_ty)
            new = tl.where((i == K - 2)[:, None], xv.to(state_ptr.dtype.element_ty)[None, :], sh)
            tl.debug_barrier()  # entries move between threads: all reads of the old state before any write
            tl.store(s_base[None, :] + i[:, None] * stride_sk, new, mask=i_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=['P'] + _META, do_not_specialize_on_alignment=_META)
def _conv_states_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    idx_ptr,
    init_ptr,
    out_idx_ptr,  # [num_seqs, P] int32
    C,
    P,
    stride_xt,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_oi,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    seq_len = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    use_state = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    s_ok = offs_c < C * use_state.to(tl.int32)  # c_ok & use_state, as an integer bound (see the prefill kernel)
    s_base = state_ptr + slot * stride_ss + offs_c * stride_sc
    x_seq = x_ptr + start.to(tl.int64) * stride_xt + offs_c
    for j in range(0, tl.minimum(seq_len, P)):
        o_slot = tl.load(out_idx_ptr + seq * stride_oi + j).to(tl.int64)
        o_ok = offs_c < C * (o_slot >= 0).to(tl.int32)
        for i in tl.static_range(K - 1):  # entry i after token j: xin[j + 1 + i], xin = old state ++ x
            p = j + 1 + i - (K - 1)  # < 0: the old state's entry K-1+p, else x row p
            from_x = offs_c < C * (p >= 0).to(tl.int32)
            from_s = offs_c < C * (p < 0).to(tl.int32)
            xv = tl.load(x_seq + tl.maximum(p, 0).to(tl.int64) * stride_xt, mask=from_x, other=0.0)
            sv = tl.load(s_base + tl.maximum(p + (K - 1), 0) * stride_sk, mask=from_s & s_ok, other=0.0)
            v = tl.where(from_x, xv.to(state_ptr.dtype.element_ty), sv.to(state_ptr.dtype.element_ty))
            tl.store(state_ptr + o_slot * stride_ss + offs_c * stride_sc + i * stride_sk, v, mask=o_ok & c_ok)


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def causal_conv1d(
    x,
    weight,
    bias,
    query_start_loc,
    conv_state,
    state_idx,
    has_initial_state,
    activation='silu',
    max_query_len=None,
    state_out_idx=None,
) -> torch.Tensor:
    """Causal depthwise conv1d of a varlen batch with per-sequence rolling states (the module docstring has the
    layout). `x [T, C]` (any float dtype, `x.stride(-1) == 1`), `weight [C, K]`, `bias [C]` or None,
    `query_start_loc [B+1]` int32, `conv_state [S, C, K-1]`, `state_idx [B]` int32, `has_initial_state [B]` bool,
    `activation` None or 'silu'. `max_query_len`: a host-side bound on the sequences' lengths (it must not be
    below the longest); 1 takes the decode kernel without a sync, None reads the bound from `query_start_loc`.
    `state_out_idx [B, P]` int32: the state after token j of sequence b also into slot `state_out_idx[b, j]`.
    Returns `y [T, C]` in x's dtype; each sequence's slot of `conv_state` gets its new state in place."""
    assert activation in _ACTIVATIONS, activation
    assert x.dim() == 2 and x.stride(-1) == 1, 'x must be [T, C] with unit channel stride'
    T, C = x.shape
    assert weight.dim() == 2 and weight.shape[0] == C, 'weight must be [C, K]'
    K = weight.shape[1]
    assert K >= 2, 'a width-1 conv has no state'
    S = conv_state.shape[0]
    assert conv_state.shape == (S, C, K - 1), f'conv_state must be [S, {C}, {K - 1}], got {tuple(conv_state.shape)}'
    assert bias is None or bias.shape == (C,)
    B = state_idx.numel()
    assert query_start_loc.numel() == B + 1 and has_initial_state.numel() == B
    assert has_initial_state.dtype == torch.bool and state_idx.dtype == torch.int32
    assert state_idx.is_contiguous() and has_initial_state.is_contiguous() and query_start_loc.is_contiguous()
    assert PREFILL_BLOCK_T >= K - 1, 'a prefill tile past the first must not reach into the state'
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0 or B == 0:
        return y
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # host sync
    common = dict(K=K, STATE_P=triton.next_power_of_2(K - 1), HAS_BIAS=bias is not None, SILU=activation is not None)
    args = (x, weight, bias if bias is not None else weight, y, conv_state, query_start_loc, state_idx)
    init = has_initial_state.view(torch.uint8)  # as bytes, compared with 0 in the kernels (one pointer type)
    if state_out_idx is not None:  # before the conv, which overwrites the old states it reads
        assert state_out_idx.dtype == torch.int32 and state_out_idx.shape[0] == B and state_out_idx.stride(1) == 1
        _conv_states_kernel[(B, triton.cdiv(C, UPDATE_BLOCK_C))](
            x,
            conv_state,
            query_start_loc,
            state_idx,
            init,
            state_out_idx,
            C,
            state_out_idx.shape[1],
            x.stride(0),
            *conv_state.stride(),
            state_out_idx.stride(0),
            K=K,
            BLOCK_C=UPDATE_BLOCK_C,
        )
    strides = (x.stride(0), y.stride(0), *weight.stride(), *conv_state.stride())
    if max_query_len <= 1:
        grid = (B, triton.cdiv(C, UPDATE_BLOCK_C))
        _conv_update_kernel[grid](*args, init, C, *strides, BLOCK_C=UPDATE_BLOCK_C, **common)
    else:
        grid = (T // PREFILL_BLOCK_T + B, triton.cdiv(C, PREFILL_BLOCK_C))
        _conv_prefill_kernel[grid](
            *args, init, B, C, *strides, BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=PREFILL_BLOCK_C, **common
        )
    return y
