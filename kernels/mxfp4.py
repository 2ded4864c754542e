"""MXFP4 (OCP Microscaling FP4) weights: the format, its plain-PyTorch references, and a Triton MoE matmul that keeps
the experts 4-bit in memory and dequantizes them in the tile.

Format (gpt-oss's checkpoints, as `transformers`' MXFP4 integration reads them): a weight `W [.., N, K]` (output rows,
input columns) is cut along K into groups of 32 values. Each value is FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit:
the 16 codes are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, `FP4_VALUES`), two per byte, the even column in the low nibble; each
group has one E8M0 scale, a byte `s` meaning `2^(s - 127)`:

    blocks  uint8 [.., N, K/32, 16]     W[n, 32 g + 2 j]     = FP4(blocks[n, g, j] & 0xF) * 2^(scales[n, g] - 127)
    scales  uint8 [.., N, K/32]         W[n, 32 g + 2 j + 1] = FP4(blocks[n, g, j] >> 4)  * 2^(scales[n, g] - 127)

4.25 bits per weight. `transformers` dequantizes `gate_up_proj_blocks [E, 2I, H/32, 16]` to `[E, 2I, H]` and then
transposes it to its `[E, H, 2I]` parameter; our experts are `[E, N, K]` already (`w13 [E, 2I, H]`, `w2 [E, H, I]`), so
the checkpoint's bytes are used as they are (gpt-oss's gate and up rows are interleaved: the loader permutes rows).

Kernel (`mxfp4_moe_matmul`): `c[r] = a[r // a_row_div] @ W[expert_ids[r]].T (+ bias[expert_ids[r]])` for every row
`r` of the flattened top-k assignments, grid `(rows, N / BLOCK_N)`: a program reads its row of `a` once per K tile
(its even and odd columns apart, matching the low and high nibbles), the tile's bytes `[BLOCK_N, BLOCK_K / 2]` and
their group scales, decodes the nibbles arithmetically (no table lookup), and accumulates in fp32. One row per
program is the decode shape (few tokens, every expert's bytes read once per token using them); prefill-sized tiles
on tensor cores (`tl.dot`) are not written yet for the experts. `fused_moe_mxfp4` chains two of them around the
activation and sums each token's k weighted outputs; `fused_moe_mxfp4_ref` is the loop over experts on dequantized
weights.

Dense (`mxfp4_matmul`, the in-situ `Mxfp4Linear`): up to `MM_MIN_ROWS` rows the row kernel above with one expert;
more rows (prefill, large batches) `_mxfp4_mm_kernel` tiles `[BLOCK_M, BLOCK_N]` on tensor cores, as the NVFP4 tile
kernel does: per K step the even and odd columns of `x` against the decoded low and high nibbles, two `tl.dot`s. A
decoded weight (an FP4 value, 2 significant bits, times a power of two) is exact in bf16 (and in fp16 within its
exponent range), so the dots see the true weight; fp32 inputs use IEEE fp32 dots. GPU speed not measured yet.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cvllm_lab.kernels.activation import silu_and_mul_ref, swigluoai_and_mul_ref

__all__ = [
    'FP4_VALUES',
    'MXFP4_GROUP',
    'dequantize_mxfp4_ref',
    'quantize_mxfp4_ref',
    'quantize_mxfp4',
    'mxfp4_moe_matmul',
    'MM_MIN_ROWS',
    'mxfp4_matmul',
    'mxfp4_moe_matmul_ref',
    'fused_moe_mxfp4',
    'fused_moe_mxfp4_ref',
]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per E8M0 scale
MM_MIN_ROWS = 16  # above this many rows `mxfp4_matmul` runs the tensor-core tile kernel, at or below the row kernel
TRITON_INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'


def dequantize_mxfp4_ref(blocks, scales, dtype=torch.float32):
    "`blocks` uint8 `[.., N, K/32, 16]`, `scales` uint8 `[.., N, K/32]` -> `[.., N, K]` in `dtype` (exact in fp32)."
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == MXFP4_GROUP // 2, (blocks.shape, scales.shape)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], -1).flatten(-2)  # [.., N, G, 32]: low nibble first
    v = torch.ldexp(v, scales.to(torch.int32)[..., None] - 127)
    return v.flatten(-2).to(dtype)


def _e8m0_exponent(amax):
    """Per group the exponent `e` of its scale `2^e`: the smallest that keeps `amax / 2^e` within 6 (FP4's largest),
    `ceil(log2(amax / 6))` worked out exactly from `frexp` (no `log2` rounding at powers of two), in [-127, 127]."""
    m, E = torch.frexp(amax.clamp_min(2.0**-126) / 6.0)  # amax / 6 = m 2^E, m in [0.5, 1)
    return (E - (m == 0.5).to(E.dtype)).clamp(-127, 127)


def quantize_mxfp4_ref(w):
    """`w [.., N, K]` (K a multiple of 32) -> `(blocks, scales)`: per group the smallest power-of-two scale that keeps
    its largest magnitude within 6 (FP4's largest), each value rounded to the nearest FP4 value, ties to the even
    code (the one with mantissa bit 0, as IEEE round-to-nearest-even; the OCP MX rounding). The plain form: distances
    to the 8 magnitudes, the nearest (`quantize_mxfp4` is the same in a few passes over the weight)."""
    *lead, N, K = w.shape
    assert K % MXFP4_GROUP == 0, K
    g = w.float().reshape(*lead, N, K // MXFP4_GROUP, MXFP4_GROUP)
    e = _e8m0_exponent(g.abs().amax(-1))
    x = torch.ldexp(g, -e[..., None])  # exact: a power-of-two scaling
    mags = torch.tensor(FP4_VALUES[:8], device=w.device)
    d = (x.abs()[..., None] - mags).abs()
    code = d.argmin(-1)  # the nearest magnitude; on a tie the smaller one, then:
    up = torch.gather(d, -1, (code + 1).clamp(max=7)[..., None])[..., 0] == torch.gather(d, -1, code[..., None])[..., 0]
    code = code + (up & (code % 2 == 1) & (code < 7)).long()  # a tie with an odd code goes to the even one above
    code = code + 8 * ((x < 0) & (code > 0))  # the sign bit (zero stays +0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8)


_FP4_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the FP4 magnitudes
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour is the even code (1, 2, 4)


def quantize_mxfp4(w, max_elements: int = 1 << 24):
    """`quantize_mxfp4_ref` (the same bytes) in a few passes that keep the weight's size in memory: the code of `|x|`
    is the number of FP4 midpoints below it (`bucketize`), plus one at the three midpoints that round up to an even
    code; rows in chunks of about `max_elements` values (a model's linears are quantized on the GPU at load)."""
    *lead, N, K = w.shape
    assert K % MXFP4_GROUP == 0, K
    rows = w.reshape(-1, K)
    G = K // MXFP4_GROUP
    blocks = torch.empty(rows.shape[0], G, MXFP4_GROUP // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows.shape[0], G, dtype=torch.uint8, device=w.device)
    bounds = torch.tensor(_FP4_BOUNDS, device=w.device)
    step = max(1, max_elements // K)
    for r in range(0, rows.shape[0], step):
        g = rows[r : r + step].float().view(-1, G, MXFP4_GROUP)
        e = _e8m0_exponent(g.abs().amax(-1))
        x = torch.ldexp(g, -e[..., None])
        a = x.abs()
        code = torch.bucketize(a, bounds).to(torch.uint8)  # how many midpoints lie below |x|
        for t in _TIES_UP:
            code += a == t
        code += 8 * ((x < 0) & (code > 0))
        blocks[r : r + step] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[r : r + step] = (e + 127).to(torch.uint8)
    return blocks.view(*lead, N, G, MXFP4_GROUP // 2), scales.view(*lead, N, G)


@triton.jit
def _fp4(code):
    "FP4 E2M1 codes (int32) -> fp32: sign, 2-bit exponent (bias 1; 0 is subnormal: 0 or 0.5), 1-bit mantissa."
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.math.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit(do_not_specialize=['num_rows'])
def _mxfp4_moe_kernel(
    a_ptr,
    blocks_ptr,
    scales_ptr,
    bias_ptr,
    c_ptr,
    ids_ptr,
    num_rows,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_bias,
    stride_cm,
    A_ROW_DIV: tl.constexpr,  # row r of the output reads row r // A_ROW_DIV of a (top-k: k; the second matmul: 1)
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # values per K step, a multiple of 32 (BLOCK_K / 2 bytes per row)
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + row).to(tl.int64)
    a_row = a_ptr + (row // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = blocks_ptr + e * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn
    s_rows = scales_ptr + e * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte j of the tile holds columns 2j (low nibble) and 2j + 1 (high)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * offs_j  # the even column of each byte
        k_ok = col < K
        mask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_rows + (col // 2)[None, :], mask=mask, other=0).to(tl.int32)
        sc = tl.load(s_rows + (col // 32)[None, :], mask=mask, other=127).to(tl.float32)
        x0 = tl.load(a_row + col, mask=k_ok, other=0.0).to(tl.float32)
        x1 = tl.load(a_row + col + 1, mask=k_ok, other=0.0).to(tl.float32)
        w = _fp4(byte & 15) * x0[None, :] + _fp4(byte >> 4) * x1[None, :]
        acc += tl.sum(w * tl.math.exp2(sc - 127.0), 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + row.to(tl.int64) * stride_cm + offs_n, acc.to(c_ptr.dtype.element_ty), mask=n_ok)


def mxfp4_moe_matmul_ref(a, blocks, scales, expert_ids, bias=None, a_row_div: int = 1):
    "`mxfp4_moe_matmul` on dequantized weights, in fp32; `[R, N]` in `a`'s dtype."
    R = expert_ids.numel()
    out = torch.empty(R, blocks.shape[1], dtype=torch.float32, device=a.device)
    rows = torch.arange(R, device=a.device)
    for e in torch.unique(expert_ids).tolist():
        r = rows[expert_ids == e]
        out[r] = a[r // a_row_div].float() @ dequantize_mxfp4_ref(blocks[e], scales[e]).T
        if bias is not None:
            out[r] += bias[e].float()
    return out.to(a.dtype)


def mxfp4_moe_matmul(
    a, blocks, scales, expert_ids, bias=None, a_row_div: int = 1, block_n: int = 64, block_k: int = 64
):
    """`c [R, N]`, row `r` = `a[r // a_row_div] @ W[expert_ids[r]].T (+ bias[expert_ids[r]])` with `W` the MXFP4 experts
    `blocks [E, N, K/32, 16]`, `scales [E, N, K/32]` (uint8), `a [M, K]`, `expert_ids [R]`, `bias [E, N]`; fp32 sums,
    written in `a`'s dtype."""
    E, N, G, _ = blocks.shape
    K = G * MXFP4_GROUP
    assert a.shape[-1] == K and scales.shape == (E, N, G), (a.shape, blocks.shape, scales.shape)
    assert block_k % MXFP4_GROUP == 0
    ids = expert_ids.reshape(-1).to(torch.int32).contiguous()
    R = ids.numel()
    out = torch.empty(R, N, dtype=a.dtype, device=a.device)
    if R == 0:
        return out
    a, blocks, scales = a.contiguous(), blocks.contiguous(), scales.contiguous()
    block_n = min(block_n, triton.next_power_of_2(N))
    _mxfp4_moe_kernel[(R, triton.cdiv(N, block_n))](
        a,
        blocks,
        scales,
        a if bias is None else bias,
        out,
        ids,
        R,
        N,
        K,
        a.stride(0),
        blocks.stride(0),
        blocks.stride(1),
        scales.stride(0),
        scales.stride(1),
        0 if bias is None else bias.stride(0),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


@triton.jit
def _mxfp4_mm_kernel(
    x_ptr,
    b_ptr,
    s_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_bn,
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
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    s_rows = s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * offs_j  # even columns; byte j holds col (low nibble) and col + 1 (high)
        k_ok = col < K
        wmask = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(b_rows + (col // 2)[None, :], mask=wmask, other=0).to(tl.int32)
        sc = tl.math.exp2(tl.load(s_rows + (col // 32)[None, :], mask=wmask, other=127).to(tl.float32) - 127.0)
        xmask = m_ok[:, None] & k_ok[None, :]
        x0 = tl.load(x_rows + col[None, :], mask=xmask, other=0.0)
        x1 = tl.load(x_rows + col[None, :] + 1, mask=xmask, other=0.0)
        if DOT_FP32:
            x0, x1 = x0.to(tl.float32), x1.to(tl.float32)
        w0 = (_fp4(byte & 15) * sc).to(x0.dtype)  # an FP4 value times a power of two: exact in bf16
        w1 = (_fp4(byte >> 4) * sc).to(x0.dtype)
        if DOT_FP32:  # true fp32 products (no TF32): fp32 models match their reference
            acc = tl.dot(x0, tl.trans(w0), acc, input_precision='ieee')
            acc = tl.dot(x1, tl.trans(w1), acc, input_precision='ieee')
        else:
            acc = tl.dot(x0, tl.trans(w0), acc)
            acc = tl.dot(x1, tl.trans(w1), acc)
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_matmul(x, blocks, scales):
    """`y [.., N] = x [.., K] @ W.T` for one MXFP4 weight `blocks uint8 [N, K/32, 16]`, `scales uint8 [N, K/32]`: the
    row kernel (`mxfp4_moe_matmul` with one expert) up to `MM_MIN_ROWS` rows, the tile kernel above; fp32 sums, written
    in `x`'s dtype."""
    N, G, _ = blocks.shape
    K = G * MXFP4_GROUP
    assert x.shape[-1] == K and scales.shape == (N, G), (x.shape, blocks.shape, scales.shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M <= MM_MIN_ROWS:
        ids = torch.zeros(M, dtype=torch.int32, device=x.device)
        return mxfp4_moe_matmul(x2, blocks[None], scales[None], ids).reshape(*lead, N)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm, bn, bk = (16, 32, 32) if TRITON_INTERPRETED else (64, 64, 64)
    b, s = blocks.reshape(N, K // 2).contiguous(), scales.contiguous()
    _mxfp4_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x2,
        b,
        s,
        out,
        M,
        N,
        K,
        x2.stride(0),
        b.stride(0),
        s.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_FP32=TRITON_INTERPRETED or x.dtype == torch.float32,
        num_warps=4,
    )
    return out.reshape(*lead, N)


def _act(h, activation: str, alpha: float, limit: float):
    if activation == 'swigluoai':
        return swigluoai_and_mul_ref(h, alpha, limit)
    if activation == 'silu':
        return silu_and_mul_ref(h)
    raise ValueError(f'unknown MoE activation {activation!r} (silu, swigluoai)')


def fused_moe_mxfp4(
    x,
    w13_blocks,
    w13_scales,
    w2_blocks,
    w2_scales,
    topk_weights,
    topk_ids,
    w13_bias=None,
    w2_bias=None,
    activation: str = 'swigluoai',
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
):
    """MoE over MXFP4 experts (`w13 [E, 2I, H]` gate rows then up rows, `w2 [E, H, I]`, as blocks and scales): the
    first `mxfp4_moe_matmul` per (token, expert) assignment, the activation, the second, then each token's k outputs
    weighted and summed in fp32. `[T, H]` in `x`'s dtype."""
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    h = mxfp4_moe_matmul(x, w13_blocks, w13_scales, ids, w13_bias, a_row_div=k)
    y = mxfp4_moe_matmul(_act(h, activation, swiglu_alpha, swiglu_limit), w2_blocks, w2_scales, ids, w2_bias)
    return (y.float().view(T, k, -1) * topk_weights.float()[..., None]).sum(1).to(x.dtype)


def fused_moe_mxfp4_ref(
    x,
    w13_blocks,
    w13_scales,
    w2_blocks,
    w2_scales,
    topk_weights,
    topk_ids,
    w13_bias=None,
    w2_bias=None,
    activation: str = 'swigluoai',
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
):
    "`fused_moe_mxfp4` as a loop over the used experts, each dequantized to fp32 when used; `[T, H]` in `x`'s dtype."
    T = x.shape[0]
    out = torch.zeros(T, w2_blocks.shape[1], dtype=torch.float32, device=x.device)
    w = topk_weights.float()
    for e in torch.unique(topk_ids).tolist():
        t, j = torch.where(topk_ids == e)
        h = F.linear(x[t].float(), dequantize_mxfp4_ref(w13_blocks[e], w13_scales[e]))
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = F.linear(_act(h, activation, swiglu_alpha, swiglu_limit), dequantize_mxfp4_ref(w2_blocks[e], w2_scales[e]))
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, t, y * w[t, j, None])
    return out.to(x.dtype)
