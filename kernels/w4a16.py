"""W4A16: `y = x @ W.T` with `W` in our packed 4-bit (or 8-bit) layout, the kernel picked by the number of rows.

The layout (`w4a16_layout`; packing and repacking of GPTQ / AWQ / GGUF weights in `cvllm_lab.quant.w4a16`,
drawn in notebook 46) keeps K in tiles of 128: tile `t`'s `C = 4 * BITS` word rows hold in bit field `j` of
row `c` the weights `k = t*128 + j*C + c`, so a coalesced `[C, BN]` load of words is, field by field, `[C, BN]`
slices of `W.T`; scales and offsets are fp16 per group, `W = scale * q + offset`. Integer to float goes through the
mantissa of 1.0f (`w4a16_fields`): a shift and one LOP3 per weight give `f = 1 + q / 2**BITS`, and per scale
group `sum_k x_k W_k = S * sum_k x_k f_k + B * sum_k x_k` (`S = 2**BITS * scale`, `B = offset - S`), so a kernel's
inner loop is one FMA per weight and the scales are applied once per group.

| rows M | kernel (module) | why |
|---|---|---|
| 1 (decode), 4-bit, groups a multiple of 128, 16-bit x, GPU | `_mma_kernel` (`w4a16_mma`) | the weights as `mma.sync`'s A operand, the fragments built from the words each thread loads (3 shifts + 4 LOP3 per 8 weights), x as B: ~0.4 instructions per weight where the GEMV spends ~3 (it also takes up to 8 rows, as B's columns, but loses to the tensor-core kernel there) |
| 1 (decode), other formats | `_gemv_kernel` (`w4a16_gemv`) | memory- and issue-bound: an fp32 register tile per program, fields turned into floats in as few instructions as possible, x loads shared by two column tiles, register prefetch, split-K, PDL |
| 2 .. `MM_MAX_M`, 4-bit, groups >= 128, 16-bit x | `_tc_kernel` (`w4a16_tc`) | tensor cores with the weights as the A operand, fields built by inline PTX straight into the MMA's registers (one instruction per weight; symmetric layers: `q - 8` with one more packed FMA per two weights, and no `sum(x)` or offsets): 16 rows cost what one does |
| 2 .. `MM_MAX_M`, other formats | `_mm_kernel` (`w4a16_mm`) | one `tl.dot` per bit field with the exact `f`, scales on the group sums |
| > `MM_MAX_M` (prefill) | `_dequant_kernel` (`w4a16_dequantize`) + cuBLAS | the dequantization is amortized over many rows |
| any, batch-invariant mode | `_mm_kernel` (`w4a16_mm`), one config, no split-K | a row's sums do not depend on M (`batch_invariant`) |

Split-K in all of them goes through the self-zeroing workspace of `split_k` (one launch per matmul). Tuned launch
configurations are data: `configs/<kernel>/<device>.json` (`tuned`). The measurements behind the choices are in
`results/NOTES.md`.
"""

import torch

from cvllm_lab.kernels.activation import silu_and_mul
from cvllm_lab.kernels.batch_invariant import batch_invariant
from cvllm_lab.kernels.w4a16_gemv import w4a16_gemv
from cvllm_lab.kernels.w4a16_layout import TILE_K, check_layout, dequantize_packed_ref, padded_k
from cvllm_lab.kernels.w4a16_mm import tc_supported, w4a16_dequantize, w4a16_mm, w4a16_tc
from cvllm_lab.kernels.w4a16_mma import mma_supported, w4a16_mma

__all__ = [
    'w4a16_matmul',
    'w4a16_matmul_ref',
    'w4a16_gemv',
    'w4a16_mm',
    'w4a16_tc',
    'w4a16_mma',
    'w4a16_dequantize',
    'tc_supported',
    'mma_supported',
    'MM_MAX_M',
    'TILE_K',
    'padded_k',
    'check_layout',
    'dequantize_packed_ref',
]

MM_MAX_M = 128  # above: dequantize once + cuBLAS


def w4a16_matmul(x, qweight, scales, offsets, bits, group, N, K, act=None, sym=False):
    """`x` `[..., K]` @ W.T -> `[..., N]` in x's dtype, picking the kernel by the number of rows M (1: the MMA
    kernel where `mma_supported`, else the GEMV; up to `MM_MAX_M`: the tensor-core kernel where `tc_supported`, else
    the per-field `tl.dot` kernel; more: dequantize + cuBLAS).
    `act='silu_and_mul'` (W's rows interleave gate and up): `[..., N / 2]`, fused into the M = 1 kernels and the
    tensor-core kernel.
    `sym`: `offsets == -8 * scales` (4-bit symmetric; the M = 1 kernels and the tensor-core kernel then skip the
    offsets). Batch-invariant mode: the `tl.dot` kernel at every M."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N // 2 if act else N)
    if batch_invariant():  # one kernel (and, through `split_k`, one config) at every M
        y = w4a16_mm(x2, qweight, scales, offsets, bits, group, N, K)
        return (silu_and_mul(y, interleaved=True) if act else y).reshape(*lead, -1)
    if M == 1:
        one = w4a16_mma if mma_supported(x2, bits, group, N, K) else w4a16_gemv
        return one(x2, qweight, scales, offsets, bits, group, N, K, act=act, sym=sym).reshape(*lead, -1)
    if M <= MM_MAX_M and tc_supported(x2, bits, group, K):
        return w4a16_tc(x2, qweight, scales, offsets, bits, group, N, K, sym=sym, act=act).reshape(*lead, -1)
    elif M <= MM_MAX_M:
        y = w4a16_mm(x2, qweight, scales, offsets, bits, group, N, K)
    else:
        wdt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        y = (x2.to(wdt) @ w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=wdt).T).to(x.dtype)
    if act:
        y = silu_and_mul(y, interleaved=True)
    return y.reshape(*lead, -1)


def w4a16_matmul_ref(x, qweight, scales, offsets, bits, group, N, K):
    "Reference: dequantize in PyTorch, fp32 matmul, cast to x's dtype."
    w = dequantize_packed_ref(qweight, scales, offsets, bits, group, N, K)
    return (x.float() @ w.T).to(x.dtype)
