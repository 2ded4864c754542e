"""`moe_align_block_size` for many assignments (decode batches of hundreds of tokens, prefill): three launches.

The one-program kernel of `fused_moe` walks the assignments serially, which is right for a decode step of a few
tokens; the device-wide PyTorch version (`moe_align_block_size_ref`) is about thirty small launches. Here the
`n = T*k` assignments are cut into G chunks of `CHUNK`:

    launch 1  _align_count_kernel    grid (G,)  counts[g, e]: assignments of chunk g routed to expert e; and
                                                1/G of the sentinel fill of sorted_token_ids (in parallel: one
                                                program filling all em slots is most of the alignment's time)
    launch 2  _align_offsets_kernel  grid (1,)  per expert: total, padded to block_m, prefix sums -> the block
                                                experts, num_tokens_post_padded; per chunk and
                                                expert the first free slot: base[g, e] = start_e + counts of the
                                                earlier chunks (a cumsum over g, in [GB, E] tiles)
    launch 3  _align_scatter_kernel  grid (G,)  assignment i of chunk g -> slot base[g, e_i] + (rank of i among
                                                chunk g's assignments to e_i)

The result equals `moe_align_block_size_ref`'s exactly: within an expert the assignments stay in token order.
"""
import torch
import triton
import triton.language as tl

__all__ = ['moe_align_block_size_grid']


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, n, EM, fill_per,
                        E_P2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
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
def _align_offsets_kernel(counts_ptr, base_ptr, expert_ids_ptr, ntpp_ptr, EM, G,
                          BM: tl.constexpr, E_P2: tl.constexpr, GB: tl.constexpr):
    "Per-expert totals, padded prefix sums, block experts; each chunk's first slot per expert."
    experts = tl.arange(0, E_P2)
    gs = tl.arange(0, GB)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for g0 in range(0, G, GB):
        c = tl.load(counts_ptr + (g0 + gs)[:, None] * E_P2 + experts[None, :], mask=(g0 + gs < G)[:, None], other=0)
        counts += tl.sum(c, axis=0)
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(ntpp_ptr, total)
    for c0 in range(0, EM // BM, GB):
        start = (c0 + gs) * BM                           # a block's expert: how many experts end at or before it
        eid = tl.sum((pend[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + c0 + gs, tl.where(start < total, eid, -1), mask=c0 + gs < EM // BM)
    carry = pend - padded                                # each expert's first slot
    for g0 in range(0, G, GB):
        m = (g0 + gs < G)[:, None]
        c = tl.load(counts_ptr + (g0 + gs)[:, None] * E_P2 + experts[None, :], mask=m, other=0)
        tl.store(base_ptr + (g0 + gs)[:, None] * E_P2 + experts[None, :], carry[None, :] + tl.cumsum(c, axis=0) - c,
                 mask=m)
        carry += tl.sum(c, axis=0)


@triton.jit
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, n, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    "Chunk g's assignments into their experts' slots, in order."
    g = tl.program_id(0)
    rows = g * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_P2)
    e = tl.load(ids_ptr + rows, mask=rows < n, other=E_P2).to(tl.int32)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1     # among this chunk's same-expert rows
    base = tl.sum(onehot * tl.load(base_ptr + g * E_P2 + experts)[None, :], axis=1)
    tl.store(sorted_ptr + base + rank, rows, mask=rows < n)


def moe_align_block_size_grid(ids, em: int, block_m: int, num_experts: int):
    """`moe_align_block_size` of the flat int `ids [n]` into `sorted_token_ids [em]`, `expert_ids [em // block_m]`,
    `num_tokens_post_padded [1]` (all int32) in three launches (see the module docstring)."""
    n, dev = ids.numel(), ids.device
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 16384 // e_p2))
    G = triton.cdiv(n, chunk)
    counts = torch.empty(G, e_p2, dtype=torch.int32, device=dev)
    base = torch.empty(G, e_p2, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(em, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(em // block_m, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    fill_per = triton.cdiv(em, G)
    _align_count_kernel[(G,)](ids, counts, sorted_ids, n, em, fill_per, E_P2=e_p2, CHUNK=chunk,
                              FILL=min(1024, triton.next_power_of_2(fill_per)), num_warps=8)
    _align_offsets_kernel[(1,)](counts, base, expert_ids, ntpp, em, G, BM=block_m, E_P2=e_p2,
                                GB=max(16, min(64, 8192 // e_p2)), num_warps=8)
    _align_scatter_kernel[(G,)](ids, base, sorted_ids, n, E_P2=e_p2, CHUNK=chunk, num_warps=8)
    return sorted_ids, expert_ids, ntpp
