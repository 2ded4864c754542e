"""The MoE router's softmax, top-k and renormalization in one Triton launch: `fused_topk`.

`select_experts` (`fused_moe`) writes the router as `transformers` does: fp32 softmax over the E experts, top-k,
optionally the k weights divided by their sum. In PyTorch that is five launches (softmax, topk, sum, divide, the
int32 cast of the ids); at decode sizes each costs a few microseconds of launch gap, for a few hundred bytes.
`_topk_softmax_kernel` does all of it per block of `ROWS` token rows: load the `[ROWS, E]` logits, softmax in fp32,
then k rounds of "take the row maximum, record it and its first index, knock it out", then the renormalization.

    router_logits [T, E] --one launch--> topk_weights [T, k] fp32, topk_ids [T, k] int32

Ties pick the lowest expert index (as `torch.topk` does on the GPU in practice; with real-valued logits ties have
measure zero). Rows are independent, so the result does not depend on the batch.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait

__all__ = ['fused_topk', 'FUSED_TOPK_MAX_EXPERTS']
FUSED_TOPK_MAX_EXPERTS = 1024  # one row's logits stay in registers up to this many experts


@triton.jit(do_not_specialize=['T'])
def _topk_softmax_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    stride_l,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    ROWS: tl.constexpr,
    RENORM: tl.constexpr,
    PDL: tl.constexpr,
):
    "Rows `pid * ROWS ..`: fp32 softmax over E, the k largest (first index on ties), optionally renormalized."
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < T
    cols = tl.arange(0, E_P2)
    cmask = cols < E
    pdl_wait(PDL)
    pdl_launch(PDL)
    rows_c = tl.minimum(rows, T - 1)  # rows past T repeat the last one (not stored)
    lg = tl.load(
        logits_ptr + rows_c.to(tl.int64)[:, None] * stride_l + cols[None, :], mask=cmask[None, :], other=float('-inf')
    ).to(tl.float32)
    mx = tl.max(lg, axis=1)
    p = tl.exp(lg - mx[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(cmask[None, :], p, -1.0)  # padding columns are never picked
    kk = tl.arange(0, K_P2)
    wsel = tl.zeros([ROWS, K_P2], dtype=tl.float32)
    isel = tl.zeros([ROWS, K_P2], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], E_P2), axis=1)
        wsel = tl.where(kk[None, :] == j, best[:, None], wsel)
        isel = tl.where(kk[None, :] == j, idx[:, None], isel)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)
    if RENORM:
        wsel = wsel / tl.sum(wsel, axis=1)[:, None]
    omask = rmask[:, None] & (kk[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(w_ptr + offs, wsel, mask=omask)
    tl.store(ids_ptr + offs, isel, mask=omask)


def fused_topk(router_logits, top_k: int, renormalize: bool, rows: int | None = None):
    """`select_experts`' softmax routing in one Triton launch: `router_logits [T, E]` (any float dtype) ->
    `topk_weights [T, k]` fp32, `topk_ids [T, k]` int32. `rows`: token rows per program (default by E)."""
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f'top_k={top_k} must be in 1..{E}')
    if E > FUSED_TOPK_MAX_EXPERTS:
        raise ValueError(f'{E} experts: fused_topk holds at most {FUSED_TOPK_MAX_EXPERTS}')
    lg = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    w = torch.empty(T, top_k, dtype=torch.float32, device=lg.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=lg.device)
    if T == 0:
        return w, ids
    e_p2 = triton.next_power_of_2(E)
    rows = rows or max(1, min(16, 2048 // e_p2, triton.next_power_of_2(T)))
    _topk_softmax_kernel[(triton.cdiv(T, rows),)](
        lg,
        w,
        ids,
        T,
        E,
        lg.stride(0),
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        E_P2=e_p2,
        ROWS=rows,
        RENORM=renormalize,
        num_warps=4,
        **pdl_kw(lg.device),
    )
    return w, ids
