"""FP8 latent cache (`kv_cache_dtype='fp8'`) for MLA: the cache writes (`concat_and_cache_mla`, `mla_rope_norm_cache`)
and the absorbed decode (`mla_decode`) against their PyTorch references, the references against the dense cache's
quantizer (`kv_cache.quantize_kv_ref`) and a naive fp64 loop over the dequantized rows.

CPU: Triton under TRITON_INTERPRET=1 at small sizes (4 heads, latent 64, rope 16). CUDA (`-m cuda`): V2-Lite's
attention shape (16 heads, latent 512, rope 64), bf16 queries, contexts up to 2k, with and without KV splits.
"""

import pytest
import torch

from cvllm_lab.kernels.kv_cache import FP8_DTYPE, FP8_MAX, quantize_kv_ref
from cvllm_lab.kernels.mla_decode import concat_and_cache_mla, concat_and_cache_mla_ref, mla_decode, mla_decode_ref
from cvllm_lab.kernels.mla_prepare import mla_rope_norm_cache, mla_rope_norm_cache_ref

from test_kernels_mla import TOL, _prepare_case, make_batch, naive_mla


def fp8_cache(num_blocks, block_size, W, device='cpu'):
    return (
        torch.zeros(num_blocks, block_size, W, device=device).to(FP8_DTYPE),
        torch.zeros(num_blocks, block_size, device=device),
    )


def quantized_batch(seq_lens, H, L, R, block_size, dtype, device='cpu'):
    "make_batch's queries and tables, its latent cache quantized row by row (rows of very different magnitudes)."
    qn, qp, cache, sl, bt = make_batch(seq_lens, H, L, R, block_size, torch.float32, device)
    cache = cache * torch.rand(cache.shape[:2], device=device)[..., None] * 10  # per-row ranges differ
    c8, s = quantize_kv_ref(cache.view(-1, 1, L + R))
    return qn.to(dtype), qp.to(dtype), c8.view(cache.shape), s.view(cache.shape[:2]).contiguous(), cache, sl, bt


def test_write_reference_is_the_dense_quantizer():
    "One scale per token row (the whole [c | k_pe]), max|row| / 448, as the dense cache's per-(token, head) rows."
    torch.manual_seed(0)
    c, pe = torch.randn(5, 24) * 3, torch.randn(5, 8)
    slots = torch.tensor([3, -1, 0, 11, 5])
    cache, scale = fp8_cache(3, 4, 32)
    concat_and_cache_mla_ref(c, pe, cache, slots, scale)
    rows8, s = quantize_kv_ref(torch.cat([c, pe], -1)[:, None])
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(cache.view(-1, 32)[slot].view(torch.uint8), rows8[t, 0].view(torch.uint8))
        assert scale.view(-1)[slot] == s[t, 0] == torch.cat([c[t], pe[t]]).abs().max() / FP8_MAX
    deq = cache.view(-1, 32)[slots[slots >= 0]].float() * scale.view(-1)[slots[slots >= 0], None]
    torch.testing.assert_close(deq, torch.cat([c, pe], -1)[slots >= 0], rtol=2**-4, atol=0)  # e4m3: 3 mantissa bits
    assert scale.view(-1)[[1, 2, 4, 6, 7, 8, 9, 10]].abs().sum() == 0


def test_decode_reference_dequantizes():
    torch.manual_seed(1)
    qn, qp, c8, s, _, sl, bt = quantized_batch([1, 7, 33, 16], H=4, L=32, R=8, block_size=4, dtype=torch.float32)
    deq = c8.float() * s[..., None]
    torch.testing.assert_close(
        mla_decode_ref(qn, qp, c8, sl, bt, 0.3, kv_scale=s).double(),
        naive_mla(qn, qp, deq, sl, bt, 0.3),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cache_write_kernel_fp8(dtype):
    torch.manual_seed(2)
    T, L, R = 6, 64, 16
    latent = (torch.randn(T, L + R + 8) * torch.rand(T, 1) * 20).to(dtype)  # strided views, as the layer passes them
    c, pe = latent[:, :L], latent[:, L + 8 :]
    slots = torch.tensor([5, -1, 0, 17, 9, 2])
    (a, sa), (b, sb) = fp8_cache(5, 4, L + R), fp8_cache(5, 4, L + R)
    concat_and_cache_mla(c, pe, a, slots, sa)
    concat_and_cache_mla_ref(c, pe, b, slots, sb)
    assert torch.equal(sa, sb) and sa.view(-1)[slots[slots >= 0]].min() > 0
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('is_neox', [False, True])
def test_rope_norm_cache_kernel_fp8(dtype, is_neox):
    T, H, P, L, R = 7, 4, 16, 64, 16
    q, latent, pos, cs, w, slots, nb = _prepare_case(T, H, P, L, R, dtype, 'cpu')
    q2 = q.clone()
    (a, sa), (b, sb) = fp8_cache(nb, 4, L + R), fp8_cache(nb, 4, L + R)
    mla_rope_norm_cache(q, latent, pos, cs, w, 1e-6, a, slots, P, is_neox, kv_scale=sa)
    mla_rope_norm_cache_ref(q2, latent, pos, cs, w, 1e-6, b, slots, P, is_neox, kv_scale=sb)
    torch.testing.assert_close(q, q2, **TOL[dtype])
    # the kernel quantizes its fp32 norm/RoPE output, the reference rounds it to q's dtype first: scales within
    # fp32's last bits (bf16: one bf16 rounding, 2^-8), values at most one e4m3 step (2^-3 relative) apart
    torch.testing.assert_close(sa, sb, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=0)
    deq = lambda c, s: c.float() * s[..., None]
    torch.testing.assert_close(deq(a, sa), deq(b, sb), rtol=2**-3, atol=1e-6)
    assert (a.view(torch.uint8) != b.view(torch.uint8)).float().mean() < (0.02 if dtype == torch.float32 else 0.2)
    assert sa.view(-1)[slots[slots >= 0]].min() > 0


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('splits', [1, 3])
def test_decode_kernel_fp8(dtype, splits):
    torch.manual_seed(3)
    qn, qp, c8, s, _, sl, bt = quantized_batch([1, 9, 40, 23], H=4, L=64, R=16, block_size=8, dtype=dtype)
    out = mla_decode(qn, qp, c8, sl, bt, 0.2, num_kv_splits=splits, kv_scale=s)
    torch.testing.assert_close(out.float(), mla_decode_ref(qn, qp, c8, sl, bt, 0.2, kv_scale=s).float(), **TOL[dtype])


def test_scales_are_required():
    qn, qp, c8, s, _, sl, bt = quantized_batch([3], H=4, L=32, R=8, block_size=4, dtype=torch.float32)
    with pytest.raises(AssertionError, match='scales'):
        mla_decode_ref(qn, qp, c8, sl, bt, 0.2)
    with pytest.raises(AssertionError, match='scales'):
        concat_and_cache_mla_ref(qn[:, 0], qp[:, 0], c8, sl, s[:1])


@pytest.mark.cuda
@pytest.mark.parametrize('lens', [[1, 300, 2048, 77], [512] * 64])
def test_decode_kernel_fp8_cuda(lens):
    torch.manual_seed(4)
    qn, qp, c8, s, _, sl, bt = quantized_batch(
        lens, H=16, L=512, R=64, block_size=16, dtype=torch.bfloat16, device='cuda'
    )
    for splits in (None, 1):
        out = mla_decode(qn, qp, c8, sl, bt, 0.1, num_kv_splits=splits, kv_scale=s).float()
        ref = mla_decode_ref(qn, qp, c8, sl, bt, 0.1, kv_scale=s).float()
        # bf16 P @ V (the kernel) against fp32 (the reference): a few outputs of 0.5M move by bf16 steps, so the
        # bound is on the whole tensor's relative error and on the largest single difference
        assert (out - ref).norm() / ref.norm() < 5e-3 and ((out - ref).abs() / (ref.abs() + 1)).max() < 0.05


@pytest.mark.cuda
def test_cache_writes_fp8_cuda():
    T, H, P, L, R = 300, 16, 128, 512, 64
    q, latent, pos, cs, w, slots, nb = _prepare_case(T, H, P, L, R, torch.bfloat16, 'cuda')
    (a, sa), (b, sb) = fp8_cache(nb, 4, L + R, 'cuda'), fp8_cache(nb, 4, L + R, 'cuda')
    concat_and_cache_mla(latent[:, :L], latent[:, L:], a, slots, sa)
    concat_and_cache_mla_ref(latent[:, :L], latent[:, L:], b, slots, sb)
    # the GPU's fp32 division may differ from PyTorch's in the last bit of a scale, and move a value to the
    # neighbouring e4m3 code: compare scales to 1e-5 and the dequantized rows to one e4m3 step
    torch.testing.assert_close(sa, sb, rtol=1e-5, atol=0)
    torch.testing.assert_close(a.float() * sa[..., None], b.float() * sb[..., None], rtol=2**-3, atol=1e-6)
    q2 = q.clone()
    mla_rope_norm_cache(q, latent, pos, cs, w, 1e-6, a, slots, P, False, kv_scale=sa)
    mla_rope_norm_cache_ref(q2, latent, pos, cs, w, 1e-6, b, slots, P, False, kv_scale=sb)
    # the kernel takes the row's max in fp32, the reference after rounding the normed row to bf16: one bf16 step
    torch.testing.assert_close(sa, sb, rtol=2**-7, atol=0)
    torch.testing.assert_close(a.float() * sa[..., None], b.float() * sb[..., None], rtol=2**-3 + 2**-7, atol=1e-6)
