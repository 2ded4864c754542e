"""MLA kernels (cvllm_lab.kernels.mla_decode) against their PyTorch references, and the references against a
naive per-sequence loop in fp64.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes (4 heads, latent 64, rope 16). CUDA (`-m cuda`):
DeepSeek-V2-Lite's attention shape (16 heads, latent 512, rope 64) and V3's head count (128), bf16, contexts up to
4k, batch 64, with and without KV splits, and a CUDA-graph replay.
"""

import pytest
import torch

from cvllm_lab.kernels.mla_decode import concat_and_cache_mla, concat_and_cache_mla_ref, mla_decode, mla_decode_ref

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_batch(seq_lens, H, L, R, block_size, dtype, device=DEV, extra_blocks=3):
    "Random queries and a latent cache whose blocks are a random permutation of the pool (tables padded with garbage ids)."
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks)
    bt = torch.randint(0, num_blocks, (len(seq_lens), max(nblk) + 1), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used : used + n].int()
        used += n
    cache = torch.randn(num_blocks, block_size, L + R, device=device).to(dtype)
    qn = torch.randn(len(seq_lens), H, L, device=device).to(dtype)
    qp = torch.randn(len(seq_lens), H, R, device=device).to(dtype)
    return qn, qp, cache, torch.tensor(seq_lens, dtype=torch.int32, device=device), bt.to(device)


def naive_mla(qn, qp, cache, seq_lens, bt, scale):
    "Sequence by sequence in fp64: gather the rows through the block table, softmax, weighted sum of the latents."
    B, H, L = qn.shape
    bs = cache.shape[1]
    out = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        rows = torch.stack([cache[int(bt[b, j // bs]), j % bs] for j in range(n)]).double().cpu()
        q = torch.cat([qn[b], qp[b]], -1).double().cpu()
        out[b] = ((q @ rows.T) * scale).softmax(-1) @ rows[:, :L]
    return out


def test_reference_matches_naive():
    torch.manual_seed(0)
    qn, qp, cache, sl, bt = make_batch([1, 7, 33, 16], H=4, L=32, R=8, block_size=4, dtype=torch.float32, device='cpu')
    torch.testing.assert_close(
        mla_decode_ref(qn, qp, cache, sl, bt, 0.3).double(), naive_mla(qn, qp, cache, sl, bt, 0.3), atol=1e-5, rtol=1e-5
    )


def test_cache_write_reference():
    torch.manual_seed(0)
    cache = torch.zeros(3, 4, 10)
    c, pe = torch.randn(5, 8), torch.randn(5, 2)
    slots = torch.tensor([3, -1, 0, 11, 5])
    concat_and_cache_mla_ref(c, pe, cache, slots)
    flat = cache.view(-1, 10)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat[s], torch.cat([c[t], pe[t]]))
    assert flat[[1, 2, 4, 6, 7, 8, 9, 10]].abs().sum() == 0  # the skipped row and untouched slots stay zero


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cache_write_kernel(dtype):
    torch.manual_seed(1)
    T, L, R = 6, 64, 16
    latent = torch.randn(T, L + R + 8).to(dtype)  # strided views, as the layer passes them
    c, pe = latent[:, :L], latent[:, L + 8 :]
    slots = torch.tensor([5, -1, 0, 17, 9, 2])
    a, b = torch.zeros(5, 4, L + R, dtype=dtype), torch.zeros(5, 4, L + R, dtype=dtype)
    concat_and_cache_mla(c, pe, a, slots)
    concat_and_cache_mla_ref(c, pe, b, slots)
    assert torch.equal(a, b)


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('splits', [1, 3])
def test_decode_kernel_interpreter(dtype, splits):
    torch.manual_seed(2)
    qn, qp, cache, sl, bt = make_batch([1, 9, 40, 23], H=4, L=64, R=16, block_size=8, dtype=dtype, device='cpu')
    out = mla_decode(qn, qp, cache, sl, bt, 0.2, num_kv_splits=splits)
    torch.testing.assert_close(out.float(), mla_decode_ref(qn, qp, cache, sl, bt, 0.2).float(), **TOL[dtype])


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_decode_kernel_idle_splits(dtype):
    """A loose max_seq_len bound (as under CUDA graphs): 7 splits from the bound, but at least 2 tiles per split, so
    short sequences leave later splits idle (no acc written, skipped by the merge)."""
    torch.manual_seed(4)
    qn, qp, cache, sl, bt = make_batch([1, 9, 40, 23], H=4, L=64, R=16, block_size=8, dtype=dtype, device='cpu')
    cfg = dict(tile_n=16, num_warps=4, num_stages=1, min_keys=32, waves=4)
    from cvllm_lab.kernels.mla_decode import _num_splits

    assert _num_splits(qn, 4, 1, 200, cfg) == 7
    out = mla_decode(qn, qp, cache, sl, bt, 0.2, max_seq_len=200, config=cfg)
    torch.testing.assert_close(out.float(), mla_decode_ref(qn, qp, cache, sl, bt, 0.2).float(), **TOL[dtype])


@pytest.mark.interp
def test_decode_kernel_strided_query_and_many_heads():
    "Head blocks (H=20 > 16) and a query that is a view into a wider tensor, as the layer's absorbed query is."
    torch.manual_seed(3)
    qn, _, cache, sl, bt = make_batch([5, 30], H=20, L=64, R=16, block_size=4, dtype=torch.float32, device='cpu')
    wide = torch.randn(2, 20, 80)
    qn, qp = wide[..., :64], wide[..., 64:]
    torch.testing.assert_close(
        mla_decode(qn, qp, cache, sl, bt, 0.2, num_kv_splits=2),
        mla_decode_ref(qn, qp, cache, sl, bt, 0.2),
        **TOL[torch.float32],
    )


# ---------------------------------------------------------------------------------------------------------------
# GPU, real sizes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize('H', [16, 128])
@pytest.mark.parametrize('lens', [[1, 17, 300, 4096], [513] * 64])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_decode_kernel_cuda(H, lens, dtype):
    torch.manual_seed(4)
    qn, qp, cache, sl, bt = make_batch(lens, H=H, L=512, R=64, block_size=16, dtype=dtype)
    scale = 192**-0.5
    ref = mla_decode_ref(qn, qp, cache, sl, bt, scale).float()
    for splits in (None, 1):
        torch.testing.assert_close(
            mla_decode(qn, qp, cache, sl, bt, scale, num_kv_splits=splits).float(), ref, **TOL[dtype]
        )


@pytest.mark.cuda
def test_cache_write_cuda():
    torch.manual_seed(5)
    T = 300
    latent = torch.randn(T, 576, device='cuda', dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device='cuda')[:T]
    slots[::7] = -1
    a = torch.zeros(64, 16, 576, device='cuda', dtype=torch.bfloat16)
    b = a.clone()
    concat_and_cache_mla(latent[:, :512], latent[:, 512:], a, slots)
    concat_and_cache_mla_ref(latent[:, :512], latent[:, 512:], b, slots)
    assert torch.equal(a, b)


@pytest.mark.cuda
def test_decode_kernel_cuda_graph():
    "Captured once at a max_seq_len bound, replayed with new lengths (within the tables) and queries: equals the reference."
    torch.manual_seed(6)
    qn, qp, cache, sl, bt = make_batch([100, 2000, 7, 900], H=16, L=512, R=64, block_size=16, dtype=torch.bfloat16)
    out = torch.empty_like(qn)
    mla_decode(qn, qp, cache, sl, bt, 0.1, max_seq_len=4096, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_decode(qn, qp, cache, sl, bt, 0.1, max_seq_len=4096, out=out)
    sl.copy_(torch.tensor([1800, 5, 64, 1], dtype=torch.int32))
    qn.copy_(torch.randn_like(qn))
    g.replay()
    torch.testing.assert_close(out.float(), mla_decode_ref(qn, qp, cache, sl, bt, 0.1).float(), **TOL[torch.bfloat16])


# ------------------------------------------------------------------------------------------- mla_rope_norm_cache


def _prepare_case(T, H, P, L, R, dtype, device, positions_max=4096):
    "Unrotated q, latent rows inside a wider projection output (strided, as the layer passes them), a cos/sin cache."
    g = torch.Generator(device='cpu').manual_seed(T + H)
    q = torch.randn(T, H, P + R, generator=g).to(dtype).to(device)
    latent = torch.randn(T, L + R + 8, generator=g).to(dtype).to(device)[:, 8:]
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
    ang = torch.arange(positions_max).float()[:, None] * inv[None]
    cs = torch.cat([ang.cos(), ang.sin()], -1).to(device)
    pos = torch.randint(0, positions_max, (T,), generator=g).to(device)
    w = (1 + 0.3 * torch.randn(L, generator=g)).to(dtype).to(device)
    nb = -(-T // 4) + 2
    slots = torch.randperm(nb * 4, generator=g)[:T].to(device)
    slots[T // 2] = -1  # a padding row: rotated q, no cache write
    return q, latent, pos, cs, w, slots, nb


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('is_neox', [False, True])
def test_rope_norm_cache_kernel(dtype, is_neox):
    from cvllm_lab.kernels.mla_prepare import mla_rope_norm_cache, mla_rope_norm_cache_ref

    T, H, P, L, R = 7, 4, 16, 64, 16
    q, latent, pos, cs, w, slots, nb = _prepare_case(T, H, P, L, R, dtype, 'cpu')
    q2 = q.clone()
    a, b = torch.zeros(nb, 4, L + R, dtype=dtype), torch.zeros(nb, 4, L + R, dtype=dtype)
    mla_rope_norm_cache(q, latent, pos, cs, w, 1e-6, a, slots, P, is_neox)
    mla_rope_norm_cache_ref(q2, latent, pos, cs, w, 1e-6, b, slots, P, is_neox)
    torch.testing.assert_close(q, q2, **TOL[dtype])
    torch.testing.assert_close(a, b, **TOL[dtype])
    assert not torch.equal(q[..., P:], _prepare_case(T, H, P, L, R, dtype, 'cpu')[0][..., P:])  # it did rotate
    assert a.view(-1, L + R)[slots[slots >= 0]].abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.parametrize('H', [16, 128])
def test_rope_norm_cache_cuda(H):
    from cvllm_lab.kernels.mla_prepare import mla_rope_norm_cache, mla_rope_norm_cache_ref

    T, P, L, R = 300, 128, 512, 64
    for is_neox in (False, True):
        q, latent, pos, cs, w, slots, nb = _prepare_case(T, H, P, L, R, torch.bfloat16, 'cuda')
        q2 = q.clone()
        a, b = (
            torch.zeros(nb, 4, L + R, dtype=q.dtype, device='cuda'),
            torch.zeros(nb, 4, L + R, dtype=q.dtype, device='cuda'),
        )
        mla_rope_norm_cache(q, latent, pos, cs, w, 1e-6, a, slots, P, is_neox)
        mla_rope_norm_cache_ref(q2, latent, pos, cs, w, 1e-6, b, slots, P, is_neox)
        torch.testing.assert_close(q, q2, **TOL[torch.bfloat16])
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
