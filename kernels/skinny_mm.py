"""Few-row dense matmul for decode batches: `y = x @ W.T` for bf16/fp16 `x [M, K]`, `W [N, K]` (nn.Linear's layout)
and M up to 128, and its dispatch `dense_linear` between this kernel and `F.linear` (cuBLAS).

At decode batch sizes a linear layer reads its whole weight to do little math (M = 64 rows: 64 FLOP per weight
byte), so it runs at the rate the weight streams from HBM. cuBLAS's kernels for these shapes leave part of that
rate unused where the output has few tiles (the 8B model's qkv and o at 2.3-3.0 TB/s of the 4.2 the H200 reads).
`_skinny_mm_kernel` computes the transposed product, `y.T[BN, BM] = W[BN, K] @ x.T[K, BM]`, so the weight tile is
the tensor-core operand whose M side is large (BN >= 64) and the few rows of x are the narrow side (BM = 16 to 128),
and splits K over several programs per output tile where the grid would be too small; the partial sums meet in
the self-zeroing workspace of `split_k` (one launch). Weight tiles are streamed (`evict_first`) through the
software pipeline's shared-memory stages; x stays in L2.

| M | N, K (this GPU's tuned shapes) | runs |
|---|---|---|
| 1-128 | listed in `configs/skinny_mm/<device>.json` for the row bucket (16, 32, 64, 128) | `_skinny_mm_kernel` |
| otherwise | | `F.linear` |

Which shapes and buckets take the kernel, and its launch config there (`bn`, `bk`, `num_warps`, `num_stages`,
`split`), is tuned data written by `benchmarks/kernels/tune_skinny_mm.py`; `default.json` lists none, so every GPU
without its own file keeps cuBLAS. The row bucket, not M, picks the block of rows (`BM`), so the binaries are one
per (shape, bucket) and the runner's warm-up steps (one per power of two of tokens) compile them.
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cvllm_lab.kernels.split_k import m_bucket, split_k_workspace, store_out
from cvllm_lab.kernels.tuned import configs_for

__all__ = ['skinny_mm', 'skinny_mm_ref', 'skinny_config', 'dense_linear']
_INTERPRET = os.environ.get('TRITON_INTERPRET', '0') == '1'
MAX_M = 128


def skinny_mm_ref(x, weight, bias=None):
    "`x @ weight.T (+ bias)` in PyTorch (`F.linear`)."
    return F.linear(x, weight, bias)


@triton.jit(do_not_specialize=['M', 'stride_xm', 'stride_om'])
def _skinny_mm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om, TPS,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
    """y.T[BN, BM] for the BN rows of W of program axis 0 and the TPS K-tiles of axis 1: the sum of
    `W[BN, BK] @ x.T[BK, BM]` over them (fp32), plus the bias, written through `store_out`."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rn_c = tl.minimum(rn, N - 1)                       # rows past N re-read the last one; masked at the store
    wp = w_ptr + rn_c.to(tl.int64)[:, None] * K + rk[None, :]                 # [BN, BK]
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[None, :] * stride_xm + rk[:, None]   # [BK, BM] = x.T
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS):
        if EVEN_K:
            w = tl.load(wp + t * BK, eviction_policy='evict_first')
            xt = tl.load(xp + t * BK)
        else:
            km = (t * BK + rk) < K
            w = tl.load(wp + t * BK, mask=km[None, :], other=0.0, eviction_policy='evict_first')
            xt = tl.load(xp + t * BK, mask=km[:, None], other=0.0)
        if DOT_F32:   # the Triton interpreter mis-multiplies 16-bit dots
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
    if HAS_BIAS:
        if pid_k == 0:   # one split adds the bias
            acc += tl.load(b_ptr + rn_c).to(tl.float32)[:, None]
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    optr = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
    store_out(acc, optr, mask, ws_ptr + rm[None, :] * N + rn[:, None], cnt_ptr + pid_n, SPLIT)


def skinny_mm(x, weight, bias=None, bn=64, bk=128, num_warps=4, num_stages=4, split=1, out=None):
    """`x [M, K] @ weight [N, K].T (+ bias [N])` -> `[M, N]` in x's dtype with `_skinny_mm_kernel`, M <= 128;
    `split` programs per block of `bn` rows of W share its K-tiles (it must divide them)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_M or M == 0: raise ValueError(f"skinny_mm takes 1 to {MAX_M} rows, got {M}")
    if weight.shape[1] != K or weight.stride(-1) != 1 or weight.stride(0) != K:
        raise ValueError(f"weight must be a contiguous [N, {K}], got {tuple(weight.shape)} strides {weight.stride()}")
    if x.stride(-1) != 1: x = x.contiguous()
    tiles = triton.cdiv(K, bk)
    if tiles % split: raise ValueError(f"split={split} must divide the {tiles} K-tiles of {bk}")
    bm = m_bucket(M)
    progs = triton.cdiv(N, bn)
    if out is None: out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, bm * N, progs)
    _skinny_mm_kernel[(progs, split)](
        x, weight, bias if bias is not None else weight, out, ws, cnt, M, N, K, x.stride(0), out.stride(0),
        tiles // split, BM=bm, BN=bn, BK=bk, EVEN_K=K % bk == 0, SPLIT=split, HAS_BIAS=bias is not None,
        DOT_F32=_INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out


def skinny_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    "The tuned launch config of `skinny_mm` for this shape and row bucket on `device`, or None (cuBLAS runs)."
    if device.type != 'cuda' or _INTERPRET or not 0 < M <= MAX_M or dtype not in (torch.bfloat16, torch.float16):
        return None
    return configs_for('skinny_mm', device)['shapes'].get((N, K, m_bucket(M)))


def dense_linear(x, weight, bias=None):
    "`F.linear(x, weight, bias)`, through `skinny_mm` where this GPU's tuned table lists the shape and row bucket."
    cfg = skinny_config(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device) if x.dim() == 2 else None
    if cfg is None or weight.dtype != x.dtype or not weight.is_contiguous(): return F.linear(x, weight, bias)
    return skinny_mm(x, weight, bias, **cfg)
