"""`y = x @ W.T (+ b)` whose rows do not depend on how many rows there are: batch-invariant mode's dense matmul on a
GPU (vLLM's `VLLM_BATCH_INVARIANT` replaces `aten::mm` the same way).

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's M, so one row of `x @ W.T` is summed in a
different order, and rounded differently, when the batch around it changes: a greedy stream's logits move when
another request joins the step. Here one launch configuration serves every M:

    x [M, K] ──> programs over (row block of BM, column block of BN) ──> y [M, N]
                  each: acc fp32 [BM, BN] = sum over K in BK steps, in order, of x tile @ W tile.T
                  (no split-K, no atomics; rows past M are loaded as zeros and never stored)

so row i of `y` is a function of row i of `x` and of `W` alone. The layers reach it through `batch_invariant.linear`
(their `F.linear`), which calls it for CUDA tensors in batch-invariant mode. Its cost against cuBLAS is measured by
`benchmarks/gpu_batch_invariant.py`; the rows' independence of M is tested under the interpreter
(`tests/test_batch_invariant_kernels.py`) and on a GPU (`-m cuda`).
"""

import torch
import triton
import triton.language as tl


__all__ = ['matmul_invariant', 'matmul_invariant_ref', 'INVARIANT_CONFIG']

# The one configuration: 64 x 64 output tiles (M >= 16 for `tl.dot`), K in steps of 64. Not tuned per M by design.
INVARIANT_CONFIG = dict(BM=64, BN=64, BK=64, GROUP_M=8, num_warps=4, num_stages=3)


@triton.jit
def _matmul_invariant_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    sxm, sxk, swn, swk, sym, syn,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # grouped program order (GROUP_M row blocks share the W column blocks they read while those are in L2); the order
    # changes which program computes a tile, not how a tile is summed
    pid = tl.program_id(0)
    nm, nn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * nn)
    first = group * GROUP_M
    gm = min(nm - first, GROUP_M)
    pm = first + (pid % (GROUP_M * nn)) % gm
    pn = (pid % (GROUP_M * nn)) // gm
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = x_ptr + rm[:, None] * sxm + rk[None, :] * sxk
    wp = w_ptr + rn[None, :] * swn + rk[:, None] * swk  # W.T's [BK, BN] tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kk = k * BK + rk
        a = tl.load(xp, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(wp, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        xp += BK * sxk
        wp += BK * swk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    yp = y_ptr + rm[:, None] * sym + rn[None, :] * syn
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_invariant(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    "`x [..., K] @ w[N, K].T (+ bias)` in x's dtype, with fp32 sums, the same per-row arithmetic at every M."
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K, (tuple(x.shape), tuple(w.shape))
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    c = INVARIANT_CONFIG
    grid = (triton.cdiv(M, c['BM']) * triton.cdiv(N, c['BN']),)
    _matmul_invariant_kernel[grid](
        x2, w, bias if bias is not None else w, y, M, N, K,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BM=c['BM'], BN=c['BN'], BK=c['BK'], GROUP_M=c['GROUP_M'],
        num_warps=c['num_warps'], num_stages=c['num_stages'],
    )  # fmt: skip
    return y.reshape(*lead, N)


def matmul_invariant_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    "Reference: fp32 matmul, cast to x's dtype."
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
