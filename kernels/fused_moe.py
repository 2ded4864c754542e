"""Fused Mixture-of-Experts: router top-k, token alignment by expert, and two grouped-GEMM Triton launches. This
module holds the router, the configs, the references, the alignment (and `moe_permute`) and the entry point
`fused_moe`; the grouped GEMM itself (`_fused_moe_kernel` and its launcher `grouped_gemm`) is in `fused_moe_gemm`.

An MoE block maps each token `t` of `x [T, H]` to `sum_j w_tj * expert_{e_tj}(x_t)` over its `k` routed experts,
with `expert_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T`. The weights are stacked per expert as vLLM and
`transformers` store them: `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`.

Routing (`select_experts`): softmax, top-k and renormalization in one launch on the GPU (`fused_moe_router`).
Few tokens (the config row of the bucket has a `decode` entry) take the decode path of `fused_moe_decode`: one
GEMV per weight matrix, each (token, expert) pair its own row group, SiLU-and-mul and the weighted top-k sum in
the epilogues, no alignment. Otherwise, the grouped GEMMs (T tokens, top-k, assignments `a = t * k + j` of the
flattened `topk_ids`):

    topk_ids [T, k] --flatten--> [T*k] --moe_align_block_size(block_m)-->   (one Triton program for decode sizes)
        sorted_token_ids  [EM]  assignment indices grouped by expert, each expert's run padded with the sentinel
                                T*k to a multiple of block_m:  | e0 e0 e0 pad | e3 pad pad pad | e5 e5 e5 e5 | pad...
        expert_ids [EM/block_m] the expert of each block:       |     0       |       3        |      5      |  -1
        num_tokens_post_padded  where the real blocks end (later blocks exit at once)
    launch 1  _fused_moe_kernel  rows x[a // k]  @ w13[expert].T  -> inter13 [T*k, 2I]   (stored at row a)
              silu_and_mul                                          -> inter   [T*k, I]
              (config `ACT`: the tile computes its gate and up columns together and writes inter directly)
    launch 2  _fused_moe_kernel  rows inter[a]   @ w2[expert].T * w_a -> out_k [T*k, H]
    launch 3  moe_sum            out_k.view(T, k, H) summed over k    -> out     [T, H]   (fp32 accumulation)

The kernel's own config keys (`SWAP`, `PERSISTENT`, `CTAS_PER_SM`) and its unmasked loads are described in
`fused_moe_gemm`. For prefill (many rows per expert) the row layout is a config choice too:

| key      | launch 1 reads            | launch 1 writes / launch 2 reads         | cost                         |
|----------|---------------------------|------------------------------------------|------------------------------|
| (none)   | x[a // k] (gathered rows) | inter [T*k, I], rows a (gathered)        | -                            |
| `SORTED` | x[a // k]                 | inter [EM, I], row = position (contiguous) | padding rows of inter      |
| `XSORT`  | x_sorted [EM, H] (contiguous), gathered once by `moe_permute` | as above | one extra pass over x*k |

`down` (a dict) gives launch 2 its own BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SWAP (BLOCK_M is shared:
the blocks come from one alignment); launch 1's N is I (or 2I) and K is H, launch 2's the other way round. Launch 2
writes each assignment's weighted output at its own row, so the per-token sum is one streaming read of `out_k`
(`moe_sum`; no atomics, no fp32 scratch); config `ATOMIC` instead adds them into an fp32 `[T, H]` (zeroed first,
cast at the end): T*H*4 bytes of DRAM traffic each way instead of `out_k`'s T*k*H*2, paid in L2 atomics.

Blocks exist only for experts with at least one assignment, so a decode step (few tokens) reads only the
selected experts' weights: with T = 1 and top-8 of 128 experts, 8 of the 128 weight slices are touched.
`EM` is a static upper bound (`T*k + min(E, T*k) * (block_m - 1)`, rounded up to block_m), so nothing here
synchronizes with the host and the whole path can be captured in a CUDA graph.

Launch configs are data: `configs/fused_moe/<device>.json` (`kernels/tuned.py`), table `default` keyed by the
token bucket `M` (1, 2, 4, ..., 8192: the smallest bucket >= T, else the largest), table `shapes` keyed by
`E,H,I,top_k,M` for shapes tuned on their own (`benchmarks/kernels/tune_fused_moe.py` writes both), and one small
`interpret` config for CPU runs under the Triton interpreter. A row's optional keys: `ACT`, `SWAP` (0/1) and
`decode` (the decode path's launch sizes; see `fused_moe_decode`). The caller's `config` dict overrides any key.

FP8 experts (W8A16): `w13`/`w2` may be `float8_e4m3fn` with block scales `[E, ceil(N/128), ceil(K/128)]` (one per
128 x 128 block of each expert, as block-FP8 checkpoints store `weight_scale_inv`); the kernel dequantizes them in
registers (see `fused_moe_gemm`), so only FP8 bytes cross memory. They always take the grouped GEMMs.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cvllm_lab.kernels.activation import silu_and_mul, swigluoai_and_mul_ref
from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.fused_moe_align import moe_align_block_size_grid
from cvllm_lab.kernels.fused_moe_decode import fused_moe_decode
from cvllm_lab.kernels.fused_moe_gemm import grouped_gemm
from cvllm_lab.kernels.fused_moe_router import FUSED_TOPK_MAX_EXPERTS, fused_topk
from cvllm_lab.kernels.moe_sum import moe_sum
from cvllm_lab.kernels.tuned import configs_for

__all__ = [
    'fused_moe',
    'fused_moe_ref',
    'select_experts',
    'moe_align_block_size',
    'moe_align_block_size_ref',
    'get_config',
    'm_bucket',
    'M_BUCKETS',
    'dequantize_experts_fp8',
    'ALIGN_ONE_PROGRAM_MAX',
    'moe_permute',
]
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

ACTIVATIONS = ('silu', 'swigluoai', 'gelu_tanh')  # SwiGLU, gpt-oss's clamped SwiGLU, GeGLU (Gemma 4)

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)  # token counts the config tables are keyed by
# assignments (T * top_k) up to which one Triton program aligns them (a first guess, to tune with the configs)
ALIGN_ONE_PROGRAM_MAX = (
    128  # assignments done by one program; above, the three-launch grid is faster (results/NOTES.md)
)
FP8_BLOCK = 128


BATCH_INVARIANT_BUCKET = 16  # the bucket whose default config batch-invariant mode runs at every token count


def m_bucket(num_tokens: int) -> int:
    "The config bucket of `num_tokens`: the smallest of `M_BUCKETS` >= it, else the largest."
    return next((b for b in M_BUCKETS if b >= num_tokens), M_BUCKETS[-1])


def get_config(
    num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int, device: torch.device | str = 'cpu'
) -> dict:
    """The launch config for `num_tokens` tokens at this expert shape: a tuned shape row, else the bucket's default;
    batch-invariant mode (`batch_invariant`): bucket `BATCH_INVARIANT_BUCKET`'s default for every count."""
    tables = configs_for('fused_moe', torch.device(device))
    if batch_invariant():  # one tiling at every token count; no decode GEMVs, no atomic adds (summed in arrival order)
        row = dict(tables['interpret'] if _INTERPRET else tables['default'][BATCH_INVARIANT_BUCKET])
        row.pop('decode', None)
        return {**row, 'ATOMIC': 0}
    if _INTERPRET:
        return dict(tables['interpret'])
    b = m_bucket(num_tokens)
    row = tables.get('shapes', {}).get((num_experts, hidden, inter, top_k, b))
    return dict(row if row is not None else tables['default'][b])


# ------------------------------------------------------------------------------------------------ references


def _renormalized(topk_weights):
    return topk_weights / topk_weights.sum(dim=-1, keepdim=True)


def dequantize_experts_fp8(w, scale, dtype=torch.float32):
    "Block-FP8 experts `w [E, N, K]` e4m3 with `scale [E, ceil(N/128), ceil(K/128)]` -> `[E, N, K]` in `dtype`."
    E, N, K = w.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 1)[:, :N].repeat_interleave(FP8_BLOCK, 2)[:, :, :K]
    return (w.float() * s).to(dtype)


def fused_moe_ref(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    renormalize: bool = False,
    w13_scale=None,
    w2_scale=None,
    w13_bias=None,
    w2_bias=None,
    activation: str = 'silu',
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
):
    """Plain-PyTorch MoE, a loop over experts, in fp32; returns `[T, H]` in `x`'s dtype.
    `renormalize` divides each token's `topk_weights` by their sum first; `w13_scale`/`w2_scale`: FP8 experts.
    gpt-oss: `w13_bias [E, 2I]` (gate, then up) and `w2_bias [E, H]` added to each expert's two products, and
    `activation='swigluoai'`, its clamped SwiGLU (`activation.swigluoai_and_mul_ref`, `swiglu_alpha`, `swiglu_limit`).
    Gemma 4: `activation='gelu_tanh'`, GeGLU (`gelu(gate, approximate='tanh') * up`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f'unknown MoE activation {activation!r} ({", ".join(ACTIVATIONS)})')
    T, H = x.shape
    w = topk_weights.float()
    if renormalize:
        w = _renormalized(w)
    xf, out = x.float(), torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        t, j = torch.where(topk_ids == e)
        w13e = w13[e].float() if w13_scale is None else dequantize_experts_fp8(w13[e : e + 1], w13_scale[e : e + 1])[0]
        w2e = w2[e].float() if w2_scale is None else dequantize_experts_fp8(w2[e : e + 1], w2_scale[e : e + 1])[0]
        h = xf[t] @ w13e.T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        if activation == 'swigluoai':
            y = swigluoai_and_mul_ref(h, swiglu_alpha, swiglu_limit) @ w2e.T
        elif activation == 'gelu_tanh':
            gate, up = h.chunk(2, dim=-1)
            y = (F.gelu(gate, approximate='tanh') * up) @ w2e.T
        else:
            gate, up = h.chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2e.T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, t, y * w[t, j, None])
    return out.to(x.dtype)


def select_experts(router_logits, top_k: int, renormalize: bool, scoring: str = 'softmax', use_kernel=None):
    """Router as `transformers`' Qwen2/3-MoE (`norm_topk_prob`) and Mixtral (always renormalized) write it: softmax
    in fp32 over the experts, top-k, optionally the k weights divided by their sum.
    `router_logits [T, E]` -> `topk_weights [T, k]` fp32 (Qwen's router casts them back to the logits' dtype;
    we keep fp32 for the kernel), `topk_ids [T, k]` int32. `scoring='softmax'` only
    (DeepSeek's sigmoid scoring with a correction bias is not implemented yet). On CUDA (or `use_kernel=True`) one
    Triton launch, `fused_moe_router.fused_topk`; elsewhere (or `use_kernel=False`) the PyTorch ops below."""
    if scoring != 'softmax':
        raise NotImplementedError(f'scoring={scoring!r}: only softmax routing is implemented')
    if use_kernel is None:
        use_kernel = router_logits.is_cuda and router_logits.shape[-1] <= FUSED_TOPK_MAX_EXPERTS
    if use_kernel:
        return fused_topk(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = _renormalized(topk_weights)
    return topk_weights, topk_ids.to(torch.int32)


# ------------------------------------------------------------------------------------------------ alignment


def _align_sizes(n: int, block_m: int, num_experts: int) -> int:
    "EM, the static length of `sorted_token_ids`: at most min(E, n) experts are padded, each by < block_m."
    return triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m


def moe_align_block_size_ref(topk_ids, block_m: int, num_experts: int):
    """`moe_align_block_size` with device-wide PyTorch ops (scatter-add counts, cumsum, a stable sort, searchsorted):
    no host synchronization, about thirty small kernels whatever the size."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    em = _align_sizes(n, block_m, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start, count_start = padded_end - padded, torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, in token order
    e_sorted = flat[order]
    dest = padded_start[e_sorted] + torch.arange(n, device=dev) - count_start[e_sorted]
    sorted_ids = torch.full((em,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    total = padded_end[-1:]
    block_start = torch.arange(0, em, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


@triton.jit(do_not_specialize=['n', 'EM'])
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    n,
    EM,
    BM: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    "One program: per-expert counts, their padded prefix sums, the block experts, then a stable scatter."
    experts = tl.arange(0, E_P2)
    rows = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c in range(0, n, CHUNK):
        e = tl.load(ids_ptr + c + rows, mask=c + rows < n, other=E_P2).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(ntpp_ptr, total)
    fill = tl.arange(0, FILL)  # the sentinel fill in wide stores: EM >> n at large BM
    for c in range(0, EM, FILL):
        tl.store(sorted_ptr + c + fill, tl.zeros([FILL], dtype=tl.int32) + n, mask=c + fill < EM)
    for c in range(0, EM // BM, CHUNK):
        start = (c + rows) * BM  # a block's expert: how many experts end at or before it
        eid = tl.sum((pend[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + c + rows, tl.where(start < total, eid, -1), mask=c + rows < EM // BM)
    tl.debug_barrier()  # the sentinels land before the real entries
    cur = pend - padded  # next free slot of each expert
    for c in range(0, n, CHUNK):
        e = tl.load(ids_ptr + c + rows, mask=c + rows < n, other=E_P2).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # among this chunk's same-expert rows
        base = tl.sum(onehot * cur[None, :], axis=1)
        tl.store(sorted_ptr + base + rank, c + rows, mask=c + rows < n)
        cur += tl.sum(onehot, axis=0)


def moe_align_block_size(topk_ids, block_m: int, num_experts: int):
    """Group the `T*k` assignments by expert, each expert's run padded to a multiple of `block_m`.

    Returns `sorted_token_ids` int32 `[EM]` (assignment indices `t * k + j` in token order within an expert,
    sentinel `T*k` for padding and the unused tail), `expert_ids` int32 `[EM // block_m]` (-1 past the real blocks)
    and `num_tokens_post_padded` int32 `[1]`; no host synchronization. Up to `ALIGN_ONE_PROGRAM_MAX` assignments
    (decode) one Triton program does it in one launch; above, three launches over chunks of assignments
    (`fused_moe_align`; the same result), since the single program walks the assignments serially."""
    n = topk_ids.numel()
    if n == 0:
        return moe_align_block_size_ref(topk_ids, block_m, num_experts)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    em = _align_sizes(n, block_m, num_experts)
    if n > ALIGN_ONE_PROGRAM_MAX:
        return moe_align_block_size_grid(ids, em, block_m, num_experts)
    sorted_ids = torch.empty(em, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(em // block_m, dtype=torch.int32, device=ids.device)
    ntpp = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_p2 = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        ntpp,
        n,
        em,
        BM=block_m,
        E_P2=e_p2,
        CHUNK=max(16, min(128, 8192 // e_p2)),
        FILL=min(1024, triton.next_power_of_2(em)),
        num_warps=4,
    )
    return sorted_ids, expert_ids, ntpp


# -------------------------------------------------------------------------------------------- x in expert order (XSORT)


@triton.jit(do_not_specialize=['num_valid'])
def _moe_permute_kernel(
    x_ptr,
    out_ptr,
    sorted_ids_ptr,
    ntpp_ptr,
    num_valid,
    H,
    stride_x,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    "out[p] = x[sorted_ids[p] // TOP_K] for the real positions `p` of BLOCK_R rows; padding rows are left as they are."
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(ntpp_ptr):
        return
    assign = tl.load(sorted_ids_ptr + offs_r).to(tl.int64)
    mask_r = assign < num_valid
    src = x_ptr + (assign // TOP_K)[:, None] * stride_x
    dst = out_ptr + offs_r.to(tl.int64)[:, None] * stride_o
    for h in range(0, H, BLOCK_H):
        offs_h = h + tl.arange(0, BLOCK_H)
        m = mask_r[:, None] & (offs_h < H)[None, :]
        tl.store(dst + offs_h[None, :], tl.load(src + offs_h[None, :], mask=m), mask=m)


def moe_permute(x, sorted_ids, ntpp, top_k: int):
    "`x [T, H]` gathered into expert order: `[EM, H]`, row p = x[sorted_ids[p] // top_k] (padding rows unset)."
    em, H = sorted_ids.numel(), x.shape[1]
    out = x.new_empty(em, H)
    _moe_permute_kernel[(triton.cdiv(em, 16),)](
        x,
        out,
        sorted_ids,
        ntpp,
        x.shape[0] * top_k,
        H,
        x.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_R=16,
        BLOCK_H=min(1024, triton.next_power_of_2(H)),
        num_warps=4,
    )
    return out


# ------------------------------------------------------------------------------------------------ entry point


def fused_moe(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    config: dict | None = None,
    renormalize: bool = False,
    w13_scale=None,
    w2_scale=None,
    w13_bias=None,
    w2_bias=None,
    activation: str = 'silu',
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
):
    """`fused_moe_ref` in Triton: the decode path (`fused_moe_decode`, two GEMV launches) where the config row of
    the token bucket has a `decode` entry, else the grouped GEMMs (see the module docstring).

    `x [T, H]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`, `topk_weights`/`topk_ids [T, k]`;
    `config` overrides the keys of `get_config` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, ACT,
    SWAP, SORTED, XSORT, ATOMIC, PERSISTENT, CTAS_PER_SM, down, decode); `w13_scale`/`w2_scale`: the experts are block-FP8 (`float8_e4m3fn`) with these `[E, N/128, K/128]`
    scales (grouped path only). gpt-oss: `w13_bias [E, 2I]`, `w2_bias [E, H]` added in the GEMMs' epilogues and
    `activation='swigluoai'` (its clamped SwiGLU, a separate elementwise pass); they take the grouped path, no fused
    activation. Gemma 4's `activation='gelu_tanh'` (GeGLU) takes it too, its activation a pass of its own. The intermediates are kept in `x`'s dtype; the GEMMs accumulate in fp32.
    Returns `[T, H]` in `x`'s dtype."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    assert w13.shape[2] == H and w2.shape == (E, H, two_i // 2), (x.shape, w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape == (T, k), (topk_ids.shape, topk_weights.shape)
    for w, sc in ((w13, w13_scale), (w2, w2_scale)):
        if sc is None:
            assert w.dtype == x.dtype, (x.dtype, w.dtype)
        else:
            assert w.dtype == torch.float8_e4m3fn and sc.shape == (
                E,
                -(-w.shape[1] // FP8_BLOCK),
                -(-w.shape[2] // FP8_BLOCK),
            ), (w.dtype, sc.shape)
    if T == 0:
        return x.new_empty(0, H)
    cfg = {**get_config(T, E, H, two_i // 2, k, x.device), **(config or {})}
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8:  # a K-tile must lie inside one 128-wide scale block
        cfg['BLOCK_K'] = min(cfg['BLOCK_K'], FP8_BLOCK)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1:
        w13 = w13.contiguous()
    if w2.stride(-1) != 1:
        w2 = w2.contiguous()
    tw = topk_weights.float()
    if renormalize:
        tw = _renormalized(tw)
    tw = tw.contiguous()
    if activation not in ACTIVATIONS:
        raise ValueError(f'unknown MoE activation {activation!r} ({", ".join(ACTIVATIONS)})')
    plain = w13_bias is None and w2_bias is None and activation == 'silu'  # else gpt-oss's experts: no fused epilogues
    if cfg.get('decode') and not fp8 and plain:
        return fused_moe_decode(x, w13, w2, tw, topk_ids, cfg['decode'])
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, cfg['BLOCK_M'], E)
    n, em, I = T * k, sorted_ids.numel(), two_i // 2
    cfg2 = {**cfg, **cfg.get('down', {}), 'BLOCK_M': cfg['BLOCK_M']}  # the down GEMM's own tile, same blocks
    if fp8:
        cfg2['BLOCK_K'] = min(cfg2['BLOCK_K'], FP8_BLOCK)
    srt = bool(cfg.get('SORTED'))  # the intermediate in sorted order: [EM, I], contiguous tiles
    xs = bool(cfg.get('XSORT'))  # x gathered into sorted order once, before the first GEMM
    a1 = moe_permute(x, sorted_ids, ntpp, k) if xs else x
    gemm1 = dict(num_valid=n, a_row_div=k, mul_routed=False, cfg=cfg, w_scale=w13_scale, a_sorted=xs, c_sorted=srt)
    if cfg.get('ACT') and plain:  # silu(gate) * up in the first GEMM's epilogue
        inter = x.new_empty(em if srt else n, I)
        grouped_gemm(a1, w13, inter, tw, sorted_ids, expert_ids, ntpp, act=True, **gemm1)
    else:
        inter13 = x.new_empty(em if srt else n, two_i)
        grouped_gemm(a1, w13, inter13, tw, sorted_ids, expert_ids, ntpp, bias=w13_bias, **gemm1)
        if activation == 'swigluoai':
            inter = swigluoai_and_mul_ref(inter13, swiglu_alpha, swiglu_limit)
        elif activation == 'gelu_tanh':  # GeGLU (Gemma 4), in fp32
            gate, up = inter13.float().chunk(2, dim=-1)
            inter = (F.gelu(gate, approximate='tanh') * up).to(inter13.dtype)
        else:
            inter = silu_and_mul(inter13)  # non-interleaved: gate = [:, :I], up = [:, I:]
    if cfg.get('ATOMIC'):  # the k weighted outputs added into fp32 token rows
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        grouped_gemm(
            inter,
            w2,
            out,
            tw,
            sorted_ids,
            expert_ids,
            ntpp,
            num_valid=n,
            a_row_div=1,
            mul_routed=True,
            cfg=cfg2,
            w_scale=w2_scale,
            a_sorted=srt,
            c_atomic=k,
            bias=w2_bias,
        )
        return out.to(x.dtype)
    out_k = x.new_empty(n, H)  # each assignment's weighted expert output at row t * k + j
    grouped_gemm(
        inter,
        w2,
        out_k,
        tw,
        sorted_ids,
        expert_ids,
        ntpp,
        num_valid=n,
        a_row_div=1,
        mul_routed=True,
        cfg=cfg2,
        w_scale=w2_scale,
        a_sorted=srt,
        bias=w2_bias,
    )
    return moe_sum(out_k.view(T, k, H))
