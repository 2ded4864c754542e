"""Prototype: GEMV whose word tiles come by TMA through a num_stages-deep shared-memory pipeline (no register prefetch)."""
import torch, triton, triton.language as tl
from cvllm_lab.kernels import w4a16 as W

@triton.jit
def _gemv_tma_kernel(x_ptr, qw_desc, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, TPS, ONE,
                     G: tl.constexpr, BN: tl.constexpr, NH: tl.constexpr, SPLIT: tl.constexpr, NS: tl.constexpr,
                     ACT: tl.constexpr):
    C: tl.constexpr = 16
    BNH: tl.constexpr = BN // NH
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    col0 = pid_n * BN
    rn = col0 + tl.arange(0, BNH)
    rc = tl.arange(0, C)
    nmask = rn < N
    nmask2 = rn + BNH < N
    acc = tl.zeros([C, BNH], dtype=tl.float32)
    acc2 = tl.zeros([C, BNH], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in tl.range(t0, t0 + TPS, num_stages=NS):
        w0 = qw_desc.load([t * C, col0])
        w1 = w0
        if NH == 2:
            w1 = qw_desc.load([t * C, col0 + BNH])
        acc, acc2 = W._gemv_tile(acc, acc2, w0, w1, x_ptr + t * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, nmask2,
                                 t * 128, K, ONE, 4, G, True, True, NH, BNH)
    W._gemv_end(acc, acc2, out_ptr, ws_ptr, cnt_ptr + pid_n, rn, nmask, nmask2, col0, N, BNH, NH, ACT, SPLIT)


def gemv_tma(x, qweight, scales, offsets, N, K, bn=128, nh=2, split_k=4, ns=3, num_warps=4, act=None, desc=None):
    from triton.tools.tensor_descriptor import TensorDescriptor
    tiles = K // 128
    desc = desc or TensorDescriptor.from_tensor(qweight, [16, bn // nh])
    out = torch.empty(1, N // 2 if act else N, dtype=x.dtype, device=x.device)
    progs = N // bn
    ws, cnt = W.split_k_workspace(x.device, N, progs)
    _gemv_tma_kernel[(progs, split_k)](x, desc, scales, offsets, out, ws, cnt, N, K, tiles // split_k, W._ONE,
                                       G=128, BN=bn, NH=nh, SPLIT=split_k, NS=ns, ACT=bool(act),
                                       num_warps=num_warps)
    return out
