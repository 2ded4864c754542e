"""Batch-invariant mode's GPU kernels (`EngineConfig.batch_invariant`): each row of a call's output is the same
whatever else is in the call. Under the Triton interpreter at small sizes (`interp`), and on a GPU (`cuda`) at a
model's shapes, where cuBLAS's rows do depend on M (asserted, so the test shows what the mode fixes)."""

import pytest
import torch

from cvllm_lab.kernels import split_k
from cvllm_lab.kernels.batch_invariant import linear
from cvllm_lab.kernels.matmul_invariant import matmul_invariant, matmul_invariant_ref


@pytest.fixture
def invariant():
    split_k.set_batch_invariant(True)
    yield
    split_k.set_batch_invariant(False)


def _rows_same_at_every_m(f, n, ms):
    "`f(rows)` (a slice of n rows) for all n rows, then for the first m and for 3 rows at m - 1: the same rows."
    full = f(slice(0, n))
    for m in ms:
        assert torch.equal(f(slice(0, m)), full[:m]), m
        assert torch.equal(f(slice(m - 1, m + 2)), full[m - 1 : m + 2]), m  # rows at another offset in the tile
    return full


@pytest.mark.interp
@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_matmul_invariant_interp(dtype, tol):
    g = torch.Generator().manual_seed(3)
    M, N, K = 70, 80, 96  # a partial row block, column block and K step
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    y = _rows_same_at_every_m(lambda r: matmul_invariant(x[r], w, b), M, (1, 5, 17, 64, 65))
    ref = matmul_invariant_ref(x, w, b)
    assert (y.float() - ref.float()).abs().max().item() < tol * ref.float().abs().max().item()
    assert matmul_invariant(x[:0], w).shape == (0, N)
    assert matmul_invariant(x.reshape(2, 35, K), w, b).shape == (2, 35, N)


@pytest.mark.interp
def test_linear_dispatch_cpu(invariant):
    "Off CUDA, `linear` is `F.linear` even in batch-invariant mode (the CPU fast path has its own invariant kernels)."
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_matmul_invariant_gpu(invariant):
    g = torch.Generator(device='cuda').manual_seed(0)
    x = torch.randn(300, 4096, device='cuda', dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16, generator=g) / 64
    y = _rows_same_at_every_m(lambda r: linear(x[r], w), len(x), (1, 2, 7, 33, 129))
    ref = matmul_invariant_ref(x, w)
    assert (y.float() - ref.float()).abs().max().item() < 0.02 * ref.float().abs().max().item()


@pytest.mark.interp
@pytest.mark.parametrize('act', [None, 'silu_and_mul'])
def test_w4a16_matmul_invariant_interp(invariant, act):
    "W4A16 in batch-invariant mode: the `tl.dot` kernel at every M (no GEMV / MMA at one row), its rows the same."
    from cvllm_lab.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
    from cvllm_lab.quant.w4a16 import W4A16Linear

    N, K = 64, 256
    g = torch.Generator().manual_seed(5)
    m = W4A16Linear.from_float(torch.randn(N, K, generator=g) * 0.05, 128, 4, False)
    args = (m.qweight, m.scales, m.offsets, 4, m.group, N, K)
    x = torch.randn(20, K, generator=g).half()
    y = _rows_same_at_every_m(lambda r: w4a16_matmul(x[r], *args, act=act), len(x), (1, 2, 9, 17))
    if act is None:
        ref = w4a16_matmul_ref(x, *args)
        assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()


@pytest.mark.interp
@pytest.mark.parametrize('layout', ['block', 'channel'])
def test_fp8_matmul_invariant_interp(invariant, layout):
    "FP8 in batch-invariant mode: `fp8_mm` (block scales) or the dequantized weight in `matmul_invariant` (channel)."
    from cvllm_lab.quant.fp8 import quantize_fp8_block, quantize_fp8_channel
    from cvllm_lab.kernels.fp8_matmul import fp8_matmul, fp8_matmul_ref

    N, K = 128, 256
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g) * 0.05
    w, s = quantize_fp8_block(w) if layout == 'block' else quantize_fp8_channel(w)
    x = torch.randn(20, K, generator=g).half()
    y = _rows_same_at_every_m(lambda r: fp8_matmul(x[r], w, s, N, K), len(x), (1, 2, 9, 17))
    ref = fp8_matmul_ref(x, w, s, N, K)
    assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()


def _paged_call(seqs, kc, vc, window):
    "`seqs`: (q rows, seq_len, block table row) per sequence -> each sequence's output rows."
    from cvllm_lab.kernels.paged_attention import paged_attention

    q = torch.cat([s[0] for s in seqs])
    qsl = torch.tensor([0] + [len(s[0]) for s in seqs]).cumsum(0).int()
    sl = torch.tensor([s[1] for s in seqs], dtype=torch.int32)
    width = max(len(s[2]) for s in seqs)
    bt = torch.stack([torch.nn.functional.pad(s[2], (0, width - len(s[2]))) for s in seqs]).int()
    out = paged_attention(q, kc, vc, qsl, sl, bt, 0.125, sliding_window=window)
    return out.split([len(s[0]) for s in seqs])


@pytest.mark.interp
@pytest.mark.parametrize('window', [None, 40])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_paged_attention_invariant_interp(invariant, window, dtype):
    """A sequence's last rows attend alike decoded one at a time, as one prefill chunk, or beside other sequences
    (a decode, a long prefill): the one-pass path, tile-aligned key ranges, no split-KV by batch size."""
    g = torch.Generator().manual_seed(7)
    H, Hkv, D, page = 4, 2, 64, 16
    kc = torch.randn(64, page, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(64, page, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(64, generator=g)
    S, x, y = perm[:19], perm[19:22], perm[22:40]  # block tables: 300 tokens, 40, 280
    qs = torch.randn(10, H, D, generator=g).to(dtype)  # S's queries at positions 290..299
    chunk = _paged_call([(qs, 300, S)], kc, vc, window)[0]
    decode = _paged_call([(qs[9:], 300, S)], kc, vc, window)[0]
    short = _paged_call([(qs[7:], 300, S)], kc, vc, window)[0]
    mixed = _paged_call(
        [
            (torch.randn(1, H, D, generator=g).to(dtype), 40, x),
            (qs[9:], 300, S),
            (torch.randn(40, H, D, generator=g).to(dtype), 280, y),
        ],
        kc,
        vc,
        window,
    )[1]
    assert torch.equal(decode, chunk[9:]) and torch.equal(short, chunk[7:]) and torch.equal(mixed, chunk[9:])


@pytest.mark.interp
def test_fused_moe_invariant_interp(invariant):
    "Fused MoE in batch-invariant mode: one config at every token count, no decode GEMVs or atomic adds."
    from cvllm_lab.kernels.fused_moe import fused_moe, fused_moe_ref, get_config

    assert get_config(1, 8, 64, 32, 2) == get_config(300, 8, 64, 32, 2)
    assert 'decode' not in get_config(1, 8, 64, 32, 2) and not get_config(1, 8, 64, 32, 2)['ATOMIC']
    g = torch.Generator().manual_seed(8)
    T, E, H, I, k = 12, 8, 64, 32, 2
    x = torch.randn(T, H, generator=g).half()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).half()
    w2 = (torch.randn(E, H, I, generator=g) / 6).half()
    tw = torch.rand(T, k, generator=g).half()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    y = _rows_same_at_every_m(lambda r: fused_moe(x[r], w13, w2, tw[r], ids[r]), T, (1, 2, 5, 9))
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()


@pytest.mark.interp
def test_gguf_matmul_invariant_interp(invariant):
    "GGUF weights in batch-invariant mode: `gguf_mm` without split-K at every M (no GEMV for the first 4 rows)."
    from cvllm_lab.kernels.gguf_layout import parse_qtype
    from cvllm_lab.kernels.gguf_matmul import gguf_matmul, gguf_matmul_ref
    from cvllm_lab.quant.gguf import random_blocks

    t, N, K = parse_qtype('q4k'), 32, 256
    w = random_blocks(t, N, K, generator=torch.Generator().manual_seed(9))
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(10)).half()
    y = _rows_same_at_every_m(lambda r: gguf_matmul(x[r], w, t, N, K), len(x), (1, 2, 5, 9))
    ref = gguf_matmul_ref(x, w, t, N, K)
    assert (y.float() - ref.float()).abs().max().item() < 1e-2 * ref.float().abs().max().item()
