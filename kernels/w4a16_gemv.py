"""The M = 1 (decode) GEMV over the W4A16 layout: `_gemv_kernel` and its launcher `w4a16_gemv`.

A program owns `BN` output columns and `TPS` consecutive K-tiles (program axis 1 splits K; the splits meet in the
self-zeroing workspace of `split_k`). Per K-tile it loads the `[C, BN]` words, turns every bit field into floats in
registers (`w4a16_fields`) and multiplies it by the field's contiguous run of x into an fp32 register tile; the
scales are applied once per group and word, and the cross-thread reduction happens once, after the K loop.
What each switch does, and why:

- `TPI` K-tiles per iteration, all words loaded first: more bytes in flight per thread.
- `NH = 2`: the program's columns as two tiles of the same layout. Triton gives each thread 4 columns of a
  `[C, BN]` tile, so an x value it loads and converts serves 4 weights; with two tiles a thread holds the same rows
  in both and one x value serves 8.
- `PF`: the next iteration's words are loaded before this one's math (register prefetch), iterations in pairs with
  the words in two alternating register sets, so no copy of the prefetched words is needed.
- `EVEN_N`: columns that divide evenly load without masks (no predicates, no zeroed targets).
- `SLOT` (4-bit, groups >= 64, chosen in `gemv_tile`): fields where they lie in the word (`field_slot`).
- `RS` (4-bit, groups >= 64, `NH = 2`, `TPI = 1`): the K-tile's 16 word rows as two `[8, BN/2]` halves that a
  thread chains into one sum (`gemv_tile_rs`): half the scale updates and accumulators.
- `SYM` (4-bit, groups >= 64; the caller vouches `offsets == -8 * scales`): the sums start at
  `-sum(x (2**E + 8))`, so neither `sum x` nor the offsets are in the loop.
- `PDL`: the first iteration's words (weights, which no kernel writes) are loaded before `pdl_wait`, so the weight
  stream starts while the previous kernel finishes (`pdl`).
- `ACT`: W's rows interleave gate and up; the epilogue writes `silu(gate) * up` from the fp32 sums (one kernel
  less per MLP).

This module holds the kernel, its epilogue and the launcher with its config choice. One iteration's word loads
and their hand-over to the tile math are in `w4a16_gemv_iter`, one K-tile's math in `w4a16_gemv_tile`; the data
flow per program:

    words  --`gemv_words`-->  registers  --`gemv_iter`-->  `gemv_tile` / `gemv_tile_rs` (x, scales)  -->  acc, acc2
    acc, acc2  --`_gemv_end`: sum over rows (split-K: the workspace, the last program)-->  `_gemv_put`  -->  out

Launch configurations per shape are tuned data (`configs/w4a16_gemv/`, loaded by `tuned`); `maxnreg` caps the
registers per thread (ptxas schedules differently under a cap, and more programs fit per SM).
"""

import torch
import triton
import triton.language as tl

from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import split_add, split_for, split_k_workspace, split_take
from cvllm_lab.kernels.tuned import configs_for
from cvllm_lab.kernels.w4a16_fields import F32_ONE
from cvllm_lab.kernels.w4a16_gemv_iter import gemv_iter, gemv_words
from cvllm_lab.kernels.w4a16_layout import TILE_K, check_layout

__all__ = ['w4a16_gemv']
from cvllm_lab.kernels.interpret import INTERPRET as _INTERPRET  # decided once (`interpret.py`)


@triton.jit
def _silu_and_mul_pairs(y, BN: tl.constexpr):
    "`silu(gate) * up` `[BN / 2]` of a `[BN]` tile whose entries interleave gate and up (`2i`: gate_i, `2i + 1`: up_i)."
    g, u = tl.split(tl.reshape(y, [BN // 2, 2]))
    return g * tl.sigmoid(g) * u


@triton.jit
def _store_act(y, out_ptr, col0, N, BW: tl.constexpr):
    "`silu(gate) * up` of the fp32 sums `y` of the interleaved gate/up columns `col0 ..`: outputs `col0 / 2 ..`."
    rh = col0 // 2 + tl.arange(0, BW // 2)
    tl.store(out_ptr + rh, _silu_and_mul_pairs(y, BW).to(out_ptr.dtype.element_ty), mask=rh < N // 2)


@triton.jit
def _gemv_put(y, y2, out_ptr, rn, nmask, nmask2, col0, N, BNH: tl.constexpr, NH: tl.constexpr, ACT: tl.constexpr):
    "Write a GEMV program's column sums: `y` for columns `rn`, with NH = 2 also `y2` for `rn + BNH` (ACT: activated)."
    if ACT:
        _store_act(y, out_ptr, col0, N, BNH)
        if NH == 2:
            _store_act(y2, out_ptr, col0 + BNH, N, BNH)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)
        if NH == 2:
            tl.store(out_ptr + rn + BNH, y2.to(out_ptr.dtype.element_ty), mask=nmask2)


@triton.jit
def _gemv_end(
    acc,
    acc2,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    rn,
    nmask,
    nmask2,
    col0,
    N,
    BNH: tl.constexpr,
    NH: tl.constexpr,
    ACT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """A GEMV program's epilogue: reduce its accumulators over the rows and write the columns (`_gemv_put`); with
    SPLIT > 1, both halves go into the workspace with one count per program on `cnt_ptr` (`split_add`'s barrier
    covers both adds) and the tile's last program writes."""
    y = tl.sum(acc, 0)
    y2 = tl.sum(acc2, 0)
    if SPLIT == 1:
        _gemv_put(y, y2, out_ptr, rn, nmask, nmask2, col0, N, BNH, NH, ACT)
    else:
        if NH == 2:
            tl.atomic_add(ws_ptr + rn + BNH, y2, mask=nmask2, sem='relaxed')
        if split_add(y, nmask, ws_ptr + rn, cnt_ptr, SPLIT):
            ya = split_take(y, nmask, ws_ptr + rn, cnt_ptr)
            yb = ya
            if NH == 2:
                yb = split_take(y2, nmask2, ws_ptr + rn + BNH, cnt_ptr)
            _gemv_put(ya, yb, out_ptr, rn, nmask, nmask2, col0, N, BNH, NH, ACT)


@triton.jit
def _gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    TPS,
    ONE,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    TPI: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PF: tl.constexpr,
    PDL: tl.constexpr,
    ACT: tl.constexpr,
    NH: tl.constexpr,
    RS: tl.constexpr,
    SYM: tl.constexpr,
):
    """out[n] = sum_k x[k] W[n, k] for the BN columns of program axis 0 and the TPS K-tiles of program axis 1
    (ACT: `silu(gate) * up` of interleaved gate/up columns, `_store_act`), as NH tiles of BN / NH columns that
    share their x loads. TPI K-tiles per iteration, all loads first (more bytes in flight per thread). With PF the
    next iteration's words are loaded before this one's math, iterations in pairs so that the two register sets
    alternate instead of being copied (the last pair re-reads its own tiles: L2 hits; an odd count ends with one).
    With PDL the first iteration's words are loaded before waiting for the previous kernel (`pdl_wait`).
    RS (4-bit, groups >= 64, NH = 2, TPI = 1): the tiles as row halves (`gemv_tile_rs`). SYM (4-bit, groups >= 64):
    the offsets are -8 scale and are not read (`x_start`)."""
    tl.static_assert(TPI == 1 or TPI == 2 or TPI == 4)
    tl.static_assert(NH == 1 or (NH == 2 and TPI <= 2))
    tl.static_assert(not RS or (BITS == 4 and G >= 64 and NH == 2 and TPI == 1))
    tl.static_assert(not SYM or (BITS == 4 and G >= 64))
    C: tl.constexpr = 4 * BITS
    CR: tl.constexpr = C // (1 + RS)  # word rows per tile
    BNH: tl.constexpr = BN // NH
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    col0 = pid_n * BN
    rn = col0 + tl.arange(0, BNH)
    rc = tl.arange(0, CR)
    wp = qw_ptr + rc[:, None] * N + rn[None, :]  # [CR, BNH] word tile of K-tile 0
    nmask = rn < N
    nmask2 = rn + BNH < N
    acc = tl.zeros([CR, BNH], dtype=tl.float32)
    acc2 = tl.zeros([CR, BNH], dtype=tl.float32)
    t0 = pid_k * TPS
    ts = t0
    if PF or PDL:
        n0, n1, n2, n3 = gemv_words(wp, t0, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
    pdl_wait(PDL)  # the words above are weights; x and the outputs come after the wait
    pdl_launch(PDL)
    if PDL:
        if not PF:  # peel the first iteration: its words are in flight already
            acc, acc2 = gemv_iter(
                acc,
                acc2,
                n0,
                n1,
                n2,
                n3,
                t0,
                x_ptr,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                TPI,
                NH,
                BNH,
                RS,
                SYM,
            )
            ts = t0 + TPI
    if PF:  # iterations in pairs, the words ping-ponged between two register sets (no copies of a rotation)
        last = t0 + TPS - TPI
        for t in range(ts, last, 2 * TPI):
            m0, m1, m2, m3 = gemv_words(wp, t + TPI, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
            acc, acc2 = gemv_iter(
                acc,
                acc2,
                n0,
                n1,
                n2,
                n3,
                t,
                x_ptr,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                TPI,
                NH,
                BNH,
                RS,
                SYM,
            )
            n0, n1, n2, n3 = gemv_words(
                wp, tl.minimum(t + 2 * TPI, last), N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N
            )  # the last pair re-reads its own tile (L2 hits)
            acc, acc2 = gemv_iter(
                acc,
                acc2,
                m0,
                m1,
                m2,
                m3,
                t + TPI,
                x_ptr,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                TPI,
                NH,
                BNH,
                RS,
                SYM,
            )
        if (TPS // TPI) % 2 == 1:  # an odd count: the last iteration, its words loaded by the last pair (or above)
            acc, acc2 = gemv_iter(
                acc,
                acc2,
                n0,
                n1,
                n2,
                n3,
                last,
                x_ptr,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                TPI,
                NH,
                BNH,
                RS,
                SYM,
            )
    else:
        for t in range(ts, t0 + TPS, TPI):
            w0, w1, w2, w3 = gemv_words(wp, t, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
            acc, acc2 = gemv_iter(
                acc,
                acc2,
                w0,
                w1,
                w2,
                w3,
                t,
                x_ptr,
                s_ptr,
                o_ptr,
                N,
                rn,
                rc,
                nmask,
                nmask2,
                K,
                ONE,
                BITS,
                G,
                EVEN_K,
                EVEN_N,
                TPI,
                NH,
                BNH,
                RS,
                SYM,
            )
    _gemv_end(acc, acc2, out_ptr, ws_ptr, cnt_ptr + pid_n, rn, nmask, nmask2, col0, N, BNH, NH, ACT, SPLIT)


def w4a16_gemv(
    x,
    qweight,
    scales,
    offsets,
    bits,
    group,
    N,
    K,
    out_dtype=None,
    bn=None,
    tpi=None,
    num_warps=None,
    split_k=None,
    num_stages=None,
    prefetch=None,
    pdl=None,
    act=None,
    nh=None,
    maxnreg=None,
    rs=None,
    sym=False,
):
    """`x` `[1, K]` @ W.T -> `[1, N]` with `_gemv_kernel`. Arguments left at None come from the tuned config of the
    shape (`bn` columns per program, `tpi` K-tiles per iteration, warps, stages, `prefetch`, `nh`, `maxnreg`,
    `rs`). `split_k` programs per column block share the K-tiles and meet in the self-zeroing workspace. `pdl`:
    programmatic dependent launch (default: `pdl_on`). `act='silu_and_mul'`: W's rows interleave gate and up;
    returns `silu(gate) * up` `[1, N / 2]` from the kernel's epilogue. `nh=2`: the program's `bn` columns as two
    tiles that share their x loads (K-tiles per iteration at most 2). `maxnreg`: a register cap per thread (more
    programs per SM, at the price of spills). `rs`: row halves (`gemv_tile_rs`; default: where it applies).
    `sym`: the caller vouches that `offsets == -8 * scales` (symmetric 4-bit); used where the kernel takes the fields
    in place (4-bit, groups >= 64), which then reads no offsets."""
    assert x.shape == (1, K), x.shape
    assert act in (None, 'silu_and_mul'), act
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    if nh not in (None, 1, 2):
        raise ValueError(f'nh={nh}: 1 or 2 column tiles per program')
    x = x.contiguous()
    tiles = Kp // TILE_K
    T = configs_for('w4a16_gemv', x.device)
    cfg = (
        T['small_group_shapes'].get((N, K, bits), T['small_group'])
        if G < 64
        else T['shapes'].get((N, K, bits), T['default'])
    )
    default = bn is None and tpi is None
    bn = bn or (16 if _INTERPRET else cfg['bn'])
    tpi = tpi or (2 if _INTERPRET else cfg['tpi'])
    num_warps = num_warps or cfg['num_warps']
    num_stages = num_stages or cfg['num_stages']
    prefetch = cfg['pf'] if prefetch is None else prefetch
    nh = nh or cfg.get('nh', 1)
    maxnreg = maxnreg or (cfg.get('maxnreg') if default else None)
    if nh == 2 and bn % 2:
        raise ValueError(f'nh=2 needs an even block N, got bn={bn}')
    tpi = min(tpi, 4 if nh == 1 else 2)
    while tiles % tpi:
        tpi //= 2
    progs = triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else {'target': cfg.get('target', 4)}, tiles, progs, tpi, x.device)
    elif tiles % split_k or (tiles // split_k) % tpi:
        raise ValueError(f'split_k={split_k} must divide the {tiles} K-tiles into multiples of tpi={tpi}')
    if act and (N % 2 or (bn // nh) % 2):
        raise ValueError(f'act needs an even N and block N, got {N}, {bn}')
    out = torch.empty(1, N // 2 if act else N, dtype=out_dtype or x.dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, N, progs)
    if pdl is None and G < 64:
        pdl = False  # groups < 64 (q4_k, q4_0, q8_0 repacks) launch without PDL
    rs_ok = bits == 4 and G >= 64 and nh == 2 and tpi == 1
    if rs and not rs_ok:
        raise ValueError('rs=True needs 4 bits, groups >= 64, nh=2 and tpi=1')
    if rs is None:
        rs = rs_ok and (cfg.get('rs', True) if default else True)
    _gemv_kernel[(progs, split_k)](
        x,
        qweight,
        scales,
        offsets,
        out,
        ws,
        cnt,
        N,
        K,
        tiles // split_k,
        F32_ONE,
        BITS=bits,
        G=G,
        BN=bn,
        TPI=tpi,
        EVEN_K=K == Kp,
        EVEN_N=N % bn == 0,
        SPLIT=split_k,
        PF=bool(prefetch),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kw(x.device, pdl),
        ACT=bool(act),
        NH=nh,
        RS=bool(rs),
        SYM=bool(sym) and bits == 4 and G >= 64,
        **({'maxnreg': maxnreg} if maxnreg else {}),
    )
    return out
