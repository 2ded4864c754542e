"""Split-K without extra launches, shared by the quantized matmul kernels (`w4a16_*`, `fp8_matmul`).

A matmul whose output has too few tiles to fill the GPU splits its K loop over several programs per output tile.
The usual way is `torch.zeros` + fp32 atomics + a cast kernel: three launches. Here the programs of one tile add
their fp32 partial sums into a per-device workspace (`split_k_workspace`) and count themselves on an int32
counter (`split_add`); the last one to arrive reads the sum, writes the tile in the output dtype and sets
workspace and counter back to zero (`split_take`). One launch, no memset, and the buffers are always zero
between calls, so CUDA graphs can replay the kernels as they are.

Host side: `split_for` picks the number of splits from a launch config (`split` fixed, or `target` programs per
SM), `m_bucket` the row bucket of the batched kernels' config tables, `batched_plan` the whole launch plan of a
batched (M > 1) split-K kernel.

Batch-invariant mode (`EngineConfig.batch_invariant`, vLLM's `VLLM_BATCH_INVARIANT`; the model runner calls
`set_batch_invariant`): split-K is off (the fp32 atomic adds of a split sum in arrival order, and the number of
splits follows the grid, so M; a caller's explicit `split_k` still wins) and every M takes the row bucket 16's
config, so a row's K loop (tile sizes, order) does not depend on how many rows the call has. Which kernel runs at
which M, attention and MoE: `batch_invariant.py`.
"""

import torch
import triton
import triton.language as tl

__all__ = [
    'split_add',
    'split_take',
    'store_out',
    'split_k_workspace',
    'workspaces',
    'num_sms',
    'pick_split',
    'split_for',
    'm_bucket',
    'batched_plan',
    'set_batch_invariant',
    'batch_invariant',
]
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)
from cvllm_lab.kernels.batch_invariant import batch_invariant, set_batch_invariant  # the mode's switch, kept here too


@triton.jit
def split_add(y, mask, wsp, cnt_ptr, SPLIT: tl.constexpr):
    """Add the fp32 tile `y` into the workspace at `wsp` and count this program on the counter at `cnt_ptr`; True
    for the last of the SPLIT programs of the tile, which then calls `split_take`."""
    tl.atomic_add(wsp, y, mask=mask, sem='relaxed')
    tl.debug_barrier()  # all of this program's adds before its release below
    return tl.atomic_add(cnt_ptr, 1, sem='acq_rel') == SPLIT - 1


@triton.jit
def split_take(y, mask, wsp, cnt_ptr):
    "The tile's sum, leaving workspace and counter at zero for the next call (no memset, no cast kernel)."
    tot = tl.load(wsp, mask=mask, other=0.0, cache_modifier='.cg')
    tl.debug_barrier()  # every thread has read before any thread zeroes
    tl.store(wsp, tl.zeros_like(y), mask=mask)
    tl.store(cnt_ptr, 0)
    return tot


@triton.jit
def store_out(y, optr, mask, wsp, cnt_ptr, SPLIT: tl.constexpr):
    "Write the fp32 tile `y` to `optr`; with SPLIT > 1 programs per output tile, through the workspace."
    if SPLIT == 1:
        tl.store(optr, y.to(optr.dtype.element_ty), mask=mask)
    else:
        if split_add(y, mask, wsp, cnt_ptr, SPLIT):
            tl.store(optr, split_take(y, mask, wsp, cnt_ptr).to(optr.dtype.element_ty), mask=mask)


_WS, _WS_ALL = {}, []


def split_k_workspace(device, numel, ncounters):
    """The fp32 workspace and int32 counters of the split-K kernels (`store_out`), one pair per device. They start
    at zero and every kernel leaves them at zero. Grown on demand; old buffers are kept alive because CUDA graphs
    captured earlier hold their addresses."""
    key = str(device)
    ws = _WS.get(key)
    if ws is None or ws[0].numel() < numel or ws[1].numel() < ncounters:
        ws = (
            torch.zeros(max(numel, 1 << 22), dtype=torch.float32, device=device),
            torch.zeros(max(ncounters, 1 << 16), dtype=torch.int32, device=device),
        )
        _WS_ALL.append(ws)
        _WS[key] = ws
    return ws


def workspaces():
    "The current `(workspace, counters)` pair of every device (all zero between kernels)."
    return list(_WS.values())


def num_sms(device):
    "Streaming multiprocessors of `device` (1 off CUDA)."
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 1


def pick_split(tiles, want, multiple=1):
    "Largest split s <= want with tiles % s == 0 and (tiles // s) % multiple == 0."
    for s in range(max(1, min(want, tiles)), 0, -1):
        if tiles % s == 0 and (tiles // s) % multiple == 0:
            return s
    return 1


def split_for(cfg, tiles, progs, multiple, device):
    """Splits of `tiles` K-tiles for a launch of `progs` programs per split: `cfg['split']` where it divides them
    into multiples of `multiple`, else enough to bring the grid near `cfg['target']` (default 2) programs per SM.
    Batch-invariant mode: 1."""
    if batch_invariant():
        return 1
    if 'split' in cfg and tiles % cfg['split'] == 0 and (tiles // cfg['split']) % multiple == 0:
        return cfg['split']
    return pick_split(tiles, triton.cdiv(int(cfg.get('target', 2) * num_sms(device)), progs), multiple)


def m_bucket(M):
    "The row bucket (16, 32, 64, 128) of the batched kernels' config tables (16 for every M in batch-invariant mode)."
    if batch_invariant():
        return 16
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


def batched_plan(x, N, tiles, cfg, bm, bn, num_warps, num_stages, split_k, target, out_dtype, what='K-tiles'):
    """Launch plan shared by the batched split-K kernels (one program per N-block, K-split, block of rows): the
    block sizes (`cfg['bm']`, else the row bucket up to 64), warps and stages (arguments over `cfg`), split-K (`cfg['split']` or programs per SM), the output
    and the workspace. Returns `bm, bn, num_warps, num_stages, split_k, out, ws, cnt`."""
    M = x.shape[0]
    default = bn is None and bm is None and target is None
    bm = bm or (16 if _INTERPRET else cfg.get('bm') or max(16, min(m_bucket(M), 64)))
    bn = bn or (32 if _INTERPRET else cfg['bn'])
    grid_mn = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else {'target': target or cfg.get('target', 2)}, tiles, grid_mn, 1, x.device)
    elif tiles % split_k:
        raise ValueError(f'split_k={split_k} must divide the {tiles} {what}')
    ws, cnt = split_k_workspace(x.device, M * N, grid_mn)
    return (
        bm,
        bn,
        num_warps or cfg['num_warps'],
        num_stages or cfg['num_stages'],
        split_k,
        torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device),
        ws,
        cnt,
    )
