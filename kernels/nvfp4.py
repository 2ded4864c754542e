"""NVFP4 (NVIDIA ModelOpt's 4-bit floating point) weights: the format, its plain-PyTorch references, and a Triton
weight-only matmul that keeps the weights 4-bit in memory and dequantizes them in the tile.

Format (ModelOpt's `NVFP4QTensor`, `quant_algo: NVFP4`, `group_size: 16`): a linear weight `W [N, K]` is stored as

    weight          uint8          [N, K/2]    FP4 E2M1 codes, two per byte, the even column in the low nibble
    weight_scale    float8_e4m3fn  [N, K/16]   one scale per 16 values along K
    weight_scale_2  float32        []          the tensor's global scale: amax(|W|) / (6 * 448)
    input_scale     float32        []          the activations' global scale (amax(|x|) / (6 * 448), calibrated)

    W[n, k] = FP4(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2

(E2M1 values as in `mxfp4.FP4_VALUES`.) 4.5 bits per weight, plus the one fp32 scale. The quantizer picks
`weight_scale = e4m3(amax(group) / 6 / weight_scale_2)` and rounds `W / (weight_scale * weight_scale_2)` to the nearest
FP4 code (`quantize_nvfp4_ref`, which is how the test checkpoints are made).

Kernel (`nvfp4_matmul`): `y = x @ W.T * row_scale`, where `row_scale [N]` holds each output row's global scale
(`weight_scale_2` of the shard the row belongs to: the shards of a fused qkv / gate_up layer keep their own, exactly).
Grid `(M, N / BLOCK_N)`: a program reads its row of `x` per K tile (even and odd columns apart, matching the low and
high nibbles), the tile's bytes `[BLOCK_N, BLOCK_K / 2]` and their e4m3 group scales as bytes, decodes both
arithmetically (no lookup table) and accumulates in fp32. One row per program is the decode shape (weights read once
per token row). Above `MM_MIN_ROWS` rows (prefill, large batches) `_nvfp4_mm_kernel` tiles `[BLOCK_M, BLOCK_N]` on
tensor cores: the even and odd columns of `x` against the decoded low and high nibbles, two `tl.dot`s per K step; a
decoded weight (FP4 value times e4m3 scale: at most 7 significant bits) is exact in bf16, so only `x`'s own dtype
and fp32 accumulation matter (fp32 inputs use IEEE fp32 dots, not TF32). Its GPU speed is not measured yet. Weight-only: `x` stays in its
16/32-bit dtype (Hopper has no FP4 tensor cores); `fake_quantize_nvfp4_act_ref` is what a W4A4 (Blackwell) kernel
would round the activations to with the checkpoint's `input_scale`.

MoE (`nvfp4_moe_matmul`, `fused_moe_nvfp4`): the same kernel with `HAS_IDS`: row `r` of the flattened top-k
assignments reads row `r // k` of `x` and expert `ids[r]`'s weights `[E, N, K/2]`, scales and row scales, as MXFP4's
MoE matmul does; `fused_moe_nvfp4_ref` loops over the used experts on dequantized weights.
"""

import os

import torch
import triton
import triton.language as tl

import torch.nn.functional as F

from cvllm_lab.kernels.mxfp4 import FP4_VALUES, _act, _fp4

__all__ = [
    'NVFP4_GROUP',
    'E4M3_MAX',
    'nvfp4_global_scale',
    'quantize_nvfp4_ref',
    'dequantize_nvfp4_ref',
    'fake_quantize_nvfp4_act_ref',
    'nvfp4_matmul_ref',
    'MM_MIN_ROWS',
    'nvfp4_matmul',
    'nvfp4_moe_matmul',
    'fused_moe_nvfp4',
    'fused_moe_nvfp4_ref',
]

NVFP4_GROUP = 16  # values per e4m3 scale
MM_MIN_ROWS = 8  # above this many rows `nvfp4_matmul` runs the tensor-core tile kernel, at or below the row kernel
TRITON_INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'
E4M3_MAX = 448.0
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between FP4 magnitudes


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    "ModelOpt's `weight_scale_2`: `amax(|w|) / (6 * 448)` (1 for an all-zero tensor), fp32 scalar."
    s = w.float().abs().amax() / (6.0 * E4M3_MAX)
    return torch.where(s > 0, s, torch.ones_like(s))


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    "fp32 values (already scaled into +-6) -> FP4 E2M1 codes (int64): nearest magnitude, ties to the even code."
    b = torch.tensor(_BOUNDS, device=x.device)
    a = x.abs()
    code = torch.bucketize(a, b)  # a == bound -> the lower code
    tie_up = torch.isin(a, b[[1, 3, 5]])  # ties at 0.75, 1.75, 3.5 go to the even (upper) code
    code = code + tie_up.long()
    return code + 8 * ((x < 0) & (code > 0))  # sign bit; zero stays +0


def quantize_nvfp4_ref(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """Float `w [N, K]` (K a multiple of 16) -> `(weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
    weight_scale_2 fp32 [])`, ModelOpt's layout and rounding."""
    N, K = w.shape
    assert K % NVFP4_GROUP == 0, K
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.float().reshape(())
    g = w.float().reshape(N, K // NVFP4_GROUP, NVFP4_GROUP)
    bs = g.abs().amax(-1) / (6.0 * gs)
    bs = torch.where(bs == 0, torch.ones_like(bs), bs).to(torch.float8_e4m3fn)
    code = _fp4_codes((g / (bs.float() * gs)[..., None]).reshape(N, K))
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, bs, gs


def dequantize_nvfp4_ref(weight, weight_scale, weight_scale_2=None, dtype=torch.float32):
    """`weight uint8 [N, K/2]`, `weight_scale` e4m3 (or fp32) `[N, K/16]`, global scale (a scalar or per row `[N]`;
    None: 1) -> `[N, K]` in `dtype`: `FP4(code) * weight_scale * weight_scale_2`."""
    assert weight.dtype == torch.uint8, weight.dtype
    N, K2 = weight.shape
    assert weight_scale.shape == (N, K2 * 2 // NVFP4_GROUP), (weight.shape, weight_scale.shape)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=weight.device)
    b = weight.long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], -1).reshape(N, -1, NVFP4_GROUP)  # low nibble first
    v = v * weight_scale.float()[..., None]
    if weight_scale_2 is not None:
        gs = weight_scale_2.float()
        v = v * (gs.reshape(N, 1, 1) if gs.numel() == N and gs.numel() > 1 else gs.reshape(()))
    return v.reshape(N, -1).to(dtype)


def fake_quantize_nvfp4_act_ref(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What a W4A4 NVFP4 GEMM does to `x [.., K]` with the checkpoint's static global `input_scale`: per 16 values an
    e4m3 scale `amax / 6 / input_scale`, values rounded to FP4; returned dequantized, in fp32."""
    shp = x.shape
    x2 = x.float().reshape(-1, shp[-1])
    q, s, _ = quantize_nvfp4_ref(x2, input_scale.float().reshape(()))
    return dequantize_nvfp4_ref(q, s, input_scale).reshape(shp)


@triton.jit
def _e4m3(byte):
    "float8 e4m3fn bytes (int32) -> fp32: sign, 4-bit exponent (bias 7; 0 is subnormal), 3-bit mantissa."
    e = (byte >> 3) & 15
    m = (byte & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.math.exp2((e - 7).to(tl.float32)))
    return tl.where((byte & 128) != 0, -mag, mag)


@triton.jit(do_not_specialize=['M'])
def _nvfp4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    rs_ptr,
    c_ptr,
    ids_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_re,
    stride_cm,
    HAS_IDS: tl.constexpr,  # MoE: row r uses expert ids[r] (and reads x row r // A_ROW_DIV)
    A_ROW_DIV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # values per K step, a multiple of 16 (BLOCK_K / 2 bytes per row)
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + row).to(tl.int64) if HAS_IDS else 0
    x_row = x_ptr + (row // A_ROW_DIV).to(tl.int64) * stride_xm
    w_rows = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte j of the tile holds columns 2j (low nibble) and 2j + 1 (high)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * offs_j
        k_ok = col < K
        mask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_rows + (col // 2)[None, :], mask=mask, other=0).to(tl.int32)
        sc = _e4m3(tl.load(s_rows + (col // 16)[None, :], mask=mask, other=0).to(tl.int32))
        x0 = tl.load(x_row + col, mask=k_ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + col + 1, mask=k_ok, other=0.0).to(tl.float32)
        w = _fp4(byte & 15) * x0[None, :] + _fp4(byte >> 4) * x1[None, :]
        acc += tl.sum(w * sc, 1)
    acc *= tl.load(rs_ptr + e * stride_re + offs_n, mask=n_ok, other=0.0)
    tl.store(c_ptr + row.to(tl.int64) * stride_cm + offs_n, acc.to(c_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _nvfp4_mm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    rs_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # values per K step (BLOCK_K / 2 bytes per weight row), a multiple of 32
    DOT_FP32: tl.constexpr,  # fp32 dots (fp32 inputs; the interpreter, whose bf16 dots are wrong)
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * offs_j  # even columns; byte j holds col (low nibble) and col + 1 (high)
        k_ok = col < K
        wmask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_rows + (col // 2)[None, :], mask=wmask, other=0).to(tl.int32)
        sc = _e4m3(tl.load(s_rows + (col // 16)[None, :], mask=wmask, other=0).to(tl.int32))
        xmask = m_ok[:, None] & k_ok[None, :]
        x0 = tl.load(x_rows + col[None, :], mask=xmask, other=0.0)
        x1 = tl.load(x_rows + col[None, :] + 1, mask=xmask, other=0.0)
        if DOT_FP32:
            x0, x1 = x0.to(tl.float32), x1.to(tl.float32)
        # FP4 value x e4m3 scale has at most 7 significant bits: exact in bf16, so the tensor cores see the true weight
        w0 = (_fp4(byte & 15) * sc).to(x0.dtype)
        w1 = (_fp4(byte >> 4) * sc).to(x0.dtype)
        if DOT_FP32:  # true fp32 products (no TF32): fp32 models match their reference
            acc = tl.dot(x0, tl.trans(w0), acc, input_precision='ieee')
            acc = tl.dot(x1, tl.trans(w1), acc, input_precision='ieee')
        else:
            acc = tl.dot(x0, tl.trans(w0), acc)
            acc = tl.dot(x1, tl.trans(w1), acc)
    acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def nvfp4_matmul_ref(x, weight, weight_scale, row_scale):
    "`nvfp4_matmul` on the dequantized weight, in fp32; `[.., N]` in `x`'s dtype."
    w = dequantize_nvfp4_ref(weight, weight_scale, row_scale)
    return (x.float() @ w.T).to(x.dtype)


def nvfp4_matmul(x, weight, weight_scale, row_scale, block_n: int = 64, block_k: int = 128):
    """`y [.., N] = x [.., K] @ W.T`, `W` the NVFP4 weight `weight uint8 [N, K/2]`, `weight_scale` e4m3 `[N, K/16]`,
    `row_scale fp32 [N]` (each row's global scale); fp32 sums, written in `x`'s dtype."""
    N, K2 = weight.shape
    K = 2 * K2
    assert x.shape[-1] == K and weight_scale.shape == (N, K // NVFP4_GROUP), (x.shape, weight.shape, weight_scale.shape)
    assert block_k % NVFP4_GROUP == 0 and row_scale.shape == (N,), row_scale.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    s = weight_scale.contiguous()
    s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s  # the kernel decodes the bytes itself
    assert s.dtype == torch.uint8, s.dtype
    if M > MM_MIN_ROWS:  # tiles on tensor cores (prefill, large batches)
        bm, bn, bk = (16, 32, 32) if TRITON_INTERPRETED else (64, 64, 64)
        _nvfp4_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2,
            weight.contiguous(),
            s,
            row_scale.float().contiguous(),
            out,
            M,
            N,
            K,
            x2.stride(0),
            K2,
            s.stride(0),
            out.stride(0),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            DOT_FP32=TRITON_INTERPRETED or x.dtype == torch.float32,
            num_warps=4,
        )
        return out.reshape(*lead, N)
    block_n = min(block_n, triton.next_power_of_2(N))
    block_k = min(block_k, max(NVFP4_GROUP, triton.next_power_of_2(K)))
    _nvfp4_kernel[(M, triton.cdiv(N, block_n))](
        x2,
        weight.contiguous(),
        s,
        row_scale.float().contiguous(),
        out,
        out,
        M,
        N,
        K,
        x2.stride(0),
        0,
        K2,
        0,
        s.stride(0),
        0,
        out.stride(0),
        HAS_IDS=False,
        A_ROW_DIV=1,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out.reshape(*lead, N)


def nvfp4_moe_matmul(a, weight, weight_scale, row_scale, expert_ids, a_row_div: int = 1, block_n=64, block_k=128):
    """`c [R, N]`, row `r` = `a[r // a_row_div] @ W[expert_ids[r]].T` with the NVFP4 experts `weight uint8 [E, N, K/2]`,
    `weight_scale` e4m3 `[E, N, K/16]`, `row_scale fp32 [E, N]`; fp32 sums, written in `a`'s dtype."""
    E, N, K2 = weight.shape
    K = 2 * K2
    assert a.shape[-1] == K and weight_scale.shape == (E, N, K // NVFP4_GROUP) and row_scale.shape == (E, N)
    ids = expert_ids.reshape(-1).to(torch.int32).contiguous()
    R = ids.numel()
    out = torch.empty(R, N, dtype=a.dtype, device=a.device)
    if R == 0:
        return out
    a, weight, rs = a.contiguous(), weight.contiguous(), row_scale.float().contiguous()
    s = weight_scale.contiguous()
    s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s
    block_n = min(block_n, triton.next_power_of_2(N))
    block_k = min(block_k, max(NVFP4_GROUP, triton.next_power_of_2(K)))
    _nvfp4_kernel[(R, triton.cdiv(N, block_n))](
        a,
        weight,
        s,
        rs,
        out,
        ids,
        R,
        N,
        K,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        s.stride(0),
        s.stride(1),
        rs.stride(0),
        out.stride(0),
        HAS_IDS=True,
        A_ROW_DIV=a_row_div,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def fused_moe_nvfp4(
    x, w13, w13_scale, w13_row_scale, w2, w2_scale, w2_row_scale, topk_weights, topk_ids, activation='silu'
):
    """MoE over NVFP4 experts (`w13 [E, 2I, H]` gate rows then up rows, `w2 [E, H, I]`, each as packed codes, e4m3
    group scales and per-row global scales): the first `nvfp4_moe_matmul` per (token, expert) assignment, the
    activation, the second, then each token's k outputs weighted and summed in fp32. `[T, H]` in `x`'s dtype."""
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    h = nvfp4_moe_matmul(x, w13, w13_scale, w13_row_scale, ids, a_row_div=k)
    y = nvfp4_moe_matmul(_act(h, activation, 0.0, 0.0), w2, w2_scale, w2_row_scale, ids)
    return (y.float().view(T, k, -1) * topk_weights.float()[..., None]).sum(1).to(x.dtype)


def fused_moe_nvfp4_ref(
    x, w13, w13_scale, w13_row_scale, w2, w2_scale, w2_row_scale, topk_weights, topk_ids, activation='silu'
):
    "`fused_moe_nvfp4` as a loop over the used experts, each dequantized to fp32 when used; `[T, H]` in `x`'s dtype."
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    w = topk_weights.float()
    for e in torch.unique(topk_ids).tolist():
        t, j = torch.where(topk_ids == e)
        h = F.linear(x[t].float(), dequantize_nvfp4_ref(w13[e], w13_scale[e], w13_row_scale[e]))
        y = F.linear(_act(h, activation, 0.0, 0.0), dequantize_nvfp4_ref(w2[e], w2_scale[e], w2_row_scale[e]))
        out.index_add_(0, t, y * w[t, j, None])
    return out.to(x.dtype)
