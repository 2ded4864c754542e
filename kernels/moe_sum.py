"""The top-k sum of a fused MoE layer: `out [T, H] = x [T, k, H]` summed over k, the `k` router-weighted expert
outputs of each token added up (the down GEMM writes one row per assignment `t * k + j`).

One Triton launch, grid (T / BLOCK_T, H / BLOCK_H): each program reads its `[BLOCK_T, BLOCK_H]` tile of all k
slices once (the k loads unrolled, so they are in flight together), adds them in fp32 and writes the tile in the
output dtype. It is a pure stream (`T*k*H` elements in, `T*H` out), so it should run near DRAM bandwidth, where a
generic reduction over a middle axis does not. `moe_sum_ref` is the same sum in PyTorch (fp32 accumulation too).
"""

import triton
import triton.language as tl

__all__ = ['moe_sum', 'moe_sum_ref']


def moe_sum_ref(x):
    "`x [T, k, H]` -> `[T, H]`, summed over k (PyTorch accumulates 16-bit inputs in fp32)."
    return x.sum(dim=1)


@triton.jit(do_not_specialize=['T'])
def _moe_sum_kernel(
    x_ptr,
    out_ptr,
    T,
    H,
    stride_xt,
    stride_xk,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    "out[t, h] = sum_j x[t, j, h] for one [BLOCK_T, BLOCK_H] tile, in fp32."
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rows < T)[:, None] & (cols < H)[None, :]
    src = x_ptr + rows.to(tl.int64)[:, None] * stride_xt + cols[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # read once: nothing here is reused
        acc += tl.load(src + j * stride_xk, mask=m, other=0.0, eviction_policy='evict_first').to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


def moe_sum(x, out=None, block_t: int | None = None, block_h: int | None = None, num_warps: int | None = None):
    """`x [T, k, H]` (last dim contiguous) summed over k into `out [T, H]` (new, in x's dtype, if None), fp32
    accumulation; `block_t` tokens by `block_h` columns per program. By default 2 x 1024 with 4 warps (16 values
    per thread and load) from 512 tokens, else 1 x 512 with 2 warps (64 tokens of H = 2048: 256 programs)."""
    T, k, H = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = x.new_empty(T, H)
    assert out.shape == (T, H) and out.stride(-1) == 1, (out.shape, out.stride())
    if T == 0:
        return out
    many = T >= 512
    block_t = block_t or (2 if many else 1)
    block_h = min(block_h or (1024 if many else 512), triton.next_power_of_2(H))
    num_warps = num_warps or (4 if many else 2)
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    _moe_sum_kernel[grid](
        x,
        out,
        T,
        H,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        TOP_K=k,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return out
