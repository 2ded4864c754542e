"""W4A16 (packed 4/8-bit) matmul kernels against their dequantize + fp32 matmul references (FP8: `test_kernels_fp8.py`).

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes. CUDA (`-m cuda`): the Llama-3-8B shapes, the
layers (`W4A16Linear`, packed `GGUFLinear`, `FP8Linear`) and `quantize_model` on the GPU.
`python -m benchmarks.kernels.bench_quant` times them on a GPU (`benchmarks/README.md`).
"""

import pytest
import torch
from helpers import rel_err as _rel

from cvllm_lab.kernels.activation import silu_and_mul_ref
from cvllm_lab.kernels.gguf_layout import PACKED_TYPES, dequantize
from cvllm_lab.kernels.split_k import workspaces
from cvllm_lab.kernels.w4a16 import (
    dequantize_packed_ref,
    mma_supported,
    w4a16_dequantize,
    w4a16_gemv,
    w4a16_matmul,
    w4a16_matmul_ref,
    w4a16_mm,
    w4a16_mma,
    w4a16_tc,
)
from cvllm_lab.quant.gguf import GGUFLinear, random_blocks
from cvllm_lab.quant.w4a16 import W4A16Linear


def _gemv_tol(bits, group):
    """Relative error bound of the M = 1 GEMV against the fp32 reference. 4-bit groups >= 64 take the fields where
    they lie in the word (`field_slot`, 1 + q * 2**-12 at worst) with x scaled by up to 2**8: with bf16 x every
    product and partial sum is exact in fp32 (~3e-6 measured, from the reference's own rounding), with fp32 x (these
    tests) the products round at 2**-12 of a weight's term, ~1e-4 of the output (the activation's cancellation
    included); the other paths are exact up to fp32 sums."""
    return 3e-4 if bits == 4 and (group >= 64 or group == -1) else 1e-5


def _ws_clean():
    "Split-K kernels must leave their workspace and counters at zero."
    return all(not ws.any() and not cnt.any() for ws, cnt in workspaces())


def _packed(N, K, bits, group, sym, seed, device='cpu'):
    g = torch.Generator().manual_seed(seed)
    m = W4A16Linear.from_float(torch.randn(N, K, generator=g) * 0.05, group, bits, sym).to(device)
    return (m.qweight, m.scales, m.offsets, bits, m.group, N, K)


CONFIGS = [
    (4, 128, True),
    (4, 128, False),
    (4, 64, False),
    (4, 32, True),
    (4, -1, True),
    (8, 32, True),
    (8, 128, False),
]
IDS = [f'{b}bit-g{g}-{"sym" if s else "asym"}' for b, g, s in CONFIGS]


# ------------------------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.interp
@pytest.mark.parametrize('bits,group,sym', CONFIGS, ids=IDS)
def test_w4a16_cpu(bits, group, sym):
    torch.manual_seed(1000 * bits + group)  # x below: the test must not depend on which tests ran before it
    tol = _gemv_tol(bits, group)
    for N, K in ((64, 256), (40, 200)):  # the second: N % BN != 0, K % 128 != 0 (padded)
        args = _packed(N, K, bits, group, sym, N + K)
        assert torch.equal(w4a16_dequantize(*args, dtype=torch.float32), dequantize_packed_ref(*args))
        for M in (1, 3, 17):
            x = torch.randn(M, K)
            y = w4a16_matmul(x, *args)  # M=1: GEMV, else the fused tl.dot kernel
            assert y.shape == (M, N) and _rel(y, w4a16_matmul_ref(x, *args)) < (tol if M == 1 else 1e-5), (N, K, M)
    args = _packed(32, 512, bits, group, sym, 7)
    x = torch.randn(1, 512)
    ref = w4a16_matmul_ref(x, *args)
    for tpi, split in ((1, 4), (2, 2), (4, 1), (1, 1), (1, 2)):  # split-K (self-zeroing workspace), tiles per iteration
        assert _rel(w4a16_gemv(x, *args, tpi=tpi, split_k=split, bn=8), ref) < tol, (tpi, split)
        # register prefetch of the next iteration's words
        assert _rel(w4a16_gemv(x, *args, tpi=tpi, split_k=split, bn=8, prefetch=True), ref) < tol
        for pf in (False, True):  # PDL: the first iteration's words before the wait
            y = w4a16_gemv(x, *args, tpi=tpi, split_k=split, bn=8, prefetch=pf, pdl=True)
            assert _rel(y, ref) < tol, (tpi, split, pf)
            if tpi <= 2:  # two column tiles sharing x, with and without PDL
                for pdl in (False, True):
                    y = w4a16_gemv(x, *args, tpi=tpi, split_k=split, bn=16, prefetch=pf, pdl=pdl, nh=2)
                    assert _rel(y, ref) < tol, (tpi, split, pf, pdl)
    assert _rel(w4a16_gemv(x, *args, maxnreg=64), ref) < tol  # a register cap (the GPU configs' `maxnreg`)
    a3 = _packed(
        40, 384, bits, group, sym, 9
    )  # 3 K-tiles: a prefetched pair of iterations, then the odd one; N % BN != 0
    x3 = torch.randn(1, 384)
    for nh in (1, 2):
        assert (
            _rel(w4a16_gemv(x3, *a3, tpi=1, split_k=1, bn=16, nh=nh, prefetch=True), w4a16_matmul_ref(x3, *a3)) < tol
        ), nh
    if bits == 4 and (group >= 64 or group == -1):  # row halves chained into one sum, and without;
        for rs in (True, False):  # symmetric: offsets (-8 scale) not read
            for sy in (False, True) if sym else (False,):
                assert _rel(w4a16_gemv(x, *args, tpi=1, split_k=2, bn=16, nh=2, rs=rs, sym=sy), ref) < tol, (rs, sy)
        if sym:
            assert _rel(w4a16_gemv(x, *args, tpi=2, bn=16, sym=True), ref) < tol
        else:  # the flag is the caller's promise: on asymmetric weights it must change the result
            assert _rel(w4a16_gemv(x, *args, tpi=2, bn=16, sym=True), ref) > 1e-2
    else:
        with pytest.raises(ValueError):
            w4a16_gemv(x, *args, tpi=1, bn=16, nh=2, rs=True)
    for M in (5, 17):  # 17: two M-blocks, each with its own counters
        x = torch.randn(M, 512).half()
        assert _rel(w4a16_mm(x, *args, split_k=2), w4a16_matmul_ref(x.float(), *args)) < 2e-3
        assert _rel(w4a16_mm(x, *args, split_k=4, bn=16), w4a16_matmul_ref(x.float(), *args)) < 2e-3
    for M in (1, 3):  # silu(gate) * up of interleaved gate/up rows
        x = torch.randn(M, 512)
        ref = silu_and_mul_ref(w4a16_matmul_ref(x, *args), interleaved=True)
        # silu(gate) * up: the relative errors of the two GEMV outputs add up
        assert _rel(w4a16_matmul(x, *args, act='silu_and_mul'), ref) < (2 * tol if M == 1 else 1e-5), M
        if M == 1:  # the GEMV epilogue, with and without split-K
            for split, nh in ((1, 1), (4, 1), (1, 2), (4, 2)):
                y = w4a16_gemv(x, *args, tpi=1, split_k=split, bn=8, act='silu_and_mul', nh=nh)
                assert y.shape == (1, 16) and _rel(y, ref) < 2 * tol, (split, nh)
    assert _ws_clean()


@pytest.mark.interp
@pytest.mark.parametrize(
    'group,sym', [(128, True), (128, False), (-1, False)], ids=['g128-sym', 'g128-asym', 'per-channel']
)
def test_w4a16_tc_cpu(group, sym):
    "The tensor-core kernel (its plain-Triton dequantization: the interpreter runs no PTX), fp16 x as in its tl.dot."
    for N, K in ((64, 256), (40, 200)):
        args = _packed(N, K, 4, group, sym, N + K)
        for M in (1, 5, 17, 70):  # 70: two blocks of 64 rows, each with its own counters
            x = torch.randn(M, K).half()
            ref = w4a16_matmul_ref(x.float(), *args)
            for split in (1, 2):
                for sp in {False, sym}:  # symmetric layers: q - 8 in the MMA
                    y = w4a16_tc(x, *args, split_k=split, sym=sp)
                    assert y.shape == (M, N) and y.dtype == torch.float16 and _rel(y, ref) < 2e-3, (N, K, M, split, sp)
            if M > 1:
                assert _rel(w4a16_matmul(x, *args, sym=sym), ref) < 2e-3  # w4a16_matmul's pick for M > 1
            for split in (1, 2):  # rows as interleaved gate/up: the fused activation
                y = w4a16_tc(x, *args, split_k=split, sym=sym, act='silu_and_mul')
                assert y.shape == (M, N // 2) and _rel(y, silu_and_mul_ref(ref, interleaved=True)) < 2e-3, (N, K, M)
    assert _ws_clean()
    with pytest.raises(ValueError, match='act'):
        w4a16_tc(x, *args, act='gelu')
    for bits, g, dt in ((8, 128, torch.float16), (4, 32, torch.float16), (4, 128, torch.float32)):
        args = _packed(32, 256, bits, g, True, 0)
        with pytest.raises(ValueError, match='_tc_kernel'):
            w4a16_tc(torch.randn(3, 256, dtype=dt), *args)


@pytest.mark.interp
@pytest.mark.parametrize(
    'N,K,group,sym',
    [(64, 256, 128, True), (40, 200, 128, False), (64, 256, -1, False)],
    ids=['g128-sym', 'odd-n-k-asym', 'per-channel'],
)
def test_w4a16_mma_cpu(N, K, group, sym):
    """The MMA kernel's index arithmetic under the interpreter: its PTX (fragments, MMAs, epilogue) replaced by a
    plain-Triton emulation of the same per-lane registers (`_mma_emul`, `_lanes_out`), so a wrong word row, x run
    or lane mapping fails here; the PTX itself is checked on the GPU (`test_w4a16_mma_cuda`)."""
    args = _packed(N, K, 4, group, sym, N + K)
    w = dequantize_packed_ref(*args)
    for M, dt, nh, sk in ((1, torch.bfloat16, 1, 1), (3, torch.float16, 2, 2), (8, torch.bfloat16, 1, 2)):
        x = torch.randn(M, K).to(dt)
        ref = x.float() @ w.T
        y = w4a16_mma(x, *args, num_warps=1, nh=nh, split_k=sk, sym=sym, out_dtype=torch.float32)
        assert y.shape == (M, N) and _rel(y, ref) < 2e-4, (M, dt, nh, sk, _rel(y, ref))
    ya = w4a16_mma(x, *args, num_warps=1, sym=sym, act='silu_and_mul')
    assert ya.shape == (8, N // 2) and _rel(ya, silu_and_mul_ref(ref, interleaved=True)) < 1e-2
    r = torch.randn(8, N)  # acc: added into fp32 sums, split or not
    for sk in (1, 2):
        acc = r.clone()
        assert w4a16_mma(x, *args, num_warps=1, split_k=sk, sym=sym, acc=acc) is acc and _rel(acc, r + ref) < 2e-4
    with pytest.raises(ValueError, match='fp32'):
        w4a16_mma(x, *args, acc=r.half())
    gu = torch.randn(2, 2 * K)  # x_act: fp32 gate/up pairs activated on load
    xa = silu_and_mul_ref(gu, interleaved=True)
    z = torch.randn(37)  # zero: cleared by the programs between them
    for sk in (1, 2):
        y = w4a16_mma(
            gu,
            *args,
            num_warps=1,
            split_k=sk,
            sym=sym,
            x_act='silu_and_mul',
            dtype=torch.bfloat16,
            out_dtype=torch.float32,
            zero=z,
        )
        assert y.shape == (2, N) and _rel(y, xa.bfloat16().float() @ w.T) < 1e-2, (sk, _rel(y, xa @ w.T))
        assert z.abs().max() == 0
        z.normal_()
    with pytest.raises(ValueError, match='x_act'):
        w4a16_mma(gu, *args, x_act='silu_and_mul')
    # an RMSNorm split around the matmul: `norm` reads an fp32 residual times the norm's weight and adds the sum of
    # squares into `ssq`; `x_rms` applies its 1/rms to gate/up sums before the activation (the interpreter rounds to
    # bf16 by truncation, hence 1e-2 against the round-to-nearest references; the GPU test holds 2e-4)
    for M, sk in ((1, 1), (3, 2)):
        res, gw = torch.randn(M, K) * 3, (torch.rand(K) + 0.5).bfloat16()
        ssq2 = torch.rand(M, 2)
        want_ssq = ssq2[:, 1] + res.pow(2).sum(-1)
        acc = torch.randn(M, N)
        want = acc + (res * gw.float()).bfloat16().float() @ w.T
        w4a16_mma(res, *args, num_warps=1, split_k=sk, sym=sym, acc=acc, norm=(gw, ssq2[:, 1]), dtype=torch.bfloat16)
        assert _rel(acc, want) < 1e-2 and _rel(ssq2[:, 1], want_ssq) < 1e-6, (M, sk, _rel(acc, want))
        gu, ss = torch.randn(M, 2 * K), torch.rand(M) * 400
        xa = silu_and_mul_ref(gu * torch.rsqrt(ss / 100 + 1e-5)[:, None], interleaved=True).bfloat16().float()
        y = w4a16_mma(
            gu,
            *args,
            num_warps=1,
            split_k=sk,
            sym=sym,
            x_act='silu_and_mul',
            dtype=torch.bfloat16,
            out_dtype=torch.float32,
            x_rms=(ss, 100, 1e-5),
        )
        assert _rel(y, xa @ w.T) < 1e-2, (M, sk, _rel(y, xa @ w.T))
    with pytest.raises(ValueError, match='ssq'):
        w4a16_mma(res, *args, norm=(gw, ssq2), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match='x_act'):
        w4a16_mma(res, *args, x_rms=(ss, 100, 1e-5))
    assert _ws_clean()
    assert not mma_supported(x, 4, group, N, K)  # the interpreter runs no PTX: w4a16_matmul won't
    with pytest.raises(ValueError, match='multiple of 128'):  # group 32 (GGUF repacks): the GEMV's
        w4a16_mma(torch.randn(1, 256), *_packed(32, 256, 4, 32, True, 0))


@pytest.mark.interp
def test_w4a16_prefill_shapes_and_errors_cpu():
    args = _packed(24, 256, 4, 128, True, 1)
    x = torch.randn(2, 70, 256)  # M=140 > MM_MAX_M: dequantize kernel + matmul
    y = w4a16_matmul(x, *args)
    assert y.shape == (2, 70, 24) and _rel(y, w4a16_matmul_ref(x.reshape(-1, 256), *args).reshape(2, 70, 24)) < 1e-5
    assert w4a16_matmul(torch.randn(0, 256), *args).shape == (0, 24)
    with pytest.raises(ValueError):
        w4a16_matmul(torch.randn(1, 256), args[0][:, :-1], *args[1:5], 23, 256)
    with pytest.raises(ValueError):
        w4a16_gemv(torch.randn(1, 256), *args, split_k=3)
    with pytest.raises(ValueError, match='nh'):
        w4a16_gemv(torch.randn(1, 256), *args, nh=3)


@pytest.mark.interp
@pytest.mark.parametrize('t', PACKED_TYPES, ids=[t.name.lower() for t in PACKED_TYPES])
def test_gguf_packed_cpu(t):
    "GGUF q4_0/q4_1/q4_k/q8_0 repacked to the W4A16 layout (group 32): the kernels match GGUF dequantization."
    g = torch.Generator().manual_seed(3)
    raw = random_blocks(t, 32, 512, generator=g)
    m = GGUFLinear.from_gguf(raw, t, (32, 512)).pack()
    p = m.packed
    for M in (1, 4):
        x = torch.randn(M, 512, generator=g)
        ref = x @ dequantize(raw, t).T
        y = w4a16_matmul(x, p.qweight, p.scales, p.offsets, p.bits, p.group, 32, 512)
        assert _rel(y, ref) < (2e-3 if t.name == 'Q4_K' else 1e-5), (t.name, M, _rel(y, ref))


# ------------------------------------------------------------------------------------------- CUDA

SHAPES = [(4096, 14336), (14336, 4096), (6144, 4096), (576, 576)]


@pytest.mark.cuda
@pytest.mark.parametrize('N,K', SHAPES)
@pytest.mark.parametrize(
    'bits,group,sym', [(4, 128, True), (4, 32, False), (8, 32, True)], ids=['4-g128-sym', '4-g32-asym', '8-g32']
)
def test_w4a16_cuda(bits, group, sym, N, K):
    args = _packed(N, K, bits, group, sym, N, 'cuda')
    w = dequantize_packed_ref(*args)
    assert torch.equal(w4a16_dequantize(*args, dtype=torch.float32), w)
    tiles = (K + 127) // 128
    for M in (1, 3, 16, 33, 100, 300):
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        ref = x.float() @ w.T
        y = w4a16_matmul(x, *args)  # the defaults of each path
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, (N, K, M, _rel(y, ref))
        if sym:
            assert _rel(w4a16_matmul(x, *args, sym=True), ref) < 1e-2, (N, K, M)  # as W4A16Linear calls it
        if M == 16 and tiles % 4 == 0:  # batched kernels with split-K
            assert _rel(w4a16_mm(x, *args, split_k=4, bn=64), ref) < 1e-2, (N, K, M)
            if bits == 4 and group == 128:  # tensor cores: wgmma (4 warps), mma.sync (2), plain dequant
                for bn, nw, asm in ((64, 4, True), (128, 2, True), (128, 4, False)):
                    for sp in {False, sym}:  # symmetric: q - 8 by PTX (or plain Triton)
                        y = w4a16_tc(x, *args, split_k=4, bn=bn, num_warps=nw, asm=asm, sym=sp)
                        assert _rel(y, ref) < 1e-2, (N, K, bn, nw, asm, sp)
                for bm, bn in ((16, 256), (32, 128)):
                    assert _rel(w4a16_tc(x, *args, bm=bm, bn=bn, sym=sym), ref) < 1e-2, (N, K, bm, bn)
        if M == 64 and bits == 4 and group == 128:  # 32 and 64 rows per program, both paths
            for bm, sp in ((32, sym), (64, sym), (64, False)):
                assert _rel(w4a16_tc(x, *args, bm=bm, bn=128, sym=sp), ref) < 1e-2, (N, K, bm, sp)
    x = torch.randn(1, K, device='cuda')
    assert _rel(w4a16_matmul(x, *args), x @ w.T) < _gemv_tol(bits, group)  # fp32 in: no bf16 rounding
    xb = x.bfloat16()  # bf16 in, fp32 out: exact products and sums
    assert _rel(w4a16_gemv(xb, *args, out_dtype=torch.float32), xb.float() @ w.T) < 2e-5
    if group == 128 or N == 576:
        for bn, tpi, nw, sk, pf, nh in ((64, 4, 4, 2, 1, 1), (128, 2, 4, 2, 0, 2)):
            if tiles % (sk * tpi):
                continue  # the GEMV with split-K and prefetch
            y = w4a16_gemv(x, *args, bn=bn, tpi=tpi, num_warps=nw, split_k=sk, prefetch=pf, nh=nh)
            assert _rel(y, x @ w.T) < _gemv_tol(bits, group), (N, K, bn, tpi, sk)
    for M in (1, 16, 300):  # rows as interleaved gate/up: the fused activation
        x = torch.randn(M, K, device='cuda', dtype=torch.bfloat16)
        ref = silu_and_mul_ref(x.float() @ w.T, interleaved=True)
        y = w4a16_matmul(x, *args, act='silu_and_mul')
        assert y.shape == (M, N // 2) and _rel(y, ref) < 1e-2, (N, K, M, _rel(y, ref))
    assert _ws_clean()


@pytest.mark.cuda
@pytest.mark.parametrize(
    'N,K', [(28672, 4096), (4096, 14336), (4100, 4096), (1024, 1000)], ids=['gate-up', 'down', 'odd-n', 'odd-k']
)
def test_w4a16_mma_cuda(N, K):
    "The MMA kernel (M = 1 .. 8) at real sizes: bf16 / fp16 x, symmetric, asymmetric and per-channel scales, split-K."
    for group, sym in ((128, True), (128, False), (-1, False)):
        args = _packed(N, K, 4, group, sym, N, 'cuda')
        w = dequantize_packed_ref(*args)
        for M, dt in ((1, torch.bfloat16), (1, torch.float16), (5, torch.bfloat16), (8, torch.float16)):
            x = torch.randn(M, K, device='cuda', dtype=dt)
            assert mma_supported(x, 4, group, N, K)
            ref = x.float() @ w.T
            y = w4a16_mma(x, *args, sym=sym, out_dtype=torch.float32)  # tuned config
            assert _rel(y, ref) < 2e-4, (N, K, group, sym, M, dt, _rel(y, ref))
            r = torch.randn(M, N, device='cuda')
            acc = w4a16_mma(x, *args, sym=sym, acc=r.clone())  # added into fp32 sums
            assert _rel(acc, r + ref) < 2e-4, (N, K, group, sym, M, dt, 'acc')
            for nw, nh, sk in ((4, 2, 1), (8, 1, 2)):
                y = w4a16_mma(x, *args, num_warps=nw, nh=nh, split_k=sk, sym=sym)
                assert y.dtype == dt and _rel(y, ref) < 1e-2, (N, K, group, sym, M, nw, nh, sk)
        x = torch.randn(1, K, device='cuda', dtype=torch.bfloat16)
        ref = x.float() @ w.T
        assert _rel(w4a16_matmul(x, *args, sym=sym), ref) < 1e-2  # w4a16_matmul's pick at M = 1
        y = w4a16_mma(x, *args, sym=sym, act='silu_and_mul')
        assert _rel(y, silu_and_mul_ref(ref, interleaved=True)) < 1e-2
        if K % 2 == 0:  # x_act: gate/up sums activated on load, zero cleared
            gu, z = torch.randn(1, 2 * K, device='cuda'), torch.randn(1000, device='cuda')
            xa = silu_and_mul_ref(gu, interleaved=True).bfloat16().float()
            acc = torch.randn(1, N, device='cuda')
            want = acc + xa @ w.T
            w4a16_mma(gu, *args, sym=sym, acc=acc, x_act='silu_and_mul', dtype=torch.bfloat16, zero=z)
            assert _rel(acc, want) < 2e-4 and z.abs().max() == 0, (N, K, group, sym, 'x_act', _rel(acc, want))
            ss = torch.rand(1, device='cuda') * 4 * K  # x_rms: the gate/up sums scaled first
            xa = silu_and_mul_ref(gu * torch.rsqrt(ss / K + 1e-5), interleaved=True).bfloat16().float()
            acc = torch.randn(1, N, device='cuda')
            want = acc + xa @ w.T
            w4a16_mma(gu, *args, sym=sym, acc=acc, x_act='silu_and_mul', dtype=torch.bfloat16, x_rms=(ss, K, 1e-5))
            assert _rel(acc, want) < 2e-4, (N, K, group, sym, 'x_rms', _rel(acc, want))
        for M in (1, 3):  # norm: an fp32 residual times the norm's weight, its squares summed
            res, gw = torch.randn(M, K, device='cuda') * 3, (torch.rand(K, device='cuda') + 0.5).bfloat16()
            ssq = torch.rand(M, 2, device='cuda')
            want_ssq = ssq[:, 0] + res.pow(2).sum(-1)
            acc = torch.randn(M, N, device='cuda')
            want = acc + (res * gw.float()).bfloat16().float() @ w.T
            w4a16_mma(res, *args, sym=sym, acc=acc, norm=(gw, ssq[:, 0]), dtype=torch.bfloat16)
            assert _rel(acc, want) < 2e-4 and _rel(ssq[:, 0], want_ssq) < 1e-5, (N, K, group, sym, M, 'norm')
    assert _ws_clean()


@pytest.mark.cuda
def test_layers_and_quantize_model_cuda():
    "The quantized layers on CUDA agree with their CPU paths; quantize_model packs GGUF types on CUDA."
    from cvllm_lab.layers.basic import Linear
    from cvllm_lab.quant.apply import quantize_model, quantize_linear

    lin = Linear(1024, [512, 256, 256], bias=True)
    torch.nn.init.normal_(lin.weight, std=0.02)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(3, 1024)
    for method in ('w4a16', 'fp8', 'q4k', 'q8_0', 'q4_0', 'q6k', 'q2k'):
        q = quantize_linear(lin, method)
        ref = q(x)
        qc = quantize_linear(lin.cuda(), method, pack=True)
        lin.cpu()
        for M in (1, 3):
            y = qc(x[:M].cuda().bfloat16()).float().cpu()
            tol = 8e-2 if method == 'fp8' and M > 1 else 2e-2  # W8A8: x in e4m3 too, ~4% on random data
            assert _rel(y, ref[:M]) < tol, (method, M, _rel(y, ref[:M]))
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.ModuleDict({'proj': Linear(512, 256)})]).cuda()
    quantize_model(model, 'q4k', progress=False)
    assert model.model.layers[0]['proj'].packed is not None


@pytest.mark.cuda
def test_fuse_mlp_act_cuda():
    "A quantized Llama with the activation in the gate/up GEMV (`fuse_mlp_act=True`) generates what the unfused one does."
    import tempfile
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab import LLM, SamplingParams

    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            architectures=['LlamaForCausalLM'],
        )
    ).save_pretrained(d)
    prompts = [{'prompt_token_ids': list(range(3, 3 + n))} for n in (5, 40)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for method in ('w4a16', 'q4k'):
        outs = []
        for fuse in (False, True):
            llm = LLM(
                d,
                progress=False,
                device='cuda',
                dtype='bfloat16',
                skip_tokenizer_init=True,
                quantization=method,
                kv_cache_memory=64 << 20,
                fuse_mlp_act=fuse,
            )
            assert isinstance(llm.engine.runner.model.model.layers[0].mlp.act, torch.nn.Identity) == fuse
            outs.append(llm.generate(prompts, sp, use_tqdm=False))
        for a, b in zip(*outs):
            la, lb = (
                [lp.logprob for st in a.outputs[0].logprobs for lp in st.values()],
                [lp.logprob for st in b.outputs[0].logprobs for lp in st.values()],
            )
            assert a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4], method
            assert max(abs(x - y) for x, y in zip(la[:4], lb[:4])) < 0.05, method


@pytest.mark.interp
def test_batch_invariant_mode_cpu():
    "Batch-invariant mode (`set_batch_invariant`): no split-K, one row bucket, the batched kernel's rows the same at any M."
    from cvllm_lab.kernels import split_k as S

    cfg, dev = {'split': 4}, torch.device('cpu')
    assert S.split_for(cfg, 16, 1, 1, dev) == 4 and [S.m_bucket(M) for M in (3, 40, 200)] == [16, 64, 128]
    S.set_batch_invariant(True)
    try:
        assert S.batch_invariant() and S.split_for(cfg, 16, 1, 1, dev) == 1
        assert [S.m_bucket(M) for M in (3, 40, 200)] == [16, 16, 16]
        args = _packed(32, 512, 4, 128, False, 11)
        torch.manual_seed(11)
        x = torch.randn(20, 512).half()
        full = w4a16_mm(x, *args)
        for M in (2, 5, 17):
            assert torch.equal(w4a16_mm(x[:M], *args), full[:M]), M
    finally:
        S.set_batch_invariant(False)
    assert not S.batch_invariant() and S.split_for(cfg, 16, 1, 1, dev) == 4
