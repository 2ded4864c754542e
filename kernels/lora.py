"""Multi-LoRA shrink and expand (the Punica SGMV idea): one batch, each token with its own adapter (or none).

A LoRA layer adds `scaling * x @ A^T @ B^T` to its base output, where `(A, B)` is the adapter of the token's request.
The adapters live in a slot pool: `A` `[slots, S*R, K]` (the A matrices of a layer's `S` output slices stacked,
each `R` = max-rank rows, zero rows past an adapter's rank) and `B` `[slots, N, R]` (scaling folded in; output
columns of slice `s` are `offsets[s]:offsets[s+1]`). A step's adapter indices (`-1`: no adapter) are turned once into
`lora_mapping`: the token ids sorted by slot and each slot's segment `(start, len)`. The kernels launch one grid
`(token blocks, column blocks, slots)`: a program loads the rows of its slot's segment (a gather), so each tile is
one dense matmul with one adapter's weights; programs past their segment's end return at once. Shapes depend only on
the batch size and the pool, so a CUDA graph captures them with the mapping as an input (persistent buffers).

- `lora_shrink`: `y[t, :] = x[t] @ A[slot(t)]^T` (fp32 `[T, S*R]`); rows of tokens without adapter are not written.
- `lora_expand`: `out[t, cols of s] += y[t, s*R:(s+1)*R] @ B[slot(t), cols of s]^T`, in place.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

__all__ = [
    'lora_mapping',
    'lora_shrink',
    'lora_expand',
    'lora_shrink_ref',
    'lora_expand_ref',
    'lora_delta_ref',
]


def lora_mapping(token_lora: torch.Tensor, num_slots: int, out=None):
    """`(sorted_ids, seg_start, seg_len)` of per-token slot indices `token_lora` `[T]` (-1: none): token ids ordered by
    slot (tokens without adapter first), and each slot's start in that order and its count (int32; fixed shapes, no
    host sync, so it can run inside a captured graph). `out`: three buffers to fill (`[T]`, `[slots]`, `[slots]`)."""
    idx = token_lora.long()
    order = torch.argsort(idx, stable=True)
    onehot = idx[None, :] == torch.arange(num_slots, device=idx.device)[:, None]
    seg_len = onehot.sum(1)
    seg_start = (idx < 0).sum() + torch.cumsum(seg_len, 0) - seg_len
    res = (order.int(), seg_start.int(), seg_len.int())
    if out is None:
        return res
    for b, r in zip(out, res):
        b.copy_(r)
    return out


# ------------------------------------------------------------------------------------------------ references


def lora_shrink_ref(x, A, token_lora):
    "`x` `[T, K]`, `A` `[slots, S*R, K]` -> fp32 `[T, S*R]`: `x[t] @ A[slot(t)]^T`, zero where `slot(t) < 0`."
    y = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)
    for s in token_lora.unique().tolist():
        if s >= 0:
            m = token_lora == s
            y[m] = x[m].float() @ A[s].float().T
    return y


def lora_expand_ref(y, B, token_lora, offsets, out):
    "`out[t, offsets[s]:offsets[s+1]] += y[t, s*R:(s+1)*R] @ B[slot(t), that slice]^T` in place (fp32 sums)."
    R = B.shape[2]
    for s in token_lora.unique().tolist():
        if s < 0:
            continue
        m = token_lora == s
        for j in range(len(offsets) - 1):
            c0, c1 = int(offsets[j]), int(offsets[j + 1])
            d = y[m, j * R : (j + 1) * R].float() @ B[s, c0:c1].float().T
            out[m, c0:c1] = (out[m, c0:c1].float() + d).to(out.dtype)
    return out


def lora_delta_ref(x, A, B, token_lora, offsets):
    """The LoRA term of every token at once, by gathering each token's own matrices (a formulation independent of the
    grouping): fp32 `[T, N]`, zero rows for tokens without adapter."""
    S, R = len(offsets) - 1, B.shape[2]
    s = token_lora.clamp(min=0).long()
    keep = (token_lora >= 0).float()[:, None]
    y = torch.einsum('tk,trk->tr', x.float(), A[s].float())  # [T, S*R]
    out = torch.zeros(x.shape[0], B.shape[1], device=x.device)
    for j in range(S):
        c0, c1 = int(offsets[j]), int(offsets[j + 1])
        out[:, c0:c1] = torch.einsum('tr,tnr->tn', y[:, j * R : (j + 1) * R], B[s, c0:c1].float())
    return out * keep


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    sorted_ptr,
    start_ptr,
    len_ptr,
    K,
    N,
    stride_x,
    stride_as,
    stride_an,
    stride_y,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_tok = tl.load(len_ptr + slot)
    if pid_m * BM < n_tok:  # programs past the slot's segment do nothing
        start = tl.load(start_ptr + slot)
        offs_m = pid_m * BM + tl.arange(0, BM)
        mmask = offs_m < n_tok
        rows = tl.load(sorted_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < K
            xt = tl.load(
                x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
            )
            at = tl.load(
                a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0
            )
            at = at.to(xt.dtype)
            if DOT_F32:  # the interpreter mis-multiplies 16-bit operands: multiply them as fp32
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc += tl.dot(xt, at, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    sorted_ptr,
    start_ptr,
    len_ptr,
    off_ptr,
    R,
    stride_y,
    stride_bs,
    stride_bn,
    stride_o,
    NS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m, pid_n, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, sl = z // NS, z % NS
    n_tok = tl.load(len_ptr + slot)
    c0 = tl.load(off_ptr + sl)
    c1 = tl.load(off_ptr + sl + 1)
    if (pid_m * BM < n_tok) & (c0 + pid_n * BN < c1):
        start = tl.load(start_ptr + slot)
        offs_m = pid_m * BM + tl.arange(0, BM)
        mmask = offs_m < n_tok
        rows = tl.load(sorted_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
        offs_n = c0 + pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < c1
        offs_r = tl.arange(0, BR)
        rmask = offs_r < R
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        bt = tl.load(
            b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=nmask[None, :] & rmask[:, None], other=0.0
        )
        yt = tl.load(
            y_ptr + rows[:, None] * stride_y + sl * R + offs_r[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0
        )
        yt = yt.to(bt.dtype)  # the shrink's fp32 sums rounded to the weights' dtype, as the base matmul's inputs
        if DOT_F32:
            yt, bt = yt.to(tl.float32), bt.to(tl.float32)
        d = tl.dot(yt, bt, input_precision=PREC)
        optr = out_ptr + rows[:, None] * stride_o + offs_n[None, :]
        omask = mmask[:, None] & nmask[None, :]
        o = tl.load(optr, mask=omask, other=0.0).to(tl.float32)
        tl.store(optr, (o + d).to(out_ptr.dtype.element_ty), mask=omask)


def _prec(dtype):
    "fp32 operands multiplied exactly (fp32 models are for checking); 16-bit ones on tensor cores."
    return 'ieee' if dtype == torch.float32 else 'tf32'


def _bm(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64


def lora_shrink(x, A, mapping, y=None):
    """Triton `lora_shrink_ref`: `x` `[T, K]`, `A` `[slots, S*R, K]`, `mapping` from `lora_mapping`; fp32 `[T, S*R]`
    (`y`: that buffer, rows of tokens without adapter left as they are)."""
    T, K = x.shape
    slots, N, _ = A.shape
    sorted_ids, seg_start, seg_len = mapping
    y = torch.zeros(T, N, dtype=torch.float32, device=x.device) if y is None else y
    if T == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    BM, BN = _bm(T), max(16, min(64, triton.next_power_of_2(N)))
    BK = max(16, min(128, triton.next_power_of_2(K)))
    grid = (triton.cdiv(T, BM), triton.cdiv(N, BN), slots)
    _lora_shrink_kernel[grid](
        x, A, y, sorted_ids, seg_start, seg_len, K, N, x.stride(0), A.stride(0), A.stride(1), y.stride(0),
        BM=BM, BN=BN, BK=BK, PREC=_prec(x.dtype), DOT_F32=_INTERPRET, num_warps=4,
    )  # fmt: skip
    return y


def lora_expand(y, B, mapping, offsets, out, max_slice: int | None = None):
    """Triton `lora_expand_ref`: `out` `[T, N]` += each token's slices of `y` `[T, S*R]` times its `B` `[slots, N, R]`
    (`offsets`: int32 `[S+1]` on the device, column starts of the slices; `max_slice`: the widest slice, default N)."""
    T = out.shape[0]
    slots, N, R = B.shape
    S = offsets.shape[0] - 1
    sorted_ids, seg_start, seg_len = mapping
    if T == 0:
        return out
    BM, BN, BR = _bm(T), 64, max(16, triton.next_power_of_2(R))
    grid = (triton.cdiv(T, BM), triton.cdiv(max_slice or N, BN), slots * S)
    _lora_expand_kernel[grid](
        y, B, out, sorted_ids, seg_start, seg_len, offsets, R, y.stride(0), B.stride(0), B.stride(1), out.stride(0),
        NS=S, BM=BM, BN=BN, BR=BR, PREC=_prec(B.dtype), DOT_F32=_INTERPRET, num_warps=4,
    )  # fmt: skip
    return out
