"""Triton kernels for `y = x @ W.T` with `W` in cvllm's packed 4-bit (or 8-bit) layout, and their PyTorch reference.

The layout (built by `cvllm_lab.quant.w4a16.pack_weights`; the notebook `46_w4a16` draws it) for a weight
`W [N, K]` with integer levels `q[n, k]` in `0 .. 2**BITS - 1`:

- `qweight` `int32 [Kp * BITS / 32, N]`, `Kp` = K rounded up to a multiple of 128 (zero padded). K is cut into
  *tiles* of 128; tile `t` owns the `C = 4 * BITS` word rows `t*C .. t*C + C-1` (16 for 4-bit, 32 for 8-bit), and
  bit field `j` (bits `BITS*j ..`) of word row `t*C + c`, column `n`, holds `q[n, t*128 + j*C + c]`.
  So a load of `[C, BN]` words is contiguous along `n` (coalesced), and field `j` of it is the `[C, BN]` slice
  `k = t*128 + j*C + c` of `W.T`: for the GEMV it multiplies a contiguous run of `x`, for `tl.dot` it is a ready
  `[16 or 32, BN]` operand. No reshapes, no gathers.
- `scales`, `offsets` `fp16 [Kp / G, N]`: `W[n, k] = scales[k // G, n] * q[n, k] + offsets[k // G, n]`
  (GPTQ/AWQ zero points become `offset = -scale * zero`). `G` is a multiple of `C` that divides 128, or a multiple
  of 128 (`G = Kp`: one scale per output channel).

Integer to float: field `j` is shifted into the top mantissa bits of `1.0f` (`0x3F800000 | q << (23 - BITS)`), a
shift and one AND-OR (LOP3) per weight giving exactly `f = 1 + q / 2**BITS`. With `S = 2**BITS * scale` and
`B = offset - S`, `W = S * f + B`, and per scale group `sum_k x_k W_k = S * sum_k x_k f_k + B * sum_k x_k`:
the GEMV inner loop is one FMA per weight into a register tile, scales are applied once per group and word,
and the cross-thread reduction happens once, after the K loop.

| kernel | used for | what it does |
|---|---|---|
| `_gemv_kernel` / `_gemv3_kernel` | M = 1 (decode) | `TPI` word tiles `[C, BN]` per iteration (as separate loads, or one `[C, TPI, BN]` load), `NH` = 2 column tiles sharing x, optional register prefetch of the next iteration's words (`PF`), fp32 register accumulator, split-K over programs |
| `_tc_kernel` | 1 < M <= `MM_MAX_M`, 4-bit, groups >= 128, 16-bit x | weights as the tensor-core A operand: the `[BN, 16]` words go to the dot-operand layout once per K-tile, inline PTX turns each field into `1 + q / 128` two weights per PRMT + LOP3, one `tl.dot` per field with x's `[16, BM]` slice as B |
| `_mm_kernel` | 1 < M <= `MM_MAX_M`, other formats | per field one `tl.dot` of `x[:, C]` with the exact `f` in x's dtype; scales applied to the `[BM, BN]` group sums (`PERGROUP`; per weight in fp32 for 8-bit bf16 and 4-bit groups < 128); one program per (N-block, K-split, 64 rows) |
| `_dequant_kernel` + cuBLAS | M > `MM_MAX_M` (prefill) | writes W once in bf16/fp16, then `torch.matmul` |

Split-K without extra launches (`_store_out`): the programs of one output tile add their fp32 partial sums into a
per-device workspace (`split_k_workspace`) and count themselves on an int32 counter; the last one writes the tile
in the output dtype and sets workspace and counter back to zero. Before, split-K meant `torch.zeros` + fp32
atomics + a cast kernel (three launches), so it only paid off for the smallest N; now 2-14 splits pay everywhere.

Measured on an H200 (Triton 3.6, bf16 x, CUDA-graph replay over rotating weight copies so weights come from HBM;
% of 4.2 TB/s for the packed bytes incl. scales; defaults below; `results/h200_quant_kernels.csv` holds the sweeps):

| N x K | bf16 cuBLAS | W4A16 g128 M=1, before -> now | W4A16 g128 M=16, before -> now | M=64 now | q4_k packed M=1 |
|---|---|---|---|---|---|
| 6144 x 4096 (qkv) | 16.9 us | 11.4 (28%) -> 9.8 us (33%) | 23.6 (14%) -> 17.6 us (18%) | 33.0 us | 23.8 -> 11.9 us |
| 4096 x 4096 (o) | 13.5 us | 9.4 (23%) -> 7.8 us (27%) | 15.2 (14%) -> 12.4 us (17%) | 21.6 us | 12.8 -> 9.1 us |
| 28672 x 4096 (gate_up) | 59.0 us | 34.8 (43%) -> 31.5 us (47%) | 65.0 (23%) -> 55.9 us (27%) | 102.7 us | 50.6 -> 41.3 us |
| 4096 x 14336 (down) | 33.0 us | 20.6 (36%) -> 18.0 us (41%) | 35.9 (21%) -> 27.9 us (27%) | 50.4 us | 38.5 -> 22.5 us |
| layer (4 matmuls) | 122 us | 76.2 -> 67.0 us | 139.7 -> 113.7 us | 207.7 us | 125.8 -> 84.8 us |

Llama-3-8B decode estimate from these (32 layers + the bf16 LM head, 249 us at M=1): W4A16 418 tok/s at batch 1,
4,110 at batch 16, 9,230 at batch 64 (bf16: 240 / 3,800 / 14,250).

Diagnosis. The FP8 GEMV reads twice the bytes per weight and reaches 52-84% (`fp8_matmul`), the 4-bit GEMV 27-47%
on the same shapes at about the same microseconds: it is issue-bound, not memory-bound. Per 4-bit weight the SASS
has a shift, a LOP3 and an FFMA, plus x loads/conversions shared by only 4 weights and the per-group scale
updates (4-5 instructions; the FP8 GEMV has 2.5 per weight and half as many weights per byte), and issue and memory
time add up instead of overlapping. Split-K (more programs in flight) and register prefetch bought 10-15%; no
config moved further (see the sweeps). The `tl.dot` path at M = 16..64 is limited by the per-field layout
conversions of the dequantized `[C, BN]` tiles and of the x tiles into tensor-core operands (M = 64 is ~2x
slower than M = 16, for the same weight bytes). Next steps: two nibbles per LOP3 via f16x2 magic numbers + packed
math (inline PTX), and a `[BK, BN]` tile dequantized once per 128-K step for `tl.dot` (x permuted to the word
order, so fields need no cross-thread moves). That last one was built and measured (commit 02a8421, `_mmt_kernel`:
the `[16, 8, BN]` fields reshaped or the words loaded 8x as `[128, BN]`, nibbles to bf16 by `q | 0x4300` = 128 + q,
x gathered in the tile's row order): slower everywhere on the H200, W4A16 g128 per layer 161 us at M=16 (against
113.7) and 441 us at M=64 (207.7), 124 us at M=1; so it was not kept. Fusing the MLP's `silu(gate) * up` into the
down projection's x loads (commit 1c255ed) saved a launch per layer but cost more: every program recomputes the
activation of its x slice (replicated across the threads of a column), and Llama-3-8B decode on the H200 went from
330.7 to 310.3 tok/s (W4A16, batch 1) and 3,535 to 3,155 (batch 16); it was reverted.

Weights as the tensor-core A operand (measured on 79557d8, not kept): `out.T[BN, BM] = sum_j f_j[BN, 16] @ x_j.T[16, BM]`,
the words loaded transposed `[BN, 16]` so that each field is a ready A tile, built either through fp32 or directly
as 16-bit `1 + q/16` (`0x3F80 | q << 3`), x padded to 16 rows; swept block N 64/128, 1-4 stages, split-K up to 32.
M=16, g128, best config per shape against `_mm_kernel`: qkv 15.4-17.3 vs 17.7 us, o 11.8-12.9 vs 12.3, gate_up
48.0-52.5 vs 55.4, down 27.1-28.8 vs 27.7 (the ranges are two runs): about 102 against 113 us per layer, a 10% gain
that run-to-run noise half covers and that leaves batch 16 far from 4,500 tok/s; M=1 was slower everywhere
(down 25.7 vs 17.8 us) and M=64 too (down 81 vs 51).

Two column tiles per GEMV program (`NH` = 2, 547384b). Triton gives each thread 4 columns of a `[C, BN]` word tile
(one 16-byte load per row), so every x value it loads, converts to fp32 and adds into the group sum served 4
weights. Loading the program's columns as two tiles of the same layout gives each thread the same rows in both,
and one x value serves 8: the SASS of the loop went from 4.71 to 4.25 instructions per weight at g128 (6.30 ->
5.88 at g32). H200, per Llama-3-8B layer (`results/h200_gemv_nh_sweep.csv`): W4A16 g128 65.5 -> 58.8 us (qkv 9.2
-> 8.2, o 8.9 -> 7.0, gate_up with the activation 30.0 -> 27.8, down 17.4 -> 15.8); g32 (q4_k) only qkv 11.9 ->
11.2 and gate_up 41.1 -> 39.3, o and down slower (8.9, 25.0 against 8.4, 22.6). End to end at batch 1: W4A16
365.3 -> 385.8 tok/s, q4_k 297.6 -> 305.9. Both tensor-core layouts (`_mmt_kernel`, this one) lose to
the per-field `tl.dot` here: what is missing is a dequantized tile in the MMA register layout without a trip
through shared memory, which Triton does not expose.

What limits the GEMV (H200, 689fdfc-6afa364, `results/h200_gemv_*.csv`, notebook 46): a kernel that only streams
the words with the same tiling reads a layer in 34.8 us (the GEMV: 58.6), and a column-blocked layout reads no
faster; Nsight Compute on gate_up shows issue slots 64% busy, 4.5 warps per scheduler (80 registers), and per
instruction 1.8 cycles waiting on loads, 1.8 not selected, 0.9 math-pipe throttle. Not kept: two weights per shift
+ LOP3 (low bf16 half by PRMT, high half read as fp32 with the low half as mantissa noise, 1e-5 relative error;
fc2a60f): 557 -> 502 instructions per 128 weights but 108 registers, 62.2 against 60.9 us per layer and batch 1
366 against 385 tok/s; word tiles by TMA through a 2-4 stage shared-memory pipeline: slower on every shape
(gate_up 31.8 against 28.9 us). Kept: `maxnreg` per config (`GEMV_CONFIGS`), 60.6 -> 58.1 us per layer (g32 83.0
-> 78.4), batch 1 W4A16 385.6 -> 396.6 tok/s and q4_k 305.3 -> 312.1.

Fields where they lie (`_field_slot`, 4-bit groups >= 64; 978e15f..886260d). The mantissa of `1.0f` has room for a
nibble at bits 11 .. 19 without losing x's precision, so after one of two shifts per word (`<< 11`, `>> 9`, fields
3 and 4 in place) every field is one LOP3 away from `1 + q * 2**(b - 23)`; x is scaled by `2**(23 - b)` inside its
bf16 -> fp32 conversion (one IMAD) and the sums start at `-sum(x * 2**(23 - b))`, so each field adds `x q` and the
scale applies as stored. With bf16 x every product and partial sum stays exact in fp32. sm_90 loop of the gate_up
GEMV: 563 -> 473 instructions per 128 weights (SHF 99 -> 33). Row halves (`_gemv_tile_rs`): the K-tile's 16 word
rows as two `[8, BN/2]` tiles whose rows a thread chains into one sum, so the per-group scale updates and the
accumulators halve (470 instructions at 80 registers without spills). H200 (`results/h200_gemv_slot_sweep.csv`):
qkv 8.17 -> 7.64 us, o 6.82 -> 6.81, gate_up 28.86 -> 23.87, down 15.59 -> 14.02: a layer 59.4 -> 52.3 us, and
Llama-3-8B batch 1 W4A16 396 -> 420.6 tok/s. Symmetric layers (offsets = -8 scale, GPTQ sym and RTN: `sym`,
`W4A16Linear.is_sym`) start the sums at `-sum(x (2**E + 8))` instead, so `sum x` and the offsets drop out of the
loop (gate_up loop 461 -> 442 instructions, qkv 918 -> 833, o 566 -> 472 with fewer spills): batch 1 420 ->
442.3 tok/s (abed949, `results/h200_decode_bs1_experiments.csv`). Paired iterations (58d845f): the prefetching
loop runs two iterations per trip with the words in two alternating register sets, which removes the 16-register
copy per iteration, and evenly divided columns load without masks (no zeroed targets): loop 442 -> 400
instructions, gate_up 25.97 -> 22.21 us (symmetric, `results/h200_gemv_sym_sweep.csv`), batch 1 436.4 -> 444.6. Not kept: the qkv GEMV writing rotated q/k and the K/V cache slot in
its epilogue (one launch less per layer; 16ce63d, with the epilogue's inputs loaded before the K loop in 922d431):
414.4 tok/s against 417.5 without in the same run, the last program's tail costs what the rotary kernel did.

Programmatic dependent launch (`kernels/pdl.py`): the 2d GEMV loads its first iteration's words before
`griddepcontrol.wait`, so its weight stream starts while the previous kernel finishes; Llama-3-8B batch 1 went from
334.6 to 360.3 tok/s (W4A16 g128). For groups < 64 (q4_k) it measured 289.0 against 293.8 without, so those launch
without PDL. Configs without register prefetch peel their first iteration for this instead of switching the
prefetch on: with the prefetch forced under PDL, W4A16 measured 354.0 and q4_k 265.6 (against 295.1 without PDL).

The tensor-core kernel (`_tc_kernel`). The earlier A-operand attempt lost to the per-field conversions; what makes
this one pay: (1) the words tile, not the dequantized fields, is what goes through shared memory into the
dot-operand layout (once per K-tile, pipelined by `num_stages` as cp.async), and every field is computed from it in
registers; (2) the fields are built by inline PTX, whose pairs of 16-bit results are exactly the MMA's
register pairs: one PRMT gathers the field's byte of two words, one LOP3 masks the nibbles and ORs in 1.0, so a
weight costs ~1 instruction instead of the 2.5 of shift + LOP3 + fp32 -> bf16 pack (SASS of the loop: 2.5
instructions per weight in all against 4.6 for the GEMV). `f = 1 + q / 128` is exact in bf16 (`1 + q / 1024` in
fp16) and the tensor cores accumulate in fp32. H200, g128, best config per shape (`results/h200_tc_sweep.csv`),
microseconds per Llama-3-8B layer (4 matmuls): M=16 112.2 -> 76.0 (`_mm_kernel` -> `_tc_kernel`), M=64 208.0 ->
177.0; at M=1 it is slower than the GEMV (72.9 against 64.9), so M=1 stays on the GEMV. Not kept: all 8 fields
joined along K into one `[BN, 128]` operand and one `tl.dot` per tile (the join is free in the dot-operand layout
and the 8 MMAs go out with one wait instead of eight, 25% fewer instructions) measured slower everywhere: 107.8 us
per layer at M=16, 105.3 at M=1.
"""
import os

import torch
import triton
import triton.language as tl

from cvllm_lab.quant.w4a16 import TILE_K, check_layout, dequantize_packed_ref

from cvllm_lab.kernels.activation import silu_and_mul
from cvllm_lab.kernels.pdl import pdl_kw, pdl_launch, pdl_wait
from cvllm_lab.kernels.split_k import (batched_plan, m_bucket, split_add, split_for, split_k_workspace, split_take,
                                       store_out)

__all__ = ['w4a16_matmul', 'w4a16_gemv', 'w4a16_mm', 'w4a16_tc', 'w4a16_dequantize', 'w4a16_matmul_ref', 'split_k_workspace']
_INTERPRET = os.environ.get('TRITON_INTERPRET', '0') == '1'
_ONE = 0x3F800000  # 1.0f


@triton.jit
def _field_f(words, J: tl.constexpr, BITS: tl.constexpr, ONE):
    """Bit field `J` of int32 `words` as fp32 `1 + q / 2**BITS` (q moved into the top mantissa bits of `ONE` = 1.0f).

    `ONE` (0x3F800000) is a runtime argument so that it lives in a register: with two immediates ptxas spends a
    MOV per weight to materialize one of them for the LOP3. Callers pass `J` as an expression: Triton 3.6 turns a
    constexpr sum assigned to a variable into a tensor."""
    SH: tl.constexpr = 23 - BITS - BITS * J
    MASK: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)
    if SH >= 0:
        v = (words << SH) & MASK
    else:
        v = (words >> (-SH)) & MASK
    return (v | ONE).to(tl.float32, bitcast=True)


@triton.jit
def _field_slot(words, J: tl.constexpr, ONE):
    """4-bit field `J` of `words` as fp32 `1 + q * 2**(b - 23)`, b in 11 .. 19: the nibble is masked where it lands
    after at most one of two shifts per word (fields 3, 4 in place at b = 12, 16; 0-2 after `<< 11`, 5-7 after
    `>> 9`: b = 11, 15, 19), so 8 weights cost 2 shifts + 8 LOP3 instead of a shift + LOP3 each. x is scaled by
    `2**(23 - b)` (`_x_slot`) so that each field adds `x q`; the caller cancels the `1`s by starting the sum at
    `-sum(x * 2**(23 - b))` and applies `scale` as it is (`_scale_rows` with SLOT)."""
    B: tl.constexpr = 4 * J + 11 * (J < 3) - 9 * (J > 4)
    if J == 3 or J == 4:
        v = words
    elif J < 3:
        v = words << 11
    else:
        v = words >> 9
    return ((v & (15 << B)) | ONE).to(tl.float32, bitcast=True)


@triton.jit
def _x_slot(xj, J: tl.constexpr):
    """fp32 `x * 2**E` for field `J` of `_field_slot`, `E = 23 - b` (4 .. 12): for bf16 x the exponent add rides
    on the conversion (`x << 16 + E << 23`, one IMAD; a zero becomes the negligible `2**(E - 127)`)."""
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    if xj.dtype == tl.bfloat16:
        xi = xj.to(tl.uint16, bitcast=True).to(tl.uint32)
        return ((xi << 16) + (E << 23)).to(tl.float32, bitcast=True)
    else:
        return xj.to(tl.float32) * (1 << E)


@triton.jit
def _x_unslot(xq, J: tl.constexpr):
    "`x` back from `_x_slot`'s `x * 2**E` (an exact multiply)."
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    return xq * (1.0 / (1 << E))


@triton.jit
def _x_start(xq, J: tl.constexpr, SYM: tl.constexpr):
    """A field's share of the `_field_slot` sums' start: `x * 2**E` (its `1`), plus `8 x` for symmetric layers
    (offset = -8 scale: `sum x (q - 8)` then needs neither `sum x` nor the offsets)."""
    E: tl.constexpr = 23 - (4 * J + 11 * (J < 3) - 9 * (J > 4))
    if SYM:
        return xq * (1.0 + 8.0 / (1 << E))
    else:
        return xq


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
def _gemv_end(acc, acc2, out_ptr, ws_ptr, cnt_ptr, rn, nmask, nmask2, col0, N, BNH: tl.constexpr, NH: tl.constexpr,
              ACT: tl.constexpr, SPLIT: tl.constexpr):
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
def _scale_rows(s_ptr, o_ptr, idx, nmask, BITS: tl.constexpr, EVEN_N: tl.constexpr, SLOT: tl.constexpr):
    """`S = 2**BITS * scale` and `B = offset - S` (fp32) of the columns at `idx` of one scale row (SLOT: the sums
    are `sum x q` without `1`s, so `S = scale`, `B = offset`)."""
    if EVEN_N:
        s = tl.load(s_ptr + idx).to(tl.float32)
        o = tl.load(o_ptr + idx).to(tl.float32)
    else:
        s = tl.load(s_ptr + idx, mask=nmask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + idx, mask=nmask, other=0.0).to(tl.float32)
    if not SLOT:
        s = s * (1 << BITS)
        o = o - s
    return s, o


@triton.jit
def _gemv_x(xb, kb, rc, K, J: tl.constexpr, C: tl.constexpr, EVEN_K: tl.constexpr):
    "The `[C]` x values of bit field `J` of a K-tile (x at `xb`, the tile at `kb`), kept in cache (`evict_last`)."
    if EVEN_K:
        return tl.load(xb + J * C, eviction_policy='evict_last')
    else:
        return tl.load(xb + J * C, mask=(kb + J * C + rc) < K, other=0.0, eviction_policy='evict_last')


@triton.jit
def _x_field(xb, kb, rc, K, J: tl.constexpr, EVEN_K: tl.constexpr):
    "4-bit field `J`'s x values of a K-tile (`_gemv_x`), scaled for `_field_slot` (`_x_slot`)."
    return _x_slot(_gemv_x(xb, kb, rc, K, J, 16, EVEN_K), J)


@triton.jit
def _gemv_tile(acc, acc2, words, words2, xb, s_ptr, o_ptr, sp, rn, rc, nmask, nmask2, kb, K, ONE,
               BITS: tl.constexpr, G: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               NH: tl.constexpr, BNH: tl.constexpr, SYM: tl.constexpr = False):
    """acc[C, BNH] += the products of one K-tile: `words` [C, BNH], x at `xb` (+ field offsets), scale rows from
    `sp`; with NH = 2 also acc2 for `words2`, the columns BNH further on, with the same x values (each thread holds
    the same rows of both, so one x load and conversion serves 8 columns instead of 4). SYM (4-bit, groups >= 64):
    offsets are -8 scale, folded into the sums' start (`_x_start`)."""
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128  # K-width of one scale group inside a tile
    JPG: tl.constexpr = GW // C                # bit fields per scale group
    NG: tl.constexpr = 128 // GW               # scale groups per tile
    SLOT: tl.constexpr = BITS == 4 and JPG > 2  # fields where they lie (`_field_slot`), x scaled to match
    for gi in tl.static_range(NG):
        row = (kb + gi * GW) // G * sp
        s, o = _scale_rows(s_ptr, o_ptr, row + rn, nmask, BITS, EVEN_N, SLOT)
        s2, o2 = s, o
        if NH == 2:
            s2, o2 = _scale_rows(s_ptr, o_ptr, row + BNH + rn, nmask2, BITS, EVEN_N, SLOT)
        if SLOT:   # x sums first (the loads below are the same, CSE'd): xs = sum x, xsp = sum x * 2**E
            for jj in tl.static_range(JPG):
                xq = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
                if jj == 0:
                    if not SYM:
                        xs = _x_unslot(xq, gi * JPG + jj)
                    xsp = _x_start(xq, gi * JPG + jj, SYM)
                else:
                    if not SYM:
                        xs += _x_unslot(xq, gi * JPG + jj)
                    xsp += _x_start(xq, gi * JPG + jj, SYM)
            tf = tl.zeros_like(acc) - xsp[:, None]
            tf2 = tf
            for jj in tl.static_range(JPG):
                xq = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
                tf += _field_slot(words, gi * JPG + jj, ONE) * xq[:, None]
                if NH == 2:
                    tf2 += _field_slot(words2, gi * JPG + jj, ONE) * xq[:, None]
        else:
            for jj in tl.static_range(JPG):
                xj = _gemv_x(xb, kb, rc, K, gi * JPG + jj, C, EVEN_K).to(tl.float32)
                f = _field_f(words, gi * JPG + jj, BITS, ONE)
                f2 = f
                if NH == 2:
                    f2 = _field_f(words2, gi * JPG + jj, BITS, ONE)
                if JPG <= 2:   # small groups: dequantize each weight (2 FFMAs) instead of per-group partial sums
                    acc += (f * s[None, :] + o[None, :]) * xj[:, None]
                    if NH == 2:
                        acc2 += (f2 * s2[None, :] + o2[None, :]) * xj[:, None]
                else:
                    if jj == 0:
                        tf = f * xj[:, None]
                        tf2 = f2 * xj[:, None]
                        xs = xj
                    else:
                        tf += f * xj[:, None]
                        if NH == 2:
                            tf2 += f2 * xj[:, None]
                        xs += xj
        if JPG > 2:
            acc += tf * s[None, :]       # two separate updates: two FFMAs, not FMUL + FFMA + FADD
            if not (SLOT and SYM):
                acc += xs[:, None] * o[None, :]
            if NH == 2:
                acc2 += tf2 * s2[None, :]
                if not (SLOT and SYM):
                    acc2 += xs[:, None] * o2[None, :]
    return acc, acc2


@triton.jit
def _gemv_tile_rs(acc, acc2, wa, wb, wa2, wb2, xb, s_ptr, o_ptr, sp, rn, rc, nmask, nmask2, kb, K, ONE,
                  G: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BNH: tl.constexpr,
                  SYM: tl.constexpr):
    """`_gemv_tile` for 4-bit groups >= 64 with NH = 2, the K-tile's 16 word rows as two `[8, BNH]` halves (`wa`:
    rows 0-7, `wb`: 8-15; `wa2`, `wb2` the columns BNH further on): a thread holds one row of each half and chains
    both into one `[8, BNH]` sum per column tile, so the per-group scale updates and the accumulators are half
    of `_gemv_tile`'s (fields as `_field_slot`)."""
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // 16
    NG: tl.constexpr = 128 // GW
    for gi in tl.static_range(NG):
        row = (kb + gi * GW) // G * sp
        s, o = _scale_rows(s_ptr, o_ptr, row + rn, nmask, 4, EVEN_N, True)
        s2, o2 = _scale_rows(s_ptr, o_ptr, row + BNH + rn, nmask2, 4, EVEN_N, True)
        for jj in tl.static_range(JPG):   # x sums first (the loads below are the same, CSE'd)
            xa = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
            xc = _x_field(xb + 8, kb + 8, rc, K, gi * JPG + jj, EVEN_K)
            if jj == 0:
                xsp = _x_start(xa, gi * JPG + jj, SYM) + _x_start(xc, gi * JPG + jj, SYM)
                if not SYM:
                    xs = _x_unslot(xa, gi * JPG + jj) + _x_unslot(xc, gi * JPG + jj)
            else:
                xsp += _x_start(xa, gi * JPG + jj, SYM) + _x_start(xc, gi * JPG + jj, SYM)
                if not SYM:
                    xs += _x_unslot(xa, gi * JPG + jj) + _x_unslot(xc, gi * JPG + jj)
        tf = tl.zeros_like(acc) - xsp[:, None]
        tf2 = tf
        for jj in tl.static_range(JPG):
            xa = _x_field(xb, kb, rc, K, gi * JPG + jj, EVEN_K)
            xc = _x_field(xb + 8, kb + 8, rc, K, gi * JPG + jj, EVEN_K)
            tf += _field_slot(wa, gi * JPG + jj, ONE) * xa[:, None]
            tf += _field_slot(wb, gi * JPG + jj, ONE) * xc[:, None]
            tf2 += _field_slot(wa2, gi * JPG + jj, ONE) * xa[:, None]
            tf2 += _field_slot(wb2, gi * JPG + jj, ONE) * xc[:, None]
        acc += tf * s[None, :]
        acc2 += tf2 * s2[None, :]
        if not SYM:
            acc += xs[:, None] * o[None, :]
            acc2 += xs[:, None] * o2[None, :]
    return acc, acc2


@triton.jit
def _wload(ptr, mask, EVEN_N: tl.constexpr):
    "One word tile, streamed (`evict_first`); unmasked when the columns divide evenly (no predicates, no zeroing)."
    if EVEN_N:
        return tl.load(ptr, eviction_policy='evict_first')
    return tl.load(ptr, mask=mask[None, :], other=0, eviction_policy='evict_first')


@triton.jit
def _gemv_words(wp, t, N, nmask, nmask2, C: tl.constexpr, TPI: tl.constexpr, NH: tl.constexpr, BNH: tl.constexpr,
                RS: tl.constexpr = False, EVEN_N: tl.constexpr = False):
    """The word tiles `[C, BNH]` of one iteration: K-tiles t .. t + TPI - 1 (NH = 1), or (K-tile, column half)
    (t, 0), (t, 1), (t + 1, 0), (t + 1, 1) (NH = 2, TPI <= 2); unused slots repeat the first ones. RS: the
    `[C / 2, BNH]` row halves (rows, columns) (0, 0), (1, 0), (0, 1), (1, 1) of K-tile t."""
    if RS:
        w0 = _wload(wp + t * C * N, nmask, EVEN_N)
        w1 = _wload(wp + t * C * N + C // 2 * N, nmask, EVEN_N)
        w2 = _wload(wp + t * C * N + BNH, nmask2, EVEN_N)
        w3 = _wload(wp + t * C * N + C // 2 * N + BNH, nmask2, EVEN_N)
        return w0, w1, w2, w3
    w0 = _wload(wp + t * C * N, nmask, EVEN_N)
    w1 = w0
    if NH == 2:
        w1 = _wload(wp + t * C * N + BNH, nmask2, EVEN_N)
    w2 = w0
    w3 = w1
    if NH == 1:
        if TPI > 1:
            w1 = _wload(wp + (t + 1) * C * N, nmask, EVEN_N)
        if TPI > 2:
            w2 = _wload(wp + (t + 2) * C * N, nmask, EVEN_N)
            w3 = _wload(wp + (t + 3) * C * N, nmask, EVEN_N)
    else:
        if TPI > 1:
            w2 = _wload(wp + (t + 1) * C * N, nmask, EVEN_N)
            w3 = _wload(wp + (t + 1) * C * N + BNH, nmask2, EVEN_N)
    return w0, w1, w2, w3


@triton.jit
def _gemv_iter(acc, acc2, w0, w1, w2, w3, t, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2, K, ONE,
               BITS: tl.constexpr, G: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TPI: tl.constexpr,
               NH: tl.constexpr, BNH: tl.constexpr, RS: tl.constexpr = False, SYM: tl.constexpr = False):
    "acc (and acc2) += the products of one iteration's word tiles (`_gemv_words`)."
    if RS:
        acc, acc2 = _gemv_tile_rs(acc, acc2, w0, w1, w2, w3, x_ptr + t * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask,
                                  nmask2, t * 128, K, ONE, G, EVEN_K, EVEN_N, BNH, SYM)
    elif NH == 1:
        acc, acc2 = _gemv_tile(acc, acc2, w0, w0, x_ptr + t * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, nmask2,
                               t * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
        if TPI > 1:
            acc, acc2 = _gemv_tile(acc, acc2, w1, w1, x_ptr + (t + 1) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask,
                                   nmask2, (t + 1) * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
        if TPI > 2:
            acc, acc2 = _gemv_tile(acc, acc2, w2, w2, x_ptr + (t + 2) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask,
                                   nmask2, (t + 2) * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
            acc, acc2 = _gemv_tile(acc, acc2, w3, w3, x_ptr + (t + 3) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask,
                                   nmask2, (t + 3) * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
    else:
        acc, acc2 = _gemv_tile(acc, acc2, w0, w1, x_ptr + t * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask, nmask2,
                               t * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
        if TPI > 1:
            acc, acc2 = _gemv_tile(acc, acc2, w2, w3, x_ptr + (t + 1) * 128 + rc, s_ptr, o_ptr, N, rn, rc, nmask,
                                   nmask2, (t + 1) * 128, K, ONE, BITS, G, EVEN_K, EVEN_N, NH, BNH, SYM)
    return acc, acc2


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, TPS, ONE,
                 BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, TPI: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, PF: tl.constexpr,
                 PDL: tl.constexpr, ACT: tl.constexpr, NH: tl.constexpr, RS: tl.constexpr, SYM: tl.constexpr):
    """out[n] = sum_k x[k] W[n, k] for the BN columns of program axis 0 and the TPS K-tiles of program axis 1
    (ACT: `silu(gate) * up` of interleaved gate/up columns, `_store_act`), as NH tiles of BN / NH columns that
    share their x loads. TPI K-tiles per iteration, all loads first (more bytes in flight per thread). With PF the
    next iteration's words are loaded before this one's math, iterations in pairs so that the two register sets
    alternate instead of being copied (the last pair re-reads its own tiles: L2 hits; an odd count ends with one).
    With PDL the first iteration's words are loaded before waiting for the previous kernel (`pdl_wait`).
    RS (4-bit, groups >= 64, NH = 2, TPI = 1): the tiles as row halves (`_gemv_tile_rs`). SYM (4-bit, groups >= 64):
    the offsets are -8 scale and are not read (`_x_start`)."""
    tl.static_assert(TPI == 1 or TPI == 2 or TPI == 4)
    tl.static_assert(NH == 1 or (NH == 2 and TPI <= 2))
    tl.static_assert(not RS or (BITS == 4 and G >= 64 and NH == 2 and TPI == 1))
    tl.static_assert(not SYM or (BITS == 4 and G >= 64))
    C: tl.constexpr = 4 * BITS
    CR: tl.constexpr = C // (1 + RS)   # word rows per tile
    BNH: tl.constexpr = BN // NH
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    col0 = pid_n * BN
    rn = col0 + tl.arange(0, BNH)
    rc = tl.arange(0, CR)
    wp = qw_ptr + rc[:, None] * N + rn[None, :]   # [CR, BNH] word tile of K-tile 0
    nmask = rn < N
    nmask2 = rn + BNH < N
    acc = tl.zeros([CR, BNH], dtype=tl.float32)
    acc2 = tl.zeros([CR, BNH], dtype=tl.float32)
    t0 = pid_k * TPS
    ts = t0
    if PF or PDL:
        n0, n1, n2, n3 = _gemv_words(wp, t0, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
    pdl_wait(PDL)   # the words above are weights; x and the outputs come after the wait
    pdl_launch(PDL)
    if PDL:
        if not PF:   # peel the first iteration: its words are in flight already
            acc, acc2 = _gemv_iter(acc, acc2, n0, n1, n2, n3, t0, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2, K, ONE,
                                   BITS, G, EVEN_K, EVEN_N, TPI, NH, BNH, RS, SYM)
            ts = t0 + TPI
    if PF:   # iterations in pairs, the words ping-ponged between two register sets (no copies of a rotation)
        last = t0 + TPS - TPI
        for t in range(ts, last, 2 * TPI):
            m0, m1, m2, m3 = _gemv_words(wp, t + TPI, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
            acc, acc2 = _gemv_iter(acc, acc2, n0, n1, n2, n3, t, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2, K,
                                   ONE, BITS, G, EVEN_K, EVEN_N, TPI, NH, BNH, RS, SYM)
            n0, n1, n2, n3 = _gemv_words(wp, tl.minimum(t + 2 * TPI, last), N, nmask, nmask2, C, TPI, NH, BNH, RS,
                                         EVEN_N)   # the last pair re-reads its own tile (L2 hits)
            acc, acc2 = _gemv_iter(acc, acc2, m0, m1, m2, m3, t + TPI, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2,
                                   K, ONE, BITS, G, EVEN_K, EVEN_N, TPI, NH, BNH, RS, SYM)
        if (TPS // TPI) % 2 == 1:   # an odd count: the last iteration, its words loaded by the last pair (or above)
            acc, acc2 = _gemv_iter(acc, acc2, n0, n1, n2, n3, last, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2, K,
                                   ONE, BITS, G, EVEN_K, EVEN_N, TPI, NH, BNH, RS, SYM)
    else:
        for t in range(ts, t0 + TPS, TPI):
            w0, w1, w2, w3 = _gemv_words(wp, t, N, nmask, nmask2, C, TPI, NH, BNH, RS, EVEN_N)
            acc, acc2 = _gemv_iter(acc, acc2, w0, w1, w2, w3, t, x_ptr, s_ptr, o_ptr, N, rn, rc, nmask, nmask2, K,
                                   ONE, BITS, G, EVEN_K, EVEN_N, TPI, NH, BNH, RS, SYM)
    _gemv_end(acc, acc2, out_ptr, ws_ptr, cnt_ptr + pid_n, rn, nmask, nmask2, col0, N, BNH, NH, ACT, SPLIT)


@triton.jit
def _gemv3_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, TPS, ONE,
                  BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, TPI: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, PF: tl.constexpr):
    "The GEMV with one `[C, TPI, BN]` load per iteration (TPI K-tiles as a tensor axis; the default for groups >= 64)."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    ru = tl.arange(0, TPI)
    rc = tl.arange(0, C)
    # [C, TPI, BN]: in this order Triton puts the warps along c and gives each thread one tile (one scale row)
    wp = qw_ptr + (ru[None, :, None] * C + rc[:, None, None]) * N + rn[None, None, :]
    xp = x_ptr + ru[None, :] * 128 + rc[:, None]                                        # [C, TPI]
    nmask = rn < N
    acc = tl.zeros([C, TPI, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    if PF:   # register double buffer: the next iteration's words are loaded before this one's math
        nxt = tl.load(wp + t0 * C * N, mask=nmask[None, None, :], other=0, eviction_policy='evict_first')
    for t in range(t0, t0 + TPS, TPI):
        if PF:
            words = nxt
            tn = tl.minimum(t + TPI, t0 + TPS - TPI)   # the last iteration re-reads its own tiles (L2 hit)
            nxt = tl.load(wp + tn * C * N, mask=nmask[None, None, :], other=0, eviction_policy='evict_first')
        elif EVEN_N:
            words = tl.load(wp + t * C * N, eviction_policy='evict_first')
        else:
            words = tl.load(wp + t * C * N, mask=nmask[None, None, :], other=0, eviction_policy='evict_first')
        xb = xp + t * 128
        for gi in tl.static_range(NG):
            for jj in tl.static_range(JPG):
                if EVEN_K:
                    xj = tl.load(xb + (gi * JPG + jj) * C, eviction_policy='evict_last').to(tl.float32)
                else:
                    xj = tl.load(xb + (gi * JPG + jj) * C, mask=(t * 128 + (gi * JPG + jj) * C + rc[:, None] + ru[None, :] * 128) < K,
                                 other=0.0, eviction_policy='evict_last').to(tl.float32)
                p = _field_f(words, gi * JPG + jj, BITS, ONE) * xj[:, :, None]
                if jj == 0:
                    tf = p
                    xs = xj
                else:
                    tf += p
                    xs += xj
            sp = ((t + ru) * 128 + gi * GW) // G * N   # scale row of each of the TPI tiles
            if EVEN_N:
                s = tl.load(s_ptr + sp[:, None] + rn[None, :]).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + sp[:, None] + rn[None, :]).to(tl.float32) - s
            else:
                s = tl.load(s_ptr + sp[:, None] + rn[None, :], mask=nmask[None, :], other=0.0).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + sp[:, None] + rn[None, :], mask=nmask[None, :], other=0.0).to(tl.float32) - s
            acc += tf * s[None, :, :]
            acc += xs[:, :, None] * o[None, :, :]
    y = tl.sum(tl.sum(acc, 1), 0)
    store_out(y, out_ptr + rn, nmask, ws_ptr + rn, cnt_ptr + pid_n, SPLIT)


@triton.jit
def _mm_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om, TPS, ONE,
               BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
               PERGROUP: tl.constexpr):
    """out[BM, BN] = x[BM, K] @ W[BN, K].T, one tl.dot per bit field (K = C each); program axes: N-block, K-split,
    M-block. PERGROUP: the dot takes the exact `f = 1 + q / 2**BITS` in x's dtype and the scales are applied to the
    [BM, BN] group sums (`S * dot + B * sum(x)`: 2 ops per weight less); else W is dequantized in fp32 and rounded."""
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    nmask = rn < N
    mmask = rm < M
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rc[None, :]
    wp = qw_ptr + rc[:, None] * N + rn[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    t0 = pid_k * TPS
    for t in range(t0, t0 + TPS):
        if EVEN_N:
            words = tl.load(wp + t * C * N, eviction_policy='evict_first')
        else:
            words = tl.load(wp + t * C * N, mask=nmask[None, :], other=0, eviction_policy='evict_first')
        kb = t * 128
        for gi in tl.static_range(NG):
            go = (kb + gi * GW) // G
            if EVEN_N:
                s = tl.load(s_ptr + go * N + rn).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn).to(tl.float32) - s
            else:
                s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
                o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
            if PERGROUP:
                d = tl.zeros([BM, BN], dtype=tl.float32)
                xs = tl.zeros([BM, C], dtype=tl.float32)
            for jj in tl.static_range(JPG):
                if EVEN_K:
                    xt = tl.load(xp + kb + (gi * JPG + jj) * C, mask=mmask[:, None], other=0.0)
                else:
                    xt = tl.load(xp + kb + (gi * JPG + jj) * C,
                                 mask=mmask[:, None] & ((kb + (gi * JPG + jj) * C + rc)[None, :] < K), other=0.0)
                f = _field_f(words, gi * JPG + jj, BITS, ONE)
                if PERGROUP:
                    d = tl.dot(xt, f.to(xt.dtype), d, input_precision=PREC)
                    xs += xt.to(tl.float32)
                else:
                    w = f * s[None, :] + o[None, :]
                    acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PREC)
            if PERGROUP:
                acc += d * s[None, :]
                acc += tl.sum(xs, 1)[:, None] * o[None, :]
    mask = mmask[:, None] & nmask[None, :]
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    store_out(acc, optr, mask, ws_ptr + rm[:, None] * N + rn[None, :], cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT)


@triton.jit
def _tc_field(words, J: tl.constexpr, DT: tl.constexpr, ONE, ASM: tl.constexpr):
    """Bit field `J` of the int32 `words` as the MMA operand `f` in `DT`: `1 + q / 16` by `_field_f` (ASM off), or
    with inline PTX two weights at a time as `1 + q / 128` (bf16) / `1 + q / 1024` (fp16): one PRMT gathers the
    field's byte of two words into the two 16-bit halves, one LOP3 keeps the nibbles and ORs in 1.0 (`_tc_scale`)."""
    if ASM:
        B: tl.constexpr = J // 2
        SEL: tl.constexpr = B | (B << 4) | ((4 + B) << 8) | ((4 + B) << 12)
        sel = tl.full(words.shape, SEL, tl.int32)
        if DT == tl.bfloat16:
            c1 = tl.full(words.shape, 0x3F803F80, tl.int32)
        else:
            c1 = tl.full(words.shape, 0x3C003C00, tl.int32)
        if J % 2 == 0:
            f = tl.inline_asm_elementwise("{ .reg .b32 p; prmt.b32 p, $1, $2, $3; lop3.b32 $0, p, 0x000F000F, $5, 0xEA; }",
                                          "=r,r,r,r,r,r,r", [words, sel, c1], dtype=tl.int16, is_pure=True, pack=2)
        else:
            f = tl.inline_asm_elementwise("{ .reg .b32 p; prmt.b32 p, $1, $2, $3; shr.b32 p, p, 4; "
                                          "lop3.b32 $0, p, 0x000F000F, $5, 0xEA; }",
                                          "=r,r,r,r,r,r,r", [words, sel, c1], dtype=tl.int16, is_pure=True, pack=2)
        return f.to(DT, bitcast=True)
    else:
        return _field_f(words, J, 4, ONE).to(DT)


@triton.jit
def _tc_kernel(x_ptr, qw_ptr, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om, TPS, ONE,
               G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               SPLIT: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """Tensor-core W4A16 for 1 <= M <= BM (4-bit, groups >= 128): `out.T[BN, BM] = sum_j f_j[BN, 16] @ x_j.T[16, BM]`.
    The weights are the MMA's A operand: the `[BN, 16]` word tile (transposed view of the packed layout) goes to the
    dot-operand layout once per K-tile and each bit field is dequantized there to the exact `f = 1 + q / 16` in x's
    dtype; x (zero rows up to BM) is the B operand. The `[BN, BM]` group sums get the scales (`S * dot + B * sum(x)`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rc = tl.arange(0, 16)
    rm = pid_m * BM + tl.arange(0, BM)
    nmask = rn < N
    mmask = rm < M
    wp = qw_ptr + rc[None, :] * N + rn[:, None]                                            # [BN, 16] words, tile 0
    xp = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[None, :] * stride_xm + rc[:, None]   # [16, BM]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    FS: tl.constexpr = (128 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024) if ASM else 16   # f = 1 + q / FS
    t0 = pid_k * TPS
    pdl_wait(PDL)
    pdl_launch(PDL)
    for t in range(t0, t0 + TPS):
        if EVEN_N:
            words = tl.load(wp + t * 16 * N, eviction_policy='evict_first')
        else:
            words = tl.load(wp + t * 16 * N, mask=nmask[:, None], other=0, eviction_policy='evict_first')
        kb = t * 128
        d = tl.zeros([BN, BM], dtype=tl.float32)
        xs = tl.zeros([16, BM], dtype=tl.float32)
        for j in tl.static_range(8):
            if EVEN_K:
                xt = tl.load(xp + kb + j * 16, mask=mmask[None, :], other=0.0)
            else:
                xt = tl.load(xp + kb + j * 16, mask=mmask[None, :] & ((kb + j * 16 + rc) < K)[:, None], other=0.0)
            d = tl.dot(_tc_field(words, j, xt.dtype, ONE, ASM), xt, d)
            xs += xt.to(tl.float32)
        go = kb // G
        if EVEN_N:
            s = tl.load(s_ptr + go * N + rn).to(tl.float32) * FS
            o = tl.load(o_ptr + go * N + rn).to(tl.float32) - s
        else:
            s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * FS
            o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
        acc += d * s[:, None]
        acc += o[:, None] * tl.sum(xs, 0)[None, :]
    optr = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
    store_out(acc, optr, nmask[:, None] & mmask[None, :], ws_ptr + rm[None, :] * N + rn[:, None],
               cnt_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, o_ptr, out_ptr, N, K, ONE,
                    BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
    "out[n, k] = W[n, k] (row-major [N, K]) for one K-tile (axis 0) and BN columns (axis 1)."
    C: tl.constexpr = 4 * BITS
    GW: tl.constexpr = G if G < 128 else 128
    JPG: tl.constexpr = GW // C
    NG: tl.constexpr = 128 // GW
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rc = tl.arange(0, C)
    nmask = rn < N
    words = tl.load(qw_ptr + (t * C + rc)[:, None] * N + rn[None, :], mask=nmask[None, :], other=0)
    for gi in tl.static_range(NG):
        go = (t * 128 + gi * GW) // G
        s = tl.load(s_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) * (1 << BITS)
        o = tl.load(o_ptr + go * N + rn, mask=nmask, other=0.0).to(tl.float32) - s
        for jj in tl.static_range(JPG):
            w = _field_f(words, gi * JPG + jj, BITS, ONE) * s[None, :] + o[None, :]
            k = t * 128 + (gi * JPG + jj) * C + rc
            tl.store(out_ptr + rn[None, :].to(tl.int64) * K + k[:, None], w.to(out_ptr.dtype.element_ty),
                     mask=nmask[None, :] & (k < K)[:, None])


# --------------------------------------------------------------------------------------------- launchers

# Defaults from the H200 sweeps (tests/bench_quant.py, results/h200_quant_kernels.csv). GEMV: per (N, K, bits) for
# groups >= 64, else the generic config; `split` fixes split-K, else `target` = programs wanted in multiples of the SM
# count (split-K fills up to it); `pf`: register prefetch of the next iteration's words.
GEMV_DEFAULT = dict(variant='2d', bn=64, tpi=4, num_warps=4, num_stages=1, target=7, pf=True)
GEMV_SMALL_GROUP = dict(variant='2d', bn=64, tpi=2, num_warps=4, num_stages=1, target=7, pf=False)
# maxnreg: register caps from the H200 sweeps (results/h200_gemv_maxnreg_sweep.csv at f620da0, then
# results/h200_gemv_slot_sweep.csv at 886260d for the `_field_slot` kernel); ptxas schedules differently under a cap.
# rs: row halves (`_gemv_tile_rs`, on by default where it applies): gate_up 25.0 -> 23.9 us, down 14.5 -> 14.0 us;
# o measured 6.86 with it against 6.81 without. Layer 59.4 us (19b5906) -> 52.3 us. Caps of o (72) and down (96)
# re-swept for symmetric layers with the paired-iteration loop (results/h200_gemv_sym_sweep.csv at 58d845f).
GEMV_CONFIGS = {   # nh=2 from the H200 sweep at 547384b (results/h200_gemv_nh_sweep.csv): layer 65.5 -> 58.8 us
    (6144, 4096, 4): dict(variant='2d', bn=128, tpi=2, num_warps=4, num_stages=1, split=8, pf=True, nh=2, maxnreg=168),
    (4096, 4096, 4): dict(variant='2d', bn=128, tpi=1, num_warps=4, num_stages=1, split=32, pf=True, nh=2, maxnreg=72,
                          rs=False),
    (28672, 4096, 4): dict(variant='2d', bn=128, tpi=1, num_warps=4, num_stages=1, split=4, pf=True, nh=2, maxnreg=96),
    (4096, 14336, 4): dict(variant='2d', bn=128, tpi=1, num_warps=4, num_stages=1, split=28, pf=True, nh=2, maxnreg=96),
}
# Groups < 64 (GGUF q4_k / q4_0 / q8_0 repacks, g32) per (N, K, bits), from the `q4k` sweep (H200, 02a8421): qkv
# 11.9 -> 11.45 us, o 9.1 -> 8.3 us; gate_up and down keep the generic config (within 0.4 us of their best).
# nh=2 (547384b): qkv 11.9 -> 11.2 us, gate_up 41.1 -> 39.3 us; o and down measured slower with it (8.9, 25.0 us).
GEMV_SMALL_CONFIGS = {   # maxnreg from the sweep at f620da0: layer 83.0 -> 78.4 us (gate_up 40.9 -> 37.2)
    (6144, 4096, 4): dict(variant='2d', bn=128, tpi=2, num_warps=4, num_stages=1, split=8, pf=False, nh=2),
    (4096, 4096, 4): dict(variant='2d', bn=64, tpi=2, num_warps=4, num_stages=1, split=16, pf=False, maxnreg=64),
    (28672, 4096, 4): dict(variant='2d', bn=128, tpi=2, num_warps=4, num_stages=1, split=4, pf=False, nh=2, maxnreg=128),
    (4096, 14336, 4): dict(GEMV_SMALL_GROUP, maxnreg=96),
}
# Batched (1 < M <= MM_MAX_M): by the M bucket (16, 32, 64, 128), per (N, K, bits, bucket) where measured.
MM_DEFAULT = {16: dict(bn=256, num_warps=4, num_stages=3, target=2), 32: dict(bn=256, num_warps=4, num_stages=3, target=2),
              64: dict(bn=128, num_warps=4, num_stages=3, target=2), 128: dict(bn=128, num_warps=4, num_stages=3, target=1)}
# 4-bit groups < 128 (GGUF q4_0/q4_1/q4_k repacks, g32/g64): per-weight dequantization (PERGROUP off) and the
# configuration of the previous `_mm_kernel` (block N 64, 4 warps; split-K up to 2 programs per SM). Not re-measured:
# the last H200 run had them on the g128 path (PERGROUP, block N 256), 195.6 us per q4_k layer at M=16 against
# 157.8 us for the previous kernel, so this restores the previous kernel's settings (expected <= 157.8 us).
MM_SMALL_GROUP = dict(bn=64, num_warps=4, num_stages=3, target=2)
MM_CONFIGS = {
    (6144, 4096, 4, 64): dict(bn=128, num_warps=4, num_stages=3, split=4),
    (4096, 4096, 4, 64): dict(bn=128, num_warps=4, num_stages=3, split=8),
    (28672, 4096, 4, 64): dict(bn=128, num_warps=4, num_stages=3, split=1),
    (4096, 14336, 4, 64): dict(bn=128, num_warps=4, num_stages=3, split=8),
}


def w4a16_gemv(x, qweight, scales, offsets, bits, group, N, K, out_dtype=None, bn=None, tpi=None,
               num_warps=None, split_k=None, variant=None, num_stages=None, prefetch=None, pdl=None, act=None, nh=None,
               maxnreg=None, rs=None, sym=False):
    """`x` `[1, K]` @ W.T -> `[1, N]` with a GEMV kernel (`variant` '2d': `_gemv_kernel`, '3d': `_gemv3_kernel`,
    'dot': the tensor-core kernel with x padded to 16 rows). `split_k` programs per column block share the K-tiles
    and meet in the self-zeroing workspace. `pdl`: programmatic dependent launch (default: `pdl_on`).
    `act='silu_and_mul'`: W's rows interleave gate and up; returns `silu(gate) * up` `[1, N / 2]` (in the '2d'
    kernel's epilogue, else by `silu_and_mul`). `nh=2`: the 2d kernel's program holds its `bn` columns as two
    tiles that share their x loads (K-tiles per iteration at most 2). `maxnreg`: a register cap per thread (more
    programs per SM, at the price of spills). `rs`: row halves (`_gemv_tile_rs`; default: where it applies).
    `sym`: the caller vouches that `offsets == -8 * scales` (symmetric 4-bit); used where the kernel takes the fields
    in place (4-bit, groups >= 64), which then reads no offsets."""
    assert x.shape == (1, K), x.shape
    assert act in (None, 'silu_and_mul'), act
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    if nh not in (None, 1, 2) or (nh == 2 and variant in ('3d', 'dot')):
        raise ValueError(f"nh={nh}: 1, or 2 with the 2d kernel")
    if act and variant in ('3d', 'dot'):   # only the 2d kernel has the epilogue
        return silu_and_mul(w4a16_gemv(x, qweight, scales, offsets, bits, group, N, K, out_dtype, bn, tpi, num_warps,
                                       split_k, variant, num_stages, prefetch, pdl), interleaved=True)
    if variant == 'dot':
        return w4a16_mm(x, qweight, scales, offsets, bits, group, N, K, out_dtype, bn=bn, num_warps=num_warps,
                        split_k=split_k, num_stages=num_stages)
    x = x.contiguous()
    tiles = Kp // TILE_K
    cfg = GEMV_SMALL_CONFIGS.get((N, K, bits), GEMV_SMALL_GROUP) if G < 64 else GEMV_CONFIGS.get((N, K, bits), GEMV_DEFAULT)
    default = variant is None and bn is None and tpi is None
    if variant is None: variant = cfg['variant']
    bn = bn or (16 if _INTERPRET else cfg['bn'])
    tpi = tpi or (2 if _INTERPRET else cfg['tpi'])
    num_warps = num_warps or cfg['num_warps']
    num_stages = num_stages or cfg['num_stages']
    prefetch = cfg['pf'] if prefetch is None else prefetch
    nh = nh or (cfg.get('nh', 1) if variant == '2d' else 1)
    maxnreg = maxnreg or (cfg.get('maxnreg') if default else None)
    if nh == 2 and (variant != '2d' or bn % 2):
        raise ValueError(f"nh=2 needs the 2d kernel and an even block N, got {variant}, bn={bn}")
    if variant == '2d': tpi = min(tpi, 4 if nh == 1 else 2)
    while tiles % tpi: tpi //= 2
    progs = triton.cdiv(N, bn)
    if split_k is None:
        split_k = split_for(cfg if default else {'target': cfg.get('target', 4)}, tiles, progs, tpi, x.device)
    elif tiles % split_k or (tiles // split_k) % tpi:
        raise ValueError(f"split_k={split_k} must divide the {tiles} K-tiles into multiples of tpi={tpi}")
    if act and (N % 2 or (bn // nh) % 2): raise ValueError(f"act needs an even N and block N, got {N}, {bn}")
    out = torch.empty(1, N // 2 if act else N, dtype=out_dtype or x.dtype, device=x.device)
    ws, cnt = split_k_workspace(x.device, N, progs)
    if pdl is None and G < 64: pdl = False   # groups < 64 (q4_k, q4_0, q8_0 repacks): PDL measured no faster
    rs_ok = bits == 4 and G >= 64 and nh == 2 and tpi == 1 and variant == '2d'
    if rs and not rs_ok: raise ValueError("rs=True needs the 2d kernel, 4 bits, groups >= 64, nh=2 and tpi=1")
    if rs is None: rs = rs_ok and (cfg.get('rs', True) if default else True)
    kernel, kw = ((_gemv3_kernel, {}) if variant == '3d' else
                  (_gemv_kernel, dict(pdl_kw(x.device, pdl), ACT=bool(act), NH=nh, RS=bool(rs),
                                      SYM=bool(sym) and bits == 4 and G >= 64)))
    kernel[(progs, split_k)](x, qweight, scales, offsets, out, ws, cnt, N, K, tiles // split_k, _ONE,
                             BITS=bits, G=G, BN=bn, TPI=tpi, EVEN_K=K == Kp, EVEN_N=N % bn == 0,
                             SPLIT=split_k, PF=bool(prefetch), num_warps=num_warps, num_stages=num_stages,
                             **kw, **({'maxnreg': maxnreg} if maxnreg else {}))
    return out


def w4a16_mm(x, qweight, scales, offsets, bits, group, N, K, out_dtype=None, bm=None, bn=None, num_warps=None,
             split_k=None, num_stages=None, target=None):
    """`x` `[M, K]` @ W.T -> `[M, N]` with the fused dequantize + `tl.dot` kernel: one program per (N-block, K-split,
    M-block of up to 64 rows), so each weight tile is read once per 64 rows."""
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    x = x.contiguous()
    tiles = Kp // TILE_K
    b = m_bucket(M)
    small = bits == 4 and G < TILE_K
    cfg = MM_SMALL_GROUP if small else MM_CONFIGS.get((N, K, bits, b), MM_DEFAULT[b])
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(x, N, tiles, cfg, bm, bn, num_warps, num_stages,
                                                                         split_k, target, out_dtype)
    prec = 'ieee' if x.dtype == torch.float32 else 'tf32'
    _mm_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x, qweight, scales, offsets, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), tiles // split_k, _ONE,
        BITS=bits, G=G, BM=bm, BN=bn, EVEN_K=K == Kp, EVEN_N=N % bn == 0, SPLIT=split_k, PREC=prec,
        PERGROUP=not (small or (bits == 8 and x.dtype == torch.bfloat16)), num_warps=num_warps, num_stages=num_stages)
    return out


# Tensor-core kernel: per (N, K, M bucket) from the H200 sweep (results/h200_tc_sweep.csv), else TC_DEFAULT; the
# M buckets 32 and 128 were not swept.
TC_DEFAULT = dict(bn=128, num_warps=4, num_stages=3, target=2)
TC_CONFIGS = {
    (6144, 4096, 16): dict(bn=128, num_warps=2, num_stages=3, split=8),
    (4096, 4096, 16): dict(bn=128, num_warps=4, num_stages=2, split=16),
    (28672, 4096, 16): dict(bn=256, num_warps=4, num_stages=3, split=2),
    (4096, 14336, 16): dict(bn=256, num_warps=4, num_stages=3, split=16),
    (6144, 4096, 64): dict(bn=128, num_warps=4, num_stages=3, split=4),
    (4096, 4096, 64): dict(bn=128, num_warps=4, num_stages=3, split=8),
    (28672, 4096, 64): dict(bn=128, num_warps=4, num_stages=3, split=1),
    (4096, 14336, 64): dict(bn=128, num_warps=4, num_stages=3, split=8),
}


def tc_supported(x, bits, group, K) -> bool:
    "Whether `_tc_kernel` takes this call: 4-bit, groups of >= 128 (one per K-tile, or per channel), 16-bit x."
    Kp = -(-K // TILE_K) * TILE_K
    G = Kp if group in (-1, None) or group >= Kp else group
    return bits == 4 and G % TILE_K == 0 and x.dtype in (torch.float16, torch.bfloat16)


def w4a16_tc(x, qweight, scales, offsets, bits, group, N, K, out_dtype=None, bm=None, bn=None, num_warps=None,
             num_stages=None, split_k=None, target=None, pdl=None, asm=None):
    """`x` `[M, K]` (16-bit) @ W.T -> `[M, N]` with the tensor-core kernel `_tc_kernel` (4-bit, groups >= 128): one
    program per (N-block, K-split, block of up to 64 rows). `asm`: the inline-PTX dequantization (default: on a GPU)."""
    M = x.shape[0]
    assert x.ndim == 2 and x.shape[1] == K, x.shape
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    if not tc_supported(x, bits, group, K):
        raise ValueError(f"_tc_kernel needs 4-bit weights, groups >= 128 and 16-bit x; got {bits}-bit, group {group}, {x.dtype}")
    x = x.contiguous()
    tiles = Kp // TILE_K
    b = m_bucket(M)
    cfg = TC_CONFIGS.get((N, K, b), TC_DEFAULT)
    bm, bn, num_warps, num_stages, split_k, out, ws, cnt = batched_plan(x, N, tiles, cfg, bm, bn, num_warps, num_stages,
                                                                         split_k, target, out_dtype)
    _tc_kernel[(triton.cdiv(N, bn), split_k, triton.cdiv(M, bm))](
        x, qweight, scales, offsets, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), tiles // split_k, _ONE,
        G=G, BM=bm, BN=bn, EVEN_K=K == Kp, EVEN_N=N % bn == 0, SPLIT=split_k,
        ASM=(not _INTERPRET) if asm is None else bool(asm), num_warps=num_warps, num_stages=num_stages,
        **pdl_kw(x.device, pdl))
    return out


def w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=torch.float16, bn=None):
    "The weight `[N, K]` in `dtype`, written by the Triton dequantize kernel."
    Kp, G = check_layout(qweight, scales, offsets, bits, group, N, K)
    bn = bn or (16 if _INTERPRET else 64)
    out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    _dequant_kernel[(Kp // TILE_K, triton.cdiv(N, bn))](qweight, scales, offsets, out, N, K, _ONE, BITS=bits, G=G, BN=bn,
                                                        num_warps=4)
    return out


MM_MAX_M = 128  # above: dequantize once + cuBLAS


def w4a16_matmul(x, qweight, scales, offsets, bits, group, N, K, act=None, sym=False):
    """`x` `[..., K]` @ W.T -> `[..., N]` in x's dtype, picking the kernel by the number of rows M (1: GEMV; up to
    `MM_MAX_M`: the tensor-core kernel where `tc_supported`, else the per-field `tl.dot` kernel; more: dequantize +
    cuBLAS).
    `act='silu_and_mul'` (W's rows interleave gate and up): `[..., N / 2]`, fused into the GEMV at M = 1.
    `sym`: `offsets == -8 * scales` (4-bit symmetric; the GEMV then skips the offsets, `w4a16_gemv`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0: return x.new_empty(*lead, N // 2 if act else N)
    if M == 1: return w4a16_gemv(x2, qweight, scales, offsets, bits, group, N, K, act=act, sym=sym).reshape(*lead, -1)
    if M <= MM_MAX_M and tc_supported(x2, bits, group, K): y = w4a16_tc(x2, qweight, scales, offsets, bits, group, N, K)
    elif M <= MM_MAX_M: y = w4a16_mm(x2, qweight, scales, offsets, bits, group, N, K)
    else:
        wdt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        y = (x2.to(wdt) @ w4a16_dequantize(qweight, scales, offsets, bits, group, N, K, dtype=wdt).T).to(x.dtype)
    if act: y = silu_and_mul(y, interleaved=True)
    return y.reshape(*lead, -1)


# --------------------------------------------------------------------------------------------- reference

def w4a16_matmul_ref(x, qweight, scales, offsets, bits, group, N, K):
    "Reference: dequantize in PyTorch, fp32 matmul, cast to x's dtype."
    w = dequantize_packed_ref(qweight, scales, offsets, bits, group, N, K)
    return (x.float() @ w.T).to(x.dtype)
