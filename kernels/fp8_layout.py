"""Block-wise FP8 weights as Qwen3-FP8 / DeepSeek-V3 checkpoints store them, and their PyTorch dequantization.

`weight` `float8_e4m3fn [N, K]` and `weight_scale_inv` `fp32 [ceil(N/BLOCK), ceil(K/BLOCK)]`, one scale per
128 x 128 block: `W = weight * scale` (the name is the checkpoints'; the value multiplies). `dequantize_fp8_block` is
the reference the Triton kernels (`fp8_matmul`) are tested against; quantization is in `cvllm_lab.quant.fp8`.
Plain PyTorch (no Triton).
"""

import torch

__all__ = ['BLOCK', 'dequantize_fp8_block']

BLOCK = 128


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    "`weight * scale` over 128 x 128 blocks -> `[N, K]` (fp32 arithmetic, then `dtype`)."
    N, K = weight.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (weight.float() * s).to(dtype)
