"""The grouped GEMM of `fused_moe`: `grouped_gemm` launches `_fused_moe_kernel` over the row blocks of an expert
alignment (`moe_align_block_size`: `sorted_ids`, `expert_ids`, `num_tokens_post_padded`), each tile (`_moe_tile`)
one block of one expert's assignments times one block of N columns. `fused_moe` launches it twice, for `w13` and
then for `w2` (see its module docstring for the whole MoE path, the row layouts and the configs).

Data flow of one launch: the rows of a block's assignments `a` (`a // A_ROW_DIV`, or with `A_SORTED` the positions in
`sorted_ids`) times the expert's weight tiles (FP8: dequantized in registers) -> an fp32 accumulator -> the epilogue
(`HAS_BIAS`: plus the expert's bias; `ACT`: `silu(gate) * up`; `MUL_ROUTED_WEIGHT`: times the router weight of `a`) -> stored at row `a` (`C_SORTED`:
at its position; `C_ATOMIC`: added into its token's fp32 row).

Config `SWAP` makes the weight tile the MMA's M side (`acc.T = W_tile @ x_tile.T`), so an expert with a few rows
fills the N side of the instruction rather than wasting a 64-row M side on padding. The kernel loads without masks
where K is a multiple of BLOCK_K: padding rows read a real row and are never stored, columns past N wrap around.
`PERSISTENT` (1: a plain loop, 2: the tile loop flattened into the K loop so the next tile's loads overlap this
one's epilogue) launches `CTAS_PER_SM` (default 1) programs per SM that stride over the real tiles.

FP8 experts (W8A16, block scales `[E, ceil(N/128), ceil(K/128)]`): the kernel loads each weight tile in FP8, scales
it in registers by its block's scale and runs the dot in the activation dtype, so only FP8 bytes cross memory.
"""

import functools

import torch
import triton
import triton.language as tl

__all__ = ['grouped_gemm']


# ------------------------------------------------------------------------------------------------ grouped GEMM


@triton.jit(do_not_specialize=['num_valid'])
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    bs_ptr,
    bias_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_bias,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    C_ATOMIC: tl.constexpr,
    C_ROW_DIV: tl.constexpr,
    EVEN_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The grouped GEMM over the real tiles (row blocks below `num_tokens_post_padded`, times N blocks): one tile
    per program, or (`PERSISTENT`) a grid of about one program per SM striding over the tiles, the tile loop
    flattened into the K loop (`FLATTEN`) so the next tile's loads overlap this one's epilogue."""
    num_pid_m = tl.cdiv(tl.load(ntpp_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for pid in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
            _moe_tile(
                pid,
                num_pid_m,
                num_pid_n,
                a_ptr,
                b_ptr,
                c_ptr,
                topk_w_ptr,
                sorted_ids_ptr,
                expert_ids_ptr,
                bs_ptr,
                bias_ptr,
                N,
                K,
                num_valid,
                stride_am,
                stride_be,
                stride_bn,
                stride_bk,
                stride_cm,
                stride_bse,
                stride_bsn,
                stride_bsk,
                stride_bias,
                A_ROW_DIV,
                MUL_ROUTED_WEIGHT,
                PRECISION,
                B_SCALE,
                HAS_BIAS,
                ACT,
                SWAP,
                A_SORTED,
                C_SORTED,
                C_ATOMIC,
                C_ROW_DIV,
                EVEN_K,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                GROUP_M,
            )
    elif tl.program_id(0) < num_pid_m * num_pid_n:  # else past the last real block
        _moe_tile(
            tl.program_id(0),
            num_pid_m,
            num_pid_n,
            a_ptr,
            b_ptr,
            c_ptr,
            topk_w_ptr,
            sorted_ids_ptr,
            expert_ids_ptr,
            bs_ptr,
            bias_ptr,
            N,
            K,
            num_valid,
            stride_am,
            stride_be,
            stride_bn,
            stride_bk,
            stride_cm,
            stride_bse,
            stride_bsn,
            stride_bsk,
            stride_bias,
            A_ROW_DIV,
            MUL_ROUTED_WEIGHT,
            PRECISION,
            B_SCALE,
            HAS_BIAS,
            ACT,
            SWAP,
            A_SORTED,
            C_SORTED,
            C_ATOMIC,
            C_ROW_DIV,
            EVEN_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
        )


@triton.jit
def _moe_tile(
    pid,
    num_pid_m,
    num_pid_n,
    a_ptr,
    b_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    bs_ptr,
    bias_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_bias,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    SWAP: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    C_ATOMIC: tl.constexpr,
    C_ROW_DIV: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile `pid`: c[a, n] = sum_k a[a // A_ROW_DIV, k] * b[expert, n, k] (* topk_w[a]) for the assignments `a` of
    one block of `sorted_ids` (one expert) and one block of N columns. `B_SCALE`: `b` is FP8, each 128 x 128 block
    scaled by `bs[expert, n // 128, k // 128]` (BLOCK_K divides 128, so a K-tile lies in one scale block).
    `ACT`: `b` holds 2N rows (gate, then up); the tile computes both and writes `silu(gate) * up`. `HAS_BIAS`
    (gpt-oss, not with `ACT`): `bias[expert, n]` added to the sums, before the router weight.
    `SWAP`: the weight tile is the MMA's M side (`acc.T [BN, BM] = b [BN, K] @ a.T`), for few rows per expert.
    `A_SORTED` / `C_SORTED`: `a` / `c` is in sorted order (row = position in `sorted_ids`, `[EM, .]`), so the
    tile's rows are contiguous; else row `a // A_ROW_DIV` / `a`. Loads are unmasked but for a ragged K (`EVEN_K`
    false): padding rows read a real row (or the padding of a sorted buffer) and are never stored, and columns
    past N wrap around. `C_ATOMIC`: `c` is fp32 `[T, N]`, each assignment added into its token's row
    `a // C_ROW_DIV` (the top-k)."""
    group = GROUP_M * num_pid_n  # GROUP_M row-blocks share their weight tiles in L2
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    mask_m = assign < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_bn = offs_n % N  # wrapped: the weight loads need no N mask
    offs_k = tl.arange(0, BLOCK_K)
    if A_SORTED:
        rows = offs_m.to(tl.int64) * stride_am
    else:
        rows = (tl.minimum(assign, num_valid - 1) // A_ROW_DIV) * stride_am
    b_cols = b_ptr + expert * stride_be + offs_bn.to(tl.int64) * stride_bn
    if SWAP:  # a.T [BK, BM], b [BN, BK]
        a_ptrs = a_ptr + rows[None, :] + offs_k[:, None]
        b_ptrs = b_cols[:, None] + offs_k[None, :] * stride_bk
    else:  # a [BM, BK], b.T [BK, BN]
        a_ptrs = a_ptr + rows[:, None] + offs_k[None, :]
        b_ptrs = b_cols[None, :] + offs_k[:, None] * stride_bk
    up_off = N * stride_bn  # ACT: the up rows start N rows below the gate rows
    if B_SCALE:
        bs_ptrs = bs_ptr + expert * stride_bse + (offs_bn // 128) * stride_bsn
        bs2_ptrs = bs_ptr + expert * stride_bse + ((offs_bn + N) // 128) * stride_bsn

    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            if ACT:
                b2 = tl.load(b_ptrs + up_off)
        else:
            mask_k = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_k[:, None] if SWAP else mask_k[None, :], other=0.0)
            bmask = mask_k[None, :] if SWAP else mask_k[:, None]
            b = tl.load(b_ptrs, mask=bmask, other=0.0)
            if ACT:
                b2 = tl.load(b_ptrs + up_off, mask=bmask, other=0.0)
        if B_SCALE:  # dequantize the FP8 tiles in registers
            kq = ((kb * BLOCK_K) // 128) * stride_bsk
            s = tl.load(bs_ptrs + kq)
            b = (b.to(tl.float32) * (s[:, None] if SWAP else s[None, :])).to(a.dtype)
            if ACT:
                s2 = tl.load(bs2_ptrs + kq)
                b2 = (b2.to(tl.float32) * (s2[:, None] if SWAP else s2[None, :])).to(a.dtype)
        if SWAP:
            acc = tl.dot(b, a, acc, input_precision=PRECISION)
            if ACT:
                acc2 = tl.dot(b2, a, acc2, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if ACT:
                acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:  # columns wrapped as the weight's: no mask
        bias = tl.load(bias_ptr + expert * stride_bias + offs_bn).to(tl.float32)
        acc = acc + (bias[:, None] if SWAP else bias[None, :])
    if ACT:
        acc = acc * tl.sigmoid(acc) * acc2
    if MUL_ROUTED_WEIGHT:
        tw = tl.load(topk_w_ptr + assign, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * (tw[None, :] if SWAP else tw[:, None])
    c_rows = offs_m.to(tl.int64) if C_SORTED else assign
    if C_ATOMIC:
        c_rows = assign // C_ROW_DIV
        if SWAP:
            tl.atomic_add(
                c_ptr + c_rows[None, :] * stride_cm + offs_n[:, None],
                acc,
                mask=mask_n[:, None] & mask_m[None, :],
                sem='relaxed',
            )
        else:
            tl.atomic_add(
                c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :],
                acc,
                mask=mask_m[:, None] & mask_n[None, :],
                sem='relaxed',
            )
    elif SWAP:
        c_ptrs = c_ptr + c_rows[None, :] * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    else:
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 4


@functools.lru_cache(maxsize=None)
def _smem_limit(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def _fit_shared_memory(cfg: dict, a_bytes: int, w_bytes: int, device) -> dict:
    """`cfg` with fewer pipeline stages where its A and B tiles would not fit in shared memory: the tuned configs are
    for 16-bit inputs, and fp32 inputs (tests, fp32 models) double every tile."""
    if device.type != 'cuda' or a_bytes <= 2 and w_bytes <= 2:
        return cfg
    per_stage = cfg['BLOCK_M'] * cfg['BLOCK_K'] * a_bytes + cfg['BLOCK_K'] * cfg['BLOCK_N'] * w_bytes
    stages, limit = cfg['num_stages'], _smem_limit(device.index or 0)
    while stages > 1 and stages * per_stage > limit:
        stages -= 1
    return cfg if stages == cfg['num_stages'] else {**cfg, 'num_stages': stages}


def grouped_gemm(
    a,
    w,
    out,
    topk_weights,
    sorted_ids,
    expert_ids,
    ntpp,
    num_valid: int,
    a_row_div: int,
    mul_routed: bool,
    cfg,
    w_scale=None,
    act: bool = False,
    a_sorted: bool = False,
    c_sorted: bool = False,
    c_atomic: int = 0,
    bias=None,
):
    """out[a] = a[a // a_row_div] @ w[expert].T (* router weight) for every real assignment `a` of `sorted_ids`
    (`num_valid` of them); `act`: w holds gate rows then up rows and out gets `silu(gate) * up` (half of w's rows
    wide); `a_sorted` / `c_sorted`: `a` / `out` rows are positions in `sorted_ids` instead; `c_atomic` (the top-k):
    `out` is fp32 `[T, N]` and each assignment is added into row `a // c_atomic`; `bias` `[E, N]`: added to each
    expert's sums before the router weight (not with `act`)."""
    assert bias is None or (not act and bias.stride(-1) == 1), 'a bias: contiguous rows, and no fused activation'
    N, K = w.shape[1] // (2 if act else 1), w.shape[2]
    cfg = _fit_shared_memory(cfg, a.element_size(), w.element_size(), a.device)
    em = sorted_ids.numel()
    tiles = triton.cdiv(em, cfg['BLOCK_M']) * triton.cdiv(N, cfg['BLOCK_N'])  # at most: EM is an upper bound
    persistent = int(cfg.get('PERSISTENT', 0))
    grid = (min(tiles, _num_sms(a.device) * cfg.get('CTAS_PER_SM', 1)) if persistent else tiles,)
    bs = w_scale if w_scale is not None else topk_weights  # any pointer: unused without B_SCALE
    bss = w_scale.stride() if w_scale is not None else (0, 0, 0)
    _fused_moe_kernel[grid](
        a,
        w,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        ntpp,
        bs,
        bs if bias is None else bias,
        N,
        K,
        num_valid,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        *bss,
        0 if bias is None else bias.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=mul_routed,
        PRECISION='ieee' if a.dtype == torch.float32 else 'tf32',
        B_SCALE=w_scale is not None,
        HAS_BIAS=bias is not None,
        ACT=act,
        SWAP=bool(cfg.get('SWAP', 0)),
        A_SORTED=a_sorted,
        C_SORTED=c_sorted,
        C_ATOMIC=c_atomic > 0,
        C_ROW_DIV=max(c_atomic, 1),
        EVEN_K=K % cfg['BLOCK_K'] == 0,
        PERSISTENT=persistent > 0,
        FLATTEN=persistent > 1,
        BLOCK_M=cfg['BLOCK_M'],
        BLOCK_N=cfg['BLOCK_N'],
        BLOCK_K=cfg['BLOCK_K'],
        GROUP_M=cfg['GROUP_M'],
        num_warps=cfg['num_warps'],
        num_stages=cfg['num_stages'],
    )
    return out
