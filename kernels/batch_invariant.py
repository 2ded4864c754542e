"""Batch-invariant mode's switch for the GPU kernels, and the dense matmul dispatch that obeys it (no Triton here:
the layers import this module on every machine).

`EngineConfig.batch_invariant` (vLLM's `VLLM_BATCH_INVARIANT`) asks that greedy and seeded output not depend on what
else is in the batch, how a prompt is chunked, or whether its prefix came from the cache. The model runner turns the
mode on for its process with `set_batch_invariant`; kernels and dispatchers read `batch_invariant()` when they pick a
launch:

| where | by default | in batch-invariant mode |
|---|---|---|
| dense matmuls (`linear`, the layers' `F.linear`) | cuBLAS, whose kernel follows M | `matmul_invariant`: one tiling for every M |
| quantized matmuls' split-K and row buckets (`split_k`) | split-K by grid size, config by row bucket | no split-K, one config |
| GGUF matmuls (`gguf_matmul`) | GEMV to 4 rows, `tl.dot` kernel to 64, dequantize + cuBLAS above | the `tl.dot` kernel, unsplit |
| FP8 matmuls (`fp8_matmul`) | GEMV at one row, tuned backend by row bucket | `fp8_mm` (block scales) or the dequantized weight in `matmul_invariant` |
| W4A16's kernel by rows (`w4a16`) | MMA / GEMV at one row, tensor-core or `tl.dot` kernel to 128, dequantize + cuBLAS above | the `tl.dot` kernel at every M |
| paged attention (`paged_attention`) | split-KV for decode batches, by batch size; FlashAttention for fresh prompts | one pass over the keys in order, every row on the paged kernel |
| fused MoE (`fused_moe`) | config by token bucket, a decode kernel for few tokens | one config, the grouped kernel, no atomics |
| MLA (`mla_decode`, the MLA layer) | absorbed decode rows, decompressed prefill rows; split-KV by batch size | every row as a one-query sequence on the absorbed path, no split; `bmm` per head |

The CPU fast path has its own invariant kernels (`cvllm_lab.quant.cpu`), switched by the same field.
"""

import torch
import torch.nn.functional as F

__all__ = ['set_batch_invariant', 'batch_invariant', 'linear', 'bmm']

_ON = [False]


def set_batch_invariant(on: bool):
    "Batch-invariant mode for the GPU kernels of this process."
    _ON[0] = bool(on)


def batch_invariant() -> bool:
    "Whether `set_batch_invariant` turned the mode on."
    return _ON[0]


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    "`F.linear`, except on CUDA in batch-invariant mode: `matmul_invariant`, whose rows do not depend on M."
    if _ON[0] and x.is_cuda:
        from cvllm_lab.kernels.matmul_invariant import matmul_invariant

        return matmul_invariant(x, w, bias)
    return F.linear(x, w, bias)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    "`torch.bmm`, except on CUDA in batch-invariant mode: `matmul_invariant` per batch entry (an MLA layer's heads)."
    if not (_ON[0] and a.is_cuda):
        return torch.bmm(a, b, out=out)
    from cvllm_lab.kernels.matmul_invariant import matmul_invariant

    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2]) if out is None else out
    for h in range(a.shape[0]):
        out[h] = matmul_invariant(a[h], b[h].transpose(0, 1))
    return out
