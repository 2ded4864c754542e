"""Fused MoE with W4A16 experts: each expert's `w13` and `w2` in the packed layout of `w4a16_layout`, stacked.

The experts are the dense format's matrices with an expert axis in front (see `w4a16_layout` for one matrix):

| tensor | shape | holds |
|---|---|---|
| `w13_qweight` | int32 `[E, padded_k(H) * BITS / 32, 2I]` | expert e's `[2I, H]` gate rows then up rows, packed along K = H |
| `w13_scales`, `w13_offsets` | fp16 `[E, padded_k(H) / G, 2I]` | `W = scale * q + offset` per group of G along K |
| `w2_qweight` | int32 `[E, padded_k(I) * BITS / 32, H]` | expert e's `[H, I]` down matrix, packed along K = I |
| `w2_scales`, `w2_offsets` | fp16 `[E, padded_k(I) / G, H]` | the same |

The grouped path keeps `fused_moe`'s structure (assignments `a = t * k + j` aligned by expert with
`moe_align_block_size`, so every `BLOCK_M` block of `sorted_token_ids` belongs to one expert):

    launch 1  _w4a16_moe_kernel ACT   x[a // k] @ w13[e].T, gate and up columns of one tile -> inter [T*k, I] = silu(g) * u
    launch 2  _w4a16_moe_kernel       inter[a] @ w2[e].T * w_a                              -> out_k [T*k, H]
              out_k.view(T, k, H).sum(1)                                                    -> out   [T, H]

Per 128-wide K-tile a program loads the `[C, BLOCK_N]` words (C = 4 * BITS word rows, coalesced along N) once;
bit field `j` of them is the `[C, BLOCK_N]` slice `k = t*128 + j*C + c` of `W.T`, turned into floats by
`field_f` (`f = 1 + q / 2**BITS`, then `W = S f + B` with the group's `S = 2**BITS scale`, `B = offset - S`) and
handed to `tl.dot` in x's dtype against the `[BLOCK_M, C]` slice of the rows: only 4-bit words cross memory.

Few tokens (`T <= DECODE_MAX_T`) take the decode path instead, two GEMV launches over only the selected experts
as in `fused_moe_decode` (no alignment, no padding rows): launch 1 one program per (column block, assignment)
writing `silu(g) * u`, launch 2 one per (column block, expert split, token) summing its experts' router-weighted
down outputs in registers (splits meet in `split_k`'s self-zeroing workspace). Those kernels and their launches are
in `fused_moe_w4a16_decode`; this module holds the configs, the reference, the grouped kernel and the entry point.

Launch sizes are data, `CONFIGS` (first guesses keyed by the token count; tune on the GPU), overridable per call.
`fused_moe_w4a16_ref` is the plain-PyTorch reference: each used expert dequantized by `dequantize_packed_ref`,
a loop over experts in fp32.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cvllm_lab.kernels.fused_moe import moe_align_block_size
from cvllm_lab.kernels.fused_moe_w4a16_decode import group_sb, w4a16_moe_decode
from cvllm_lab.kernels.moe_sum import moe_sum
from cvllm_lab.kernels.w4a16_fields import F32_ONE, field_f
from cvllm_lab.kernels.w4a16_layout import TILE_K, check_layout, dequantize_packed_ref

__all__ = [
    'fused_moe_w4a16',
    'fused_moe_w4a16_ref',
    'dequantize_experts_w4a16',
    'w4a16_moe_config',
    'CONFIGS',
    'DECODE_MAX_T',
]
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

TK = tl.constexpr(TILE_K)  # the K-tile, as a global the kernels may read

DECODE_MAX_T = 4  # up to this many tokens: the GEMV decode path
# max tokens -> launch sizes (the first row whose bound is >= T); `decode`: the GEMV path's column blocks, warps
# and expert splits of launch 2
CONFIGS = {
    DECODE_MAX_T: dict(
        BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, decode=dict(BN1=32, W1=4, BN2=32, W2=4, SPLIT2=2)
    ),
    64: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3),
    512: dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
    1 << 62: dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3),  # 64 x 128 spills with ACT's two accumulators
    'interpret': dict(
        BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, decode=dict(BN1=32, W1=4, BN2=32, W2=4, SPLIT2=2)
    ),
}


def w4a16_moe_config(num_tokens: int) -> dict:
    "The launch sizes for `num_tokens` tokens (`CONFIGS`; its `interpret` row under the Triton interpreter)."
    if _INTERPRET:
        return dict(CONFIGS['interpret'])
    return dict(next(v for b, v in CONFIGS.items() if b != 'interpret' and b >= num_tokens))


# ------------------------------------------------------------------------------------------------ reference


def dequantize_experts_w4a16(qweight, scales, offsets, bits: int, group: int, N: int, K: int, dtype=torch.float32):
    "Stacked packed experts `[E, ...]` -> float `[E, N, K]` (`dequantize_packed_ref` per expert)."
    return torch.stack(
        [
            dequantize_packed_ref(qweight[e], scales[e], offsets[e], bits, group, N, K, dtype)
            for e in range(qweight.shape[0])
        ]
    )


def fused_moe_w4a16_ref(
    x,
    w13_qweight,
    w2_qweight,
    w13_scales,
    w2_scales,
    w13_offsets,
    w2_offsets,
    topk_weights,
    topk_ids,
    bits: int = 4,
    group: int = 128,
    renormalize: bool = False,
):
    """Plain PyTorch: each used expert dequantized to fp32, a loop over experts (as `fused_moe_ref`); `[T, H]` in x's
    dtype."""
    T, H = x.shape
    I = w13_qweight.shape[2] // 2
    w = topk_weights.float()
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    xf, out = x.float(), torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        t, j = torch.where(topk_ids == e)
        w13 = dequantize_packed_ref(w13_qweight[e], w13_scales[e], w13_offsets[e], bits, group, 2 * I, H)
        w2 = dequantize_packed_ref(w2_qweight[e], w2_scales[e], w2_offsets[e], bits, group, H, I)
        gate, up = (xf[t] @ w13.T).chunk(2, dim=-1)
        out.index_add_(0, t, ((F.silu(gate) * up) @ w2.T) * w[t, j, None])
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit(do_not_specialize=['num_valid'])
def _w4a16_moe_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    N,
    K,
    NW,
    num_valid,
    ONE,
    stride_am,
    stride_cm,
    stride_qe,
    stride_se,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ACT: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One tile: c[a, n] = sum_k a[a // A_ROW_DIV, k] W_e[n, k] (* topk_w[a]) for the assignments `a` of one
    `sorted_ids` block (expert e) and BLOCK_N of the N output columns; W_e packed (`NW` columns per word row).
    ACT: W_e holds 2N columns (gate, then up) and the tile writes silu(gate) * up. Padding rows read a real row and
    are never stored; columns past N wrap around (no masks on the weight loads)."""
    C: tl.constexpr = 4 * BITS
    FIELDS: tl.constexpr = 32 // BITS
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):  # past the last real block
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    mask_m = assign < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    cols = offs_n % N
    rc = tl.arange(0, C)
    a_ptrs = a_ptr + (tl.minimum(assign, num_valid - 1) // A_ROW_DIV)[:, None] * stride_am + rc[None, :]
    w_ptrs = qw_ptr + expert * stride_qe + rc[:, None] * NW + cols[None, :]
    s_ptrs = s_ptr + expert * stride_se + cols
    o_ptrs = o_ptr + expert * stride_se + cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, TK)):
        words = tl.load(w_ptrs + t * C * NW)
        if ACT:
            words2 = tl.load(w_ptrs + t * C * NW + N)  # the up columns
        if G >= TK:  # one scale group for the whole K-tile
            s, b = group_sb(s_ptrs, o_ptrs, (t * TK) // G, NW, BITS)
            if ACT:
                s2, b2 = group_sb(s_ptrs + N, o_ptrs + N, (t * TK) // G, NW, BITS)
        for j in tl.static_range(FIELDS):
            k0 = t * TK + j * C
            if G < TK:
                s, b = group_sb(s_ptrs, o_ptrs, k0 // G, NW, BITS)
                if ACT:
                    s2, b2 = group_sb(s_ptrs + N, o_ptrs + N, k0 // G, NW, BITS)
            if EVEN_K:
                a = tl.load(a_ptrs + k0)
            else:
                a = tl.load(a_ptrs + k0, mask=(k0 + rc < K)[None, :], other=0.0)
            w = field_f(words, j, BITS, ONE) * s[None, :] + b[None, :]
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PREC)
            if ACT:
                w2 = field_f(words2, j, BITS, ONE) * s2[None, :] + b2[None, :]
                acc2 = tl.dot(a, w2.to(a.dtype), acc2, input_precision=PREC)
    if ACT:
        acc = acc * tl.sigmoid(acc) * acc2
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + assign, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + assign[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


# ------------------------------------------------------------------------------------------------ host


def _grouped(
    a, qw, s, o, out, tw, sorted_ids, expert_ids, ntpp, num_valid, a_row_div, mul_routed, act, bits, G, K, cfg
):
    "One `_w4a16_moe_kernel` launch over every (block, column block) tile (see the module docstring)."
    NW = qw.shape[2]
    N = NW // 2 if act else NW
    grid = (triton.cdiv(sorted_ids.numel(), cfg['BLOCK_M']) * triton.cdiv(N, cfg['BLOCK_N']),)
    _w4a16_moe_kernel[grid](
        a,
        qw,
        s,
        o,
        out,
        tw,
        sorted_ids,
        expert_ids,
        ntpp,
        N,
        K,
        NW,
        num_valid,
        F32_ONE,
        a.stride(0),
        out.stride(0),
        qw.stride(0),
        s.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=mul_routed,
        ACT=act,
        BITS=bits,
        G=G,
        EVEN_K=K % TILE_K == 0,
        PREC='ieee' if a.dtype == torch.float32 else 'tf32',
        BLOCK_M=cfg['BLOCK_M'],
        BLOCK_N=cfg['BLOCK_N'],
        num_warps=cfg['num_warps'],
        num_stages=cfg['num_stages'],
    )
    return out


def fused_moe_w4a16(
    x,
    w13_qweight,
    w2_qweight,
    w13_scales,
    w2_scales,
    w13_offsets,
    w2_offsets,
    topk_weights,
    topk_ids,
    bits: int = 4,
    group: int = 128,
    renormalize: bool = False,
    config: dict | None = None,
):
    """`fused_moe_w4a16_ref` in Triton: `x [T, H]` (fp32/fp16/bf16), the stacked packed experts of the module
    docstring, `topk_weights`/`topk_ids [T, k]`. The decode GEMVs where the config has a `decode` entry (few
    tokens), else alignment + two grouped GEMMs. `config` overrides keys of `w4a16_moe_config`. No host sync
    (CUDA-graph safe). Returns `[T, H]` in x's dtype; the GEMMs accumulate in fp32, the intermediate is x's dtype."""
    T, H = x.shape
    E, _, two_i = w13_qweight.shape
    I, k = two_i // 2, topk_ids.shape[1]
    _, G = check_layout(w13_qweight[0], w13_scales[0], w13_offsets[0], bits, group, 2 * I, H)
    check_layout(w2_qweight[0], w2_scales[0], w2_offsets[0], bits, group, H, I)
    assert w2_qweight.shape[0] == E and topk_ids.shape == topk_weights.shape == (T, k), (
        w2_qweight.shape,
        topk_ids.shape,
    )
    if T == 0:
        return x.new_empty(0, H)
    w13 = tuple(t.contiguous() for t in (w13_qweight, w13_scales, w13_offsets))
    w2 = tuple(t.contiguous() for t in (w2_qweight, w2_scales, w2_offsets))
    x = x.contiguous()
    tw = topk_weights.float()
    if renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    tw, ids = tw.contiguous(), topk_ids.contiguous()
    cfg = {**w4a16_moe_config(T), **(config or {})}
    if cfg.get('decode') and T <= DECODE_MAX_T:
        return w4a16_moe_decode(x, w13, w2, tw, ids, bits, G, H, I, cfg['decode'])
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, cfg['BLOCK_M'], E)
    n = T * k
    inter = x.new_empty(n, I)
    _grouped(x, *w13, inter, tw, sorted_ids, expert_ids, ntpp, n, k, False, True, bits, G, H, cfg)
    out_k = x.new_empty(n, H)
    _grouped(inter, *w2, out_k, tw, sorted_ids, expert_ids, ntpp, n, 1, True, False, bits, G, I, cfg)
    return moe_sum(out_k.view(T, k, H))
