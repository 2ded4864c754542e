"""`moe_align_block_size` for many assignments (decode batches of hundreds of tokens, prefill): three launches.

The one-program kernel of `fused_moe` walks the assignments serially, which is right for a decode step of a few
tokens; the device-wide PyTorch version (`moe_align_block_size_ref`) is about thirty small launches. Here the
`n = T*k` assignments are cut into G chunks of `CHUNK`, and no launch has a loop longer than a few steps at
prefill sizes (n = 65,536: G = 512 chunks of 128 for 128 experts):

    launch 1  _align_count_kernel    grid (G,)       counts[g, e]: assignments of chunk g routed to expert e; and
                                                     1/G of the sentinel fill of sorted_token_ids
    launch 2  _align_offsets_kernel  grid (E / EB,)  per expert column, one [G, EB] tile: the exclusive cumsum over
                                                     chunks, base[g, e] = counts of chunks < g routed to e; and
                                                     totals[e] (the column sums)
    launch 3  _align_scatter_kernel  grid (G,)       every program: the padded per-expert totals and their prefix
                                                     sum over experts (E values) -> start_e; assignment i of chunk g
                                                     -> slot start_e + base[g, e_i] + (rank of i among chunk g's
                                                     assignments to e_i); 1/G of the block experts (a block's
                                                     expert: how many experts end at or before its first slot);
                                                     program 0 writes num_tokens_post_padded

The result equals `moe_align_block_size_ref`'s exactly: within an expert the assignments stay in token order.
"""

import torch
import triton
import triton.language as tl

__all__ = ['moe_align_block_size_grid']


@triton.jit(do_not_specialize=['n', 'EM', 'fill_per'])
def _align_count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, n, EM, fill_per, E_P2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr
):
    "counts[g, e] of chunk g; sorted_token_ids[g * fill_per : (g + 1) * fill_per] = n (the padding sentinel)."
    g = tl.program_id(0)
    fill = tl.arange(0, FILL)
    end = tl.minimum((g + 1) * fill_per, EM)
    for c0 in range(g * fill_per, end, FILL):
        tl.store(sorted_ptr + c0 + fill, tl.zeros([FILL], dtype=tl.int32) + n, mask=c0 + fill < end)
    rows = g * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_P2)
    e = tl.load(ids_ptr + rows, mask=rows < n, other=E_P2).to(tl.int32)
    tl.store(counts_ptr + g * E_P2 + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))


@triton.jit
def _align_offsets_kernel(counts_ptr, base_ptr, totals_ptr, G, E_P2: tl.constexpr, EB: tl.constexpr, GB: tl.constexpr):
    "Columns [p * EB, (p + 1) * EB): base[g, e] = sum of counts[:g, e] (one [GB, EB] tile per GB chunks), totals[e]."
    cols = tl.program_id(0) * EB + tl.arange(0, EB)
    gs = tl.arange(0, GB)
    carry = tl.zeros([EB], dtype=tl.int32)
    for g0 in range(0, G, GB):  # one step while G <= GB
        m = (g0 + gs < G)[:, None]
        offs = (g0 + gs)[:, None] * E_P2 + cols[None, :]
        c = tl.load(counts_ptr + offs, mask=m, other=0)
        tl.store(base_ptr + offs, carry[None, :] + tl.cumsum(c, axis=0) - c, mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + cols, carry)


@triton.jit(do_not_specialize=['n', 'NB', 'nb_per'])
def _align_scatter_kernel(
    ids_ptr,
    base_ptr,
    totals_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    n,
    NB,
    nb_per,
    BM: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    EXB: tl.constexpr,
):
    "Chunk g's assignments into their experts' slots, in order; block experts [g * nb_per, (g + 1) * nb_per)."
    g = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    padded = (tl.load(totals_ptr + experts) + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)  # where each expert's padded run ends
    total = tl.sum(padded, axis=0)
    if g == 0:
        tl.store(ntpp_ptr, total)
    bs = tl.arange(0, EXB)
    end = tl.minimum((g + 1) * nb_per, NB)
    for b0 in range(g * nb_per, end, EXB):  # one step while nb_per <= EXB
        start = (b0 + bs) * BM
        eid = tl.sum((pend[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b0 + bs, tl.where(start < total, eid, -1), mask=b0 + bs < end)
    rows = g * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + rows, mask=rows < n, other=E_P2).to(tl.int32)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)
    first = pend - padded + tl.load(base_ptr + g * E_P2 + experts)  # chunk g's first slot of each expert
    # row i's slot: first[e_i] + (rows <= i of this chunk routed to e_i) - 1, picked from its one-hot row
    dest = tl.sum(onehot * (first[None, :] + tl.cumsum(onehot, axis=0) - 1), axis=1)
    tl.store(sorted_ptr + dest, rows, mask=rows < n)


def moe_align_block_size_grid(ids, em: int, block_m: int, num_experts: int, num_warps: int = 4):
    """`moe_align_block_size` of the flat int `ids [n]` into `sorted_token_ids [em]`, `expert_ids [em // block_m]`,
    `num_tokens_post_padded [1]` (all int32) in three launches (see the module docstring). `num_warps` of the count
    and scatter launches: at 128 experts 4 warps keep the scatter's `[128, 128]` one-hot cumsum in registers (93, no
    spills, for sm_90), where 8 warps stage it through 64 KB of shared memory and 2 spill."""
    n, dev = ids.numel(), ids.device
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 16384 // e_p2))
    G = triton.cdiv(n, chunk)
    counts = torch.empty(G, e_p2, dtype=torch.int32, device=dev)
    base = torch.empty(G, e_p2, dtype=torch.int32, device=dev)
    totals = torch.empty(e_p2, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(em, dtype=torch.int32, device=dev)
    nb = em // block_m
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    fill_per = triton.cdiv(em, G)
    _align_count_kernel[(G,)](
        ids,
        counts,
        sorted_ids,
        n,
        em,
        fill_per,
        E_P2=e_p2,
        CHUNK=chunk,
        FILL=min(1024, triton.next_power_of_2(fill_per)),
        num_warps=num_warps,
    )
    gb = min(1024, triton.next_power_of_2(G))
    eb = min(e_p2, max(1, 4096 // gb))  # a [GB, EB] tile of at most 4096 counts per program
    _align_offsets_kernel[(e_p2 // eb,)](counts, base, totals, G, E_P2=e_p2, EB=eb, GB=gb, num_warps=4)
    nb_per = triton.cdiv(nb, G)
    _align_scatter_kernel[(G,)](
        ids,
        base,
        totals,
        sorted_ids,
        expert_ids,
        ntpp,
        n,
        nb,
        nb_per,
        BM=block_m,
        E_P2=e_p2,
        CHUNK=chunk,
        EXB=min(64, max(16, triton.next_power_of_2(nb_per))),
        num_warps=num_warps,
    )
    return sorted_ids, expert_ids, ntpp
