"""W4A16 for 1 .. 8 rows on `mma.sync` tensor cores, the fragments built in registers: `_mma_kernel`, `w4a16_mma`.

The GEMV (`w4a16_gemv`) turns every weight into an fp32 and spends an FMA on it: ~3 instructions per weight, so it
is issue-bound at about 70% of the rate at which the words stream in. Here the weights are the A operand of
`mma.m16n8k16` (bf16 or fp16) and x is B, with up to 8 rows of x as B's 8 columns (so M = 1 .. 8 cost the same).
No shared memory and no layout conversion: every thread loads exactly the words that its A fragment needs.

Why that needs no repacking. An A fragment gives thread `(g, t)` (lane `4g + t`) rows `g`, `g + 8` and K slots
`2t, 2t+1, 2t+8, 2t+9`; its registers are `{a0 a1}` (row g, slots 2t, 2t+1), `{a2 a3}` (row g+8, same slots),
`{a4 a5}` (row g, slots 2t+8, 2t+9) and `{a6 a7}`. The K slots are labels: any K may stand behind a slot as long
as B puts the same x there. One LOP3 on a layout word (8 fields of one column) with mask `0x000F000F` keeps
fields j and j + 4 in the two halves of a register, ORed into the exponent of 128 (bf16 `0x4300`, fp16 `1024`),
which is `128 + q` exactly: one register of A. So for word row `c`:

| A register | row | word | fields (K = j * 16 + c) | B register (x pairs) |
|---|---|---|---|---|
| a0 a1 | g | column n_g | 0, 4 (`w & m`) | x[c], x[64 + c] |
| a2 a3 | g + 8 | column n_g' | 0, 4 | |
| a4 a5 | g | column n_g | 1, 5 (`w >> 4`) | x[16 + c], x[80 + c] |
| a6 a7 | g + 8 | column n_g' | 1, 5 | |

and the next MMA takes fields 2, 6 and 3, 7 (`w >> 8`, `w >> 12`). Per 8 weights: 3 shifts, 4 LOP3 and one MMA.

Each thread loads 4 neighbouring columns of one word row (16 bytes): two MMA tiles, rows (g, g+8) = columns
(n, n+1) and (n+2, n+3). The 4 lanes of a group take word rows `4t + i` of the K-tile for `i` = 0..3, so a warp
reads 4 rows x 128 contiguous bytes per load. x comes as eight 8-byte runs per K-tile (`x[j*16 + 4t .. +3]`), and
one PRMT per register pairs two runs' elements into B's order. `D = sum (128 + q) x`, so an MMA with A = 1 gives
`sum x`, and the epilogue applies `scale * (D - 128 sum x) + offset * sum x` per K-tile (the scales' group is a
multiple of 128); symmetric layers: `scale * (D - 136 sum x)`, no offsets read. In all about 0.4 instructions per
weight (the GEMV: ~3), so the kernel waits on memory, not on issue.

A program owns `NH * num_warps * 32` columns and a run of K-tiles; the next K-tile's words and scales are loaded
before this one's MMAs, and split-K programs meet in the self-zeroing workspace of `split_k`, or, given an fp32
accumulator (`acc`: a residual stream the products are added to), add their partial sums straight into it. The
register-level pieces (PTX, and their emulation under the Triton interpreter) are in `w4a16_frag`, one K-tile's
loads and MMAs in `w4a16_mma_tile`; this module holds the kernel with its stores and the launcher.

Two more inputs serve the fp32 residual stream of a decode step (`LlamaDecoderLayer.forward_acc`), where every
matmul adds into fp32 sums and no kernel sits between them: `x_act` takes x as a fused gate/up layer's fp32 sums
(interleaved pairs) and activates `silu(gate) * up` as the runs are loaded (one 32-byte load per run, one EX2 and
one RCP per element), and `zero` has the programs clear a buffer between them (the sums the next matmuls add into).
The stream's RMSNorms are split around their matmuls (`DeferredRMS`): `norm` reads x as the fp32 residual times the
norm's weight and has the first column block's programs add the rows' sums of squares into `ssq`; `x_rms` scales
`x_act`'s gate/up sums by the norm's `1/rms` before the activation. So no norm kernel sits between the matmuls either.

The mapping of tensor rows to lanes: every `[R, 4]` tensor has Triton's blocked layout with 4 elements per
thread and row `r` on lane `r % 32` of warp `r // 32`, which the 16-byte word loads fix (checked by the GPU tests:
a different layout gives wrong numbers, not a silent slowdown). Up to 8 rows of x are B's 8 columns, but the
tensor-core kernel (`w4a16_tc`) is faster there, so `w4a16_matmul` takes this kernel at M = 1 only.
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import split_for, split_k_workspace
from cvllm_lab.kernels.tuned import configs_for
from cvllm_lab.kernels.w4a16_layout import TILE_K, check_layout
from cvllm_lab.kernels.w4a16_mma_tile import tile_math, tile_weights, x_runs

__all__ = ['MMA_MAX_M', 'mma_supported', 'w4a16_mma']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)

MMA_MAX_M = 8


@triton.jit
def _ssq_add(sq, r, g, M, ssq_ptr, stride_ssq):
    """Add the residual's sum of squares over this program's K-tiles into `ssq[m]`: lane group g of warp 0 holds row
    g's runs (`sq` [R, 4] per lane; the other warps and groups hold copies). One masked lane adds per row."""
    for m in tl.static_range(8):
        if m < M:
            tot = tl.sum(tl.sum(tl.where((r < 32) & (g == m), sq, 0.0), 1), 0)
            tl.atomic_add(
                ssq_ptr + m * stride_ssq + r * 0, tl.zeros_like(r).to(tl.float32) + tot, mask=r == 0, sem='relaxed'
            )


@triton.jit
def _zero_part(z_ptr, ZN, BLOCK: tl.constexpr):
    "This program's share of the `ZN` floats at `z_ptr`, zeroed (a buffer a later kernel adds into)."
    progs = tl.num_programs(0) * tl.num_programs(1)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    per = tl.cdiv(ZN, progs)
    lo = pid * per
    hi = tl.minimum(lo + per, ZN)
    for i in range(lo, hi, BLOCK):
        o = i + tl.arange(0, BLOCK)
        tl.store(z_ptr + o, tl.zeros([BLOCK], dtype=tl.float32), mask=o < hi)


@triton.jit
def _mma_put(tot, fcol, b, out_ptr, ws_ptr, M, N, ACT: tl.constexpr, SPLIT: tl.constexpr, LAST: tl.constexpr):
    """Write (or add into the split-K workspace) one tile's totals: element c of a thread is row `b + c % 2` of x,
    column `fcol + c // 2` (ACT: gate, up; the output column `fcol / 2`)."""
    e = tl.arange(0, 4)[None, :]
    row = b + e % 2
    col = fcol + e // 2
    mask = (row < M) & (col < N)
    if SPLIT > 1:
        tl.atomic_add(ws_ptr + row * N + col, tot, mask=mask, sem='relaxed')
    if LAST:
        if ACT:
            g0 = tl.sum(tl.where(e == 0, tot, 0.0), 1)
            g1 = tl.sum(tl.where(e == 1, tot, 0.0), 1)
            u0 = tl.sum(tl.where(e == 2, tot, 0.0), 1)
            u1 = tl.sum(tl.where(e == 3, tot, 0.0), 1)
            bb = tl.reshape(b, [b.shape[0]])
            oc = tl.reshape(fcol, [b.shape[0]]) // 2
            ok = oc < N // 2
            tl.store(
                out_ptr + bb * (N // 2) + oc,
                (g0 * tl.sigmoid(g0) * u0).to(out_ptr.dtype.element_ty),
                mask=ok & (bb < M),
            )
            tl.store(
                out_ptr + (bb + 1) * (N // 2) + oc,
                (g1 * tl.sigmoid(g1) * u1).to(out_ptr.dtype.element_ty),
                mask=ok & (bb + 1 < M),
            )
        else:
            tl.store(out_ptr + row * N + col, tot.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mma_take(tot, fcol, b, ws_ptr, M, N):
    "The summed tile from the split-K workspace (zeroed behind)."
    e = tl.arange(0, 4)[None, :]
    row = b + e % 2
    col = fcol + e // 2
    mask = (row < M) & (col < N)
    p = ws_ptr + row * N + col
    s = tl.load(p, mask=mask, other=0.0, cache_modifier='.cg')
    tl.debug_barrier()
    tl.store(p, tl.zeros_like(tot), mask=mask)
    return s


@triton.jit
def _mma_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    z_ptr,
    g_ptr,
    ssq_ptr,
    M,
    N,
    K,
    stride_xm,
    TPS,
    ZN,
    stride_ssq,
    inv_n,
    eps,
    G: tl.constexpr,
    NW: tl.constexpr,
    NH: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    ACT: tl.constexpr,
    SYM: tl.constexpr,
    F16: tl.constexpr,
    ACC: tl.constexpr,
    ACT_X: tl.constexpr,
    ZERO: tl.constexpr,
    NORM_X: tl.constexpr,
    RMS_X: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] W[n, k] for m < M <= 8. Program axis 0 owns NH * NW * 32 columns (NH word tensors
    of 4 columns per thread, 32 columns per warp), axis 1 the TPS K-tiles of one split (`split_k`'s workspace joins
    the splits; ACC: every program adds its sums into `out_ptr`, an fp32 accumulator, instead). Per K-tile: the
    next tile's words and scales are loaded into registers, then this tile's x and MMAs run. The first tile's words
    load before `pdl_wait` (weights, which no kernel writes). ACT_X: x is fp32 gate/up pairs, activated on load
    (`x_runs`; RMS_X: scaled by `rsqrt(ssq[m] * inv_n + eps)` first); ZERO: the programs also zero the `ZN` floats at
    `z_ptr` between them. NORM_X: x is an fp32 residual, the input `g * x` (`g_ptr`: an RMSNorm's weight), and the
    programs of column block 0 add the rows' sums of squares into `ssq` (`_ssq_add`) for the consumer's 1/rms."""
    R: tl.constexpr = NW * 32
    r = tl.arange(0, R)[:, None]
    e = tl.arange(0, 4)[None, :]
    lane = r % 32
    g = lane // 4
    tq = lane % 4
    pid_n = tl.program_id(0)
    fb = pid_n * (NH * R) + (r // 32) * 32 + 4 * g  # [R, 1]: first of the thread's 4 columns (tensor A)
    colA = fb + e
    colB = colA + R
    nmA = colA < N
    nmB = colB < N
    wpA = qw_ptr + (4 * tq) * N + colA  # word row 4t of K-tile 0
    wpB = wpA + R
    b = tl.minimum(g, M - 1)  # x row of this lane group (B column g)
    xp = x_ptr + b.to(tl.int64) * stride_xm
    xk = 4 * tq + e
    t0 = tl.program_id(1) * TPS
    last = t0 + TPS - 1
    a0, a1, a2, a3, b0, b1, b2, b3, scA, ofA, scB, ofB = tile_weights(
        wpA, wpB, s_ptr, o_ptr, t0, N, colA, colB, nmA, nmB, G, NH, SYM, EVEN_N
    )
    pdl_wait(PDL)
    pdl_launch(PDL)
    if ZERO:
        _zero_part(z_ptr, ZN, 4 * R)
    s = 1.0
    if RMS_X:
        s = tl.rsqrt(tl.load(ssq_ptr + (b + 0 * e) * stride_ssq) * inv_n + eps)  # [R, 4]: this lane group's row
    z = tl.zeros([R, 4], dtype=tl.float32)
    tA0, tA1, tB0, tB1, sq = z, z, z, z, z
    for T in range(t0, t0 + TPS):
        Tn = tl.minimum(T + 1, last)  # the last tile re-reads itself (L2 hits)
        c0, c1, c2, c3, d0, d1, d2, d3, scC, ofC, scD, ofD = tile_weights(
            wpA, wpB, s_ptr, o_ptr, Tn, N, colA, colB, nmA, nmB, G, NH, SYM, EVEN_N
        )
        x0, x1, x2, x3, x4, x5, x6, x7, sq = x_runs(xp, g_ptr, xk, T, K, s, sq, EVEN_K, ACT_X, RMS_X, NORM_X, F16)
        tA0, tA1, tB0, tB1 = tile_math(
            a0,
            a1,
            a2,
            a3,
            b0,
            b1,
            b2,
            b3,
            scA,
            ofA,
            scB,
            ofB,
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            x6,
            x7,
            tA0,
            tA1,
            tB0,
            tB1,
            F16,
            NH,
            SYM,
        )
        a0, a1, a2, a3, b0, b1, b2, b3 = c0, c1, c2, c3, d0, d1, d2, d3
        scA, ofA, scB, ofB = scC, ofC, scD, ofD
    if NORM_X:
        if pid_n == 0:
            _ssq_add(sq, r, g, M, ssq_ptr, stride_ssq)
    bt = 2 * tq  # x rows of a thread's D elements: 2t, 2t + 1
    if ACC:  # atomic adds (split > 1, not last) into the caller's fp32 sums: no last program
        _mma_put(tA0, fb, bt, out_ptr, out_ptr, M, N, False, 2, False)
        _mma_put(tA1, fb + 2, bt, out_ptr, out_ptr, M, N, False, 2, False)
        if NH == 2:
            _mma_put(tB0, fb + R, bt, out_ptr, out_ptr, M, N, False, 2, False)
            _mma_put(tB1, fb + R + 2, bt, out_ptr, out_ptr, M, N, False, 2, False)
    elif SPLIT == 1:
        _mma_put(tA0, fb, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, True)
        _mma_put(tA1, fb + 2, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, True)
        if NH == 2:
            _mma_put(tB0, fb + R, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, True)
            _mma_put(tB1, fb + R + 2, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, True)
    else:
        _mma_put(tA0, fb, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, False)
        _mma_put(tA1, fb + 2, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, False)
        if NH == 2:
            _mma_put(tB0, fb + R, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, False)
            _mma_put(tB1, fb + R + 2, bt, out_ptr, ws_ptr, M, N, ACT, SPLIT, False)
        tl.debug_barrier()  # all of this program's adds before its release below
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem='acq_rel') == SPLIT - 1:
            _mma_put(_mma_take(tA0, fb, bt, ws_ptr, M, N), fb, bt, out_ptr, ws_ptr, M, N, ACT, 1, True)
            _mma_put(_mma_take(tA1, fb + 2, bt, ws_ptr, M, N), fb + 2, bt, out_ptr, ws_ptr, M, N, ACT, 1, True)
            if NH == 2:
                _mma_put(_mma_take(tB0, fb + R, bt, ws_ptr, M, N), fb + R, bt, out_ptr, ws_ptr, M, N, ACT, 1, True)
                _mma_put(
                    _mma_take(tB1, fb + R + 2, bt, ws_ptr, M, N), fb + R + 2, bt, out_ptr, ws_ptr, M, N, ACT, 1, True
                )
            tl.store(cnt_ptr + pid_n, 0)


def mma_supported(x, bits, group, N, K, dtype=None) -> bool:
    """Whether `w4a16_mma` takes `x @ W.T`: 1 .. `MMA_MAX_M` rows of bf16 / fp16 x (`dtype`: x's 16-bit type, for x
    given as fp32 gate/up sums) on an sm_80+ GPU, 4-bit weights in scale groups that are a multiple of 128 (or per
    channel), N a multiple of 4 (16-byte word loads)."""
    dtype = dtype or x.dtype
    if _INTERPRET or x.device.type != 'cuda' or dtype not in (torch.bfloat16, torch.float16):
        return False
    if bits != 4 or N % 4 or not 1 <= x.shape[0] <= MMA_MAX_M:
        return False
    Kp = -(-K // TILE_K) * TILE_K
    G = Kp if group in (-1, None) else group
    return G % TILE_K == 0 and torch.cuda.get_device_capability(x.device)[0] >= 8


def w4a16_mma(
    x,
    qweight,
    scales,
    offsets,
    bits,
    group,
    N,
    K,
    out_dtype=None,
    num_warps=None,
    nh=None,
    split_k=None,
    maxnreg=None,
    pdl=None,
    act=None,
    sym=False,
    acc=None,
    x_act=None,
    dtype=None,
    zero=None,
    norm=None,
    x_rms=None,
):
    """`x` `[M, K]` (M <= 8) @ W.T -> `[M, N]` with `_mma_kernel`. Left at None, `num_warps` (warps per program),
    `nh` (16-byte word tensors per thread: 1 or 2), `split_k` (programs per column block, or `target` programs per
    SM) and `maxnreg` (a register cap per thread) come from the tuned config (`configs/w4a16_mma/`).
    `act='silu_and_mul'`: W's rows interleave gate and up; returns `silu(gate) * up` `[M, N / 2]`. `sym`: the
    caller vouches `offsets == -8 * scales` (the offsets are not read). `pdl`: as `pdl_kw`. `acc` (fp32 `[M, N]`,
    contiguous): `acc += x @ W.T` in place and returned; the programs add their partial sums straight into it, so
    a split-K launch ends without the workspace's last-program read-back (three dependent L2 round trips).
    `x_act='silu_and_mul'`: `x` is fp32 `[M, 2K]` gate/up sums in interleaved pairs (a fused gate/up layer's `acc`),
    and the matmul's input is `silu(gate) * up` in `dtype` (16-bit), computed as x is loaded: no activation kernel.
    `zero` (fp32, contiguous): zeroed by the launch's programs as well, e.g. sums a later matmul adds into.
    An RMSNorm split between a matmul and the consumer of its sums (the fp32 stream without norm kernels):
    `norm=(weight, ssq)`: `x` is an fp32 residual `[M, K]`, the input `weight * x` in `dtype` (the norm without its
    1/rms), and `ssq` (fp32 `[M]`, any stride) gets `sum_k x[m, k]^2` added; `x_rms=(ssq, n, eps)` (with `x_act`):
    the gate/up sums are scaled by `rsqrt(ssq / n + eps)` before the activation, the norm's 1/rms applied late."""
    M = x.shape[0]
    assert x.dim() == 2 and x.shape[1] == (2 * K if x_act else K) and 1 <= M <= MMA_MAX_M, x.shape
    assert act in (None, 'silu_and_mul') and x_act in (None, 'silu_and_mul'), (act, x_act)
    if x_rms is not None and not x_act:
        raise ValueError("x_rms scales x_act's gate/up sums: give x_act too")
    if norm is not None and x_act:
        raise ValueError('norm and x_act are two kinds of x: give one')
    ssq = norm[1] if norm is not None else x_rms[0] if x_rms is not None else None
    if ssq is not None and (ssq.dtype != torch.float32 or ssq.shape != (M,)):
        raise ValueError(f'ssq must be fp32 [{M}], got {ssq.dtype} {tuple(ssq.shape)}')
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    if bits != 4 or G % TILE_K or N % 4:
        raise ValueError(f'w4a16_mma needs 4-bit weights, groups a multiple of {TILE_K} and N % 4 == 0')
    if (x_act or norm is not None) and (x.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f'x_act and norm need fp32 x and a 16-bit dtype; got {x.dtype}, dtype={dtype}')
    if norm is not None and norm[0].shape != (K,):
        raise ValueError(f'norm weight must be [{K}]')
    if zero is not None and (zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError('zero must be a contiguous fp32 tensor')
    dtype = dtype if x_act or norm is not None else x.dtype
    x = x.contiguous()
    tiles = Kp // TILE_K
    T = configs_for('w4a16_mma', x.device)
    cfg = T['shapes'].get((N, K), T['default'])
    default = num_warps is None and nh is None
    num_warps = num_warps or cfg['num_warps']
    nh = nh or cfg['nh']
    maxnreg = maxnreg or (cfg.get('maxnreg') if default else None)
    if nh not in (1, 2):
        raise ValueError(f'nh={nh}: 1 or 2 word tensors per thread')
    bn = nh * num_warps * 32
    progs = triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else {'target': cfg.get('target', 4)}, tiles, progs, 1, x.device)
    elif tiles % split_k:
        raise ValueError(f'split_k={split_k} must divide the {tiles} K-tiles')
    if acc is not None:
        if act or acc.dtype != torch.float32 or acc.shape != (M, N) or not acc.is_contiguous():
            raise ValueError(f'acc must be a contiguous fp32 [{M}, {N}] tensor, without act')
        out = acc
    else:
        out = torch.empty(M, N // 2 if act else N, dtype=out_dtype or dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, M * N, progs)
    n, eps = (x_rms[1], x_rms[2]) if x_rms is not None else (1, 0.0)
    _mma_kernel[(progs, split_k)](
        x,
        qweight,
        scales,
        offsets,
        out,
        ws,
        cnt,
        ws if zero is None else zero,
        x if norm is None else norm[0].contiguous(),
        ws if ssq is None else ssq,
        M,
        N,
        K,
        x.stride(0),
        tiles // split_k,
        0 if zero is None else zero.numel(),
        0 if ssq is None else ssq.stride(0),
        1.0 / n,
        eps,
        G=G,
        NW=num_warps,
        NH=nh,
        EVEN_N=N % bn == 0,
        EVEN_K=K == Kp,
        SPLIT=split_k,
        ACT=bool(act),
        SYM=bool(sym),
        F16=dtype == torch.float16,
        ACC=acc is not None,
        ACT_X=bool(x_act),
        ZERO=zero is not None,
        NORM_X=norm is not None,
        RMS_X=x_rms is not None,
        num_warps=num_warps,
        num_stages=1,
        **pdl_kw(x.device, pdl),
        **({'maxnreg': maxnreg} if maxnreg else {}),
    )
    return out
