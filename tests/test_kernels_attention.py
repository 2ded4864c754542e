"""Paged attention and KV-cache writes (cvllm_lab.kernels.paged_attention) against their PyTorch references.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes; the reference itself against a naive
per-token loop. CUDA (`-m cuda`): real sizes (32 q heads, 8 KV heads, D=128, bf16, contexts up to 8k, batch
64) and a CUDA-graph replay. `python tests/test_kernels_attention.py bench` times decode on a GPU.
"""
import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')  # must be set before the kernels are defined

try:
    from cvllm_lab.kernels import paged_attention as pa
except ImportError:  # package not installed (e.g. a bare GPU box): import the kernels folder itself
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from kernels import paged_attention as pa
paged_attention, paged_attention_ref = pa.paged_attention, pa.paged_attention_ref
reshape_and_cache, reshape_and_cache_ref = pa.reshape_and_cache, pa.reshape_and_cache_ref

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def cuda(f):
    "Real-size test: needs a CUDA GPU (select with `-m cuda`)."
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')(f))

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(q_lens, ctx_lens, H, Hkv, D, block_size, dtype, device=DEV, extra_blocks=3):
    """Random paged batch: sequence b has `ctx_lens[b]` cached tokens then `q_lens[b]` new ones, its blocks a
    random permutation of the pool (the block table is padded with garbage block ids past the end)."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    width = max(nblk) + 1
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks)
    bt = torch.randint(0, num_blocks, (len(q_lens), width), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    q = torch.randn(sum(q_lens), H, D, device=device).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return [q, k_cache, v_cache] + [t.to(device) for t in (qsl, sl, bt)]


def naive_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale, window=None):
    "Token by token: gather the visible keys through the block table, softmax in fp64."
    T, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for b in range(len(seq_lens)):
        s, e, L = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        for i in range(s, e):
            pos = L - (e - s) + (i - s)
            keys = [j for j in range(pos + 1) if window is None or j > pos - window]
            blk = [int(block_tables[b, j // bs]) for j in keys]
            k = torch.stack([k_cache[p, j % bs] for p, j in zip(blk, keys)]).double()  # [n, Hkv, D]
            v = torch.stack([v_cache[p, j % bs] for p, j in zip(blk, keys)]).double()
            kh = k.repeat_interleave(H // Hkv, 1)
            vh = v.repeat_interleave(H // Hkv, 1)
            w = torch.softmax(torch.einsum('hd,nhd->hn', q[i].double(), kh) * scale, -1)
            out[i] = torch.einsum('hn,nhd->hd', w, vh)
    return out


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# ------------------------------------------------------------------------------------------------ reshape_and_cache

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_reshape_and_cache(dtype):
    torch.manual_seed(0)
    nb, bs, Hkv, D, T = 6, 16, 2, 64, 20
    k_cache, v_cache = torch.randn(2, nb, bs, Hkv, D, device=DEV).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[[3, 11]] = -1  # padded tokens
    kv = torch.randn(T, 2 * Hkv + 3, D, device=DEV).to(dtype)  # key/value: strided views of a bigger tensor
    key, value = kv[:, :Hkv], kv[:, Hkv + 3:]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_ref.view(nb * bs, Hkv, D)[slots[0]], key[0])
    # fp32 activations into a bf16 cache: converted on the way (the interpreter rounds toward zero: 1 ulp)
    k32, v32 = torch.randn(2, T, Hkv, D, device=DEV)
    reshape_and_cache(k32, v32, k_cache, v_cache, slots)
    reshape_and_cache_ref(k32, v32, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 0, atol=0)
    torch.testing.assert_close(v_cache.float(), v_ref.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 0, atol=0)


# ------------------------------------------------------------------------------------------------ reference itself

@pytest.mark.parametrize('window', [None, 7])
def test_reference_matches_naive_loop(window, monkeypatch):
    torch.manual_seed(1)
    monkeypatch.setattr(pa, 'REF_SCORE_BUDGET', 4 * 30)  # tiny query chunks: exercise the chunked path too
    # decode, prefill from scratch, chunked prefill over a cached prefix, a 1-token-context decode
    args = make_batch([1, 9, 5, 1, 3], [20, 0, 13, 0, 30], H=4, Hkv=2, D=16, block_size=4,
                      dtype=torch.float32, device='cpu')
    ref = paged_attention_ref(*args, scale=0.25, sliding_window=window)
    naive = naive_attention(*args, scale=0.25, window=window)
    assert (ref.double() - naive).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------ paged_attention

@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize('H,Hkv,D,bs', [(4, 1, 64, 16), (6, 2, 128, 32), (2, 2, 32, 16)])
def test_mixed_batch(dtype, H, Hkv, D, bs):
    "Prefill, chunked prefill over a cached prefix and decode tokens in one varlen batch."
    torch.manual_seed(2)
    args = make_batch([37, 1, 20, 1, 70], [0, 45, 33, 3, 17], H, Hkv, D, bs, dtype)
    out = paged_attention(*args, scale=D ** -0.5)
    assert_close(out, paged_attention_ref(*args, scale=D ** -0.5), dtype)


@pytest.mark.parametrize('window', [5, 40])
def test_sliding_window(window):
    torch.manual_seed(3)
    args = make_batch([30, 1, 12], [50, 90, 0], 4, 2, 32, 16, torch.float32)
    ref = paged_attention_ref(*args, scale=0.2, sliding_window=window)
    assert_close(paged_attention(*args, scale=0.2, sliding_window=window), ref, torch.float32)
    dec = make_batch([1, 1, 1], [50, 90, 3], 4, 2, 32, 16, torch.float32)
    ref = paged_attention_ref(*dec, scale=0.2, sliding_window=window)
    assert_close(paged_attention(*dec, scale=0.2, sliding_window=window, num_kv_splits=3), ref, torch.float32)


@pytest.mark.parametrize('splits', [1, 3, 8])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_decode_split_kv(splits, dtype):
    "Flash-decoding: the keys split over programs (more splits than key tiles leaves some empty) + merge."
    torch.manual_seed(4)
    args = make_batch([1] * 4, [0, 130, 300, 64], 8, 2, 64, 16, dtype)
    out = paged_attention(*args, scale=0.125, num_kv_splits=splits, max_seq_len=512)
    assert_close(out, paged_attention_ref(*args, scale=0.125), dtype)


def test_decode_non_power_of_two_group_and_short_queries():
    "G = 3 query heads per KV head; queries of up to 4 tokens (speculative decode) take the split-KV path."
    torch.manual_seed(5)
    args = make_batch([1, 4, 2, 3], [70, 20, 0, 150], 6, 2, 64, 16, torch.float32)
    out = paged_attention(*args, scale=0.125, num_kv_splits=2, max_query_len=4)
    assert_close(out, paged_attention_ref(*args, scale=0.125), torch.float32)


def test_strided_q_and_out_buffer():
    "q as a view into a fused qkv projection; the result written into a caller's (strided) buffer."
    torch.manual_seed(6)
    q, kc, vc, qsl, sl, bt = make_batch([9, 1], [5, 40], 4, 2, 32, 16, torch.float32)
    qkv = torch.randn(q.shape[0], 8, 32, device=DEV)
    qkv[:, :4] = q
    buf = torch.zeros(q.shape[0], 6, 32, device=DEV)
    out = paged_attention(qkv[:, :4], kc, vc, qsl, sl, bt, scale=0.3, out=buf[:, 1:5])
    ref = paged_attention_ref(q, kc, vc, qsl, sl, bt, scale=0.3)
    assert out.data_ptr() == buf[:, 1:5].data_ptr()
    assert_close(buf[:, 1:5], ref, torch.float32)
    assert (buf[:, 0] == 0).all() and (buf[:, 5] == 0).all()


# ------------------------------------------------------------------------------------------------ CUDA, real sizes

@cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('bs', [16, 32])
def test_cuda_decode_real_sizes(dtype, bs):
    torch.manual_seed(10)
    B = 64
    ctx = torch.randint(1, 8192, (B,)).tolist()
    args = make_batch([1] * B, ctx, 32, 8, 128, bs, dtype)
    out = paged_attention(*args, scale=128 ** -0.5, max_seq_len=8192)
    assert_close(out, paged_attention_ref(*args, scale=128 ** -0.5), dtype)
    # few long sequences: many KV splits
    args = make_batch([1, 1], [8000, 3000], 32, 8, 128, bs, dtype)
    out = paged_attention(*args, scale=128 ** -0.5, max_seq_len=8192)
    assert_close(out, paged_attention_ref(*args, scale=128 ** -0.5), dtype)


@cuda
@pytest.mark.parametrize('dtype,D', [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128)])
def test_cuda_prefill_real_sizes(dtype, D):
    "Long prefill, chunked prefill behind a long cached prefix, and decodes, in one batch."
    torch.manual_seed(11)
    args = make_batch([4096, 1, 512, 1, 2000, 1], [0, 7000, 6000, 100, 0, 1], 32, 8, D, 16, dtype)
    out = paged_attention(*args, scale=D ** -0.5)
    assert_close(out, paged_attention_ref(*args, scale=D ** -0.5), dtype)
    out = paged_attention(*args, scale=D ** -0.5, sliding_window=1024)
    assert_close(out, paged_attention_ref(*args, scale=D ** -0.5, sliding_window=1024), dtype)


@cuda
def test_cuda_graph_decode_replay():
    "Capture decode once with static max_seq_len; replay with new lengths and queries written into the inputs."
    torch.manual_seed(12)
    B, H, Hkv, D, bs, max_len = 8, 32, 8, 128, 16, 4096
    q, kc, vc, qsl, sl, bt = make_batch([1] * B, [max_len - 1] * B, H, Hkv, D, bs, torch.bfloat16)
    run = lambda: paged_attention(q, kc, vc, qsl, sl, bt, scale=D ** -0.5, max_query_len=1, max_seq_len=max_len)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for _ in range(3):
        sl.copy_(torch.randint(1, max_len + 1, (B,), dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_attention_ref(q, kc, vc, qsl, sl, bt, scale=D ** -0.5), torch.bfloat16)


def _median_us(f, reps):
    "Median over `reps` runs of the GPU time between two CUDA events around `f()`, in microseconds."
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[reps // 2]


def bench_decode(batches=(1, 16, 64), contexts=(1024, 2048, 4096), reps=20):
    """Decode `paged_attention` at the 8B shape (32 q heads, 8 KV heads, D=128, bf16, block 16): median of
    `reps` timed calls after warm-up, launched eagerly and replayed from a CUDA graph; GB/s counts K+V reads."""
    H, Hkv, D, bs = 32, 8, 128, 16
    print(f'{"batch":>5} {"ctx":>5} {"splits":>6} {"eager us":>9} {"graph us":>9} {"GB/s":>6}')
    for B in batches:
        for L in contexts:
            torch.manual_seed(0)
            q, kc, vc, qsl, sl, bt = make_batch([1] * B, [L - 1] * B, H, Hkv, D, bs, torch.bfloat16, extra_blocks=0)
            out = torch.empty_like(q)
            f = lambda: paged_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, max_query_len=1, max_seq_len=L, out=out)
            for _ in range(3): f()
            torch.cuda.synchronize()
            eager = _median_us(f, reps)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g): f()
            graph = _median_us(g.replay, reps)
            gbs = 2 * B * L * Hkv * D * 2 / graph / 1e3
            splits = pa._default_num_splits(q, B, Hkv, L)
            print(f'{B:>5} {L:>5} {splits:>6} {eager:>9.1f} {graph:>9.1f} {gbs:>6.0f}')


if __name__ == '__main__' and sys.argv[1:] == ['bench']:
    bench_decode()
