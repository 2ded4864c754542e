"""The W4A16 packed layout: its constants, its check and its PyTorch dequantization (the kernels' reference).

For a weight `W [N, K]` with integer levels `q[n, k]` in `0 .. 2**BITS - 1` (BITS = 4, or 8):

- `qweight` `int32 [Kp * BITS / 32, N]`, `Kp` = K rounded up to a multiple of `TILE_K` = 128 (zero padded). K is
  cut into *tiles* of 128; tile `t` owns the `C = 4 * BITS` word rows `t*C .. t*C + C-1` (16 for 4-bit, 32 for
  8-bit), and bit field `j` (bits `BITS*j ..`) of word row `t*C + c`, column `n`, holds `q[n, t*128 + j*C + c]`.
  So a load of `[C, BN]` words is contiguous along `n` (coalesced), and field `j` of it is the `[C, BN]` slice
  `k = t*128 + j*C + c` of `W.T`: for the GEMV it multiplies a contiguous run of `x`, for `tl.dot` it is a ready
  `[16 or 32, BN]` operand. No reshapes, no gathers.
- `scales`, `offsets` `fp16 [Kp / G, N]`: `W[n, k] = scales[k // G, n] * q[n, k] + offsets[k // G, n]`
  (GPTQ/AWQ zero points become `offset = -scale * zero`). `G` is a multiple of `C` that divides 128, or a multiple
  of 128 (`G = Kp`: one scale per output channel, `group = -1`).

Plain PyTorch (no Triton), so that the quantization code (`cvllm_lab.quant.w4a16`, which packs and repacks into
this layout) can use it on any machine.
"""

import torch

__all__ = ['TILE_K', 'padded_k', 'check_layout', 'dequantize_packed_ref']

TILE_K = 128


def padded_k(K: int) -> int:
    "K rounded up to a multiple of the 128-wide K-tile."
    return -(-K // TILE_K) * TILE_K


def check_layout(qweight, scales, offsets, bits, group, N, K):
    "Validate packed buffers; returns `(Kp, G)` (G = the stored group, Kp for per-channel)."
    if bits not in (4, 8):
        raise ValueError(f'bits must be 4 or 8, got {bits}')
    C = 4 * bits
    Kp = -(-K // TILE_K) * TILE_K
    G = Kp if group in (-1, None) else group
    if not ((G % C == 0 and TILE_K % G == 0) or G % TILE_K == 0):
        raise ValueError(f'group {group} must be a multiple of {C} dividing {TILE_K}, a multiple of {TILE_K}, or -1')
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (Kp * bits // 32, N):
        raise ValueError(f'qweight must be int32 [{Kp * bits // 32}, {N}], got {qweight.dtype} {tuple(qweight.shape)}')
    ng = -(-Kp // G)
    for name, v in (('scales', scales), ('offsets', offsets)):
        if v.dtype != torch.float16 or tuple(v.shape) != (ng, N):
            raise ValueError(f'{name} must be float16 [{ng}, {N}], got {v.dtype} {tuple(v.shape)}')
    if qweight.numel() >= 2**31:
        raise ValueError('weights over 2**31 words are not supported')
    return Kp, G


def dequantize_packed_ref(qweight, scales, offsets, bits, group, N, K, dtype=torch.float32):
    "Plain PyTorch: the packed weight as `[N, K]` (fp32 arithmetic, then `dtype`)."
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    C, vpw = 4 * bits, 32 // bits
    sh = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    q = (qweight.view(Kp // TILE_K, 1, C, N) >> sh.view(1, vpw, 1, 1)) & ((1 << bits) - 1)  # [T, j, c, N]
    q = q.reshape(Kp, N).float()  # k = t*128 + j*C + c
    s = scales.float().repeat_interleave(G, 0)[:Kp]
    o = offsets.float().repeat_interleave(G, 0)[:Kp]
    return (s * q + o)[:K].T.contiguous().to(dtype)
