"""Paged attention and KV-cache writes (cvllm_lab.kernels.paged_attention) against their PyTorch references.

CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes; the reference itself against a naive
per-token loop. CUDA (`-m cuda`): real sizes (32 q heads, 8 KV heads, D=128, bf16, contexts up to 8k, batch
64) and a CUDA-graph replay. `python -m benchmarks.kernels.bench_attention` times decode on a GPU.

FP8 KV cache (float8_e4m3fn rows, one fp32 scale per token and KV head): the write kernel equals the reference
bit for bit; attention over an FP8 cache is checked tightly against the fp32 reference on the dequantized cache
(the dtype's usual tolerance) and loosely against attention over the unquantized K/V (FP8_LOOSE below).
"""

import pytest
import torch

from cvllm_lab.kernels import paged_attention as pa, paged_attention_kernel as pak
from cvllm_lab.kernels.kv_cache import SCALE_MIN

paged_attention, paged_attention_ref = pa.paged_attention, pa.paged_attention_ref
reshape_and_cache, reshape_and_cache_ref = pa.reshape_and_cache, pa.reshape_and_cache_ref

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


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
        bt[b, :n] = perm[used : used + n].int()
        used += n
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    q = torch.randn(sum(q_lens), H, D, device=device).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return [q, k_cache, v_cache] + [t.to(device) for t in (qsl, sl, bt)]


def naive_attention(
    q, k_cache, v_cache, qsl, seq_lens, block_tables, scale, window=None, softcap=None, sinks=None, chunk=None
):
    """Token by token: gather the visible keys through the block table, softmax in fp64 (scores soft-capped first;
    `sinks` `[H]`: one more logit per head in the softmax, its probability dropped; `chunk`: keys of the query's own
    chunk of `chunk` positions only)."""
    T, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for b in range(len(seq_lens)):
        s, e, L = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        for i in range(s, e):
            pos = L - (e - s) + (i - s)
            keys = [
                j
                for j in range(pos + 1)
                if (window is None or j > pos - window) and (chunk is None or j // chunk == pos // chunk)
            ]
            blk = [int(block_tables[b, j // bs]) for j in keys]
            k = torch.stack([k_cache[p, j % bs] for p, j in zip(blk, keys)]).double()  # [n, Hkv, D]
            v = torch.stack([v_cache[p, j % bs] for p, j in zip(blk, keys)]).double()
            kh = k.repeat_interleave(H // Hkv, 1)
            vh = v.repeat_interleave(H // Hkv, 1)
            sc = torch.einsum('hd,nhd->hn', q[i].double(), kh) * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            if sinks is not None:
                w = torch.softmax(torch.cat([sc, sinks.double()[:, None]], -1), -1)[:, :-1]
            else:
                w = torch.softmax(sc, -1)
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
    key, value = kv[:, :Hkv], kv[:, Hkv + 3 :]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_ref.view(nb * bs, Hkv, D)[slots[0]], key[0])
    # fp32 activations into a bf16 cache: converted on the way (the interpreter rounds toward zero: 1 ulp)
    k32, v32 = torch.randn(2, T, Hkv, D, device=DEV)
    reshape_and_cache(k32, v32, k_cache, v_cache, slots)
    reshape_and_cache_ref(k32, v32, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 0, atol=0)
    torch.testing.assert_close(v_cache.float(), v_ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 0, atol=0)


# ------------------------------------------------------------------------------------------------ rotary_and_cache


@pytest.mark.parametrize('is_neox,rot_dim', [(True, 64), (False, 64), (True, 32), (False, 48)])
@pytest.mark.parametrize('kv', ['auto', 'fp8'])
def test_rotary_and_cache(is_neox, rot_dim, kv):
    "The rotary embedding fused with the cache write equals apply_rotary_ref + reshape_and_cache_ref (partial rotary, GPT-J pairs, FP8)."
    torch.manual_seed(rot_dim + is_neox)
    nb, bs, H, Hkv, D, T, dtype = 6, 16, 4, 2, 64, 20, torch.float32
    qkv = torch.randn(T, H + 2 * Hkv, D, device=DEV, dtype=dtype)
    q, key, value = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]  # strided views, as the model's split gives
    pos = torch.randint(0, 500, (T,), device=DEV)
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim)
    f = torch.arange(512, device=DEV).float()[:, None] * inv
    cs = torch.cat([f.cos(), f.sin()], -1)
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[[2, 9]] = -1
    cdt = FP8 if kv == 'fp8' else dtype
    caches = [torch.zeros(nb, bs, Hkv, D, device=DEV, dtype=cdt) for _ in range(4)]
    scales = [torch.zeros(nb, bs, Hkv, device=DEV) for _ in range(4)] if kv == 'fp8' else [None] * 4
    key0 = key.clone()
    k_outs = [torch.full((T, Hkv, D), 7.0, device=DEV, dtype=dtype) for _ in range(2)]  # the rotated keys, if asked for
    qr = pa.rotary_and_cache_ref(
        q.clone(), key, value, pos, cs, D, is_neox, caches[2], caches[3], slots, scales[2], scales[3], k_out=k_outs[1]
    )
    got = pa.rotary_and_cache(
        q, key, value, pos, cs, D, is_neox, caches[0], caches[1], slots, scales[0], scales[1], k_out=k_outs[0]
    )
    assert got.data_ptr() == q.data_ptr() and torch.equal(key, key0)  # q in place, k untouched
    torch.testing.assert_close(q, qr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_outs[0], k_outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(k_outs[0][..., :rot_dim], key[..., :rot_dim])  # rotated, slot or not
    if kv == 'fp8':
        for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert fp8_ulps(a, b).max() <= 1
        for a, b in ((scales[0], scales[2]), (scales[1], scales[3])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    else:
        for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    keep = slots >= 0
    if kv == 'auto':  # the rotated key really is in the cache (not the raw one), the tail dims unrotated
        rows = caches[0].view(-1, Hkv, D)[slots[keep]]
        assert not torch.allclose(rows[..., :rot_dim], key[keep][..., :rot_dim])
        torch.testing.assert_close(rows[..., rot_dim:], key[keep][..., rot_dim:])


@pytest.mark.parametrize('is_neox,rot_dim', [(True, 64), (False, 48)])
@pytest.mark.parametrize('kv', ['auto', 'fp8'])
@pytest.mark.parametrize('rms', [False, True], ids=['sums', 'sums-rms'])
def test_rotary_and_cache_fp32_sums(is_neox, rot_dim, kv, rms):
    """q, k, v as fp32 sums (the fp32 residual stream's QKV projection) with `q_out` in bf16: q is only read, the
    rotated q lands in `q_out`, k and v are rounded as they are written; against the reference on the same sums.
    `rms`: the sums scaled per token by `rsqrt(ssq / n + eps)` (an input norm's 1/rms, applied here)."""
    torch.manual_seed(rot_dim)
    nb, bs, H, Hkv, D, T = 4, 16, 4, 2, 64, 3
    qkv = torch.randn(T, H + 2 * Hkv, D, device=DEV)
    q, key, value = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
    pos = torch.randint(0, 500, (T,), device=DEV)
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim)
    f = torch.arange(512, device=DEV).float()[:, None] * inv
    cs = torch.cat([f.cos(), f.sin()], -1)
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    cdt = FP8 if kv == 'fp8' else torch.bfloat16
    caches = [torch.zeros(nb, bs, Hkv, D, device=DEV, dtype=cdt) for _ in range(4)]
    scales = [torch.zeros(nb, bs, Hkv, device=DEV) for _ in range(4)] if kv == 'fp8' else [None] * 4
    q0 = q.clone()
    ssq = (torch.rand(T, 2, device=DEV) * 5000)[:, 1] if rms else None  # strided, as the stream's sums give
    r = (ssq, 1000, 1e-5) if rms else None
    s = torch.rsqrt(ssq / 1000 + 1e-5)[:, None, None] if rms else 1.0
    qos = [torch.full((T, H, D), 7.0, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    pa.rotary_and_cache_ref(
        q, key, value, pos, cs, D, is_neox, caches[2], caches[3], slots, scales[2], scales[3], q_out=qos[1], rms=r
    )
    got = pa.rotary_and_cache(
        q, key, value, pos, cs, D, is_neox, caches[0], caches[1], slots, scales[0], scales[1], q_out=qos[0], rms=r
    )
    assert got is qos[0] and torch.equal(q, q0)  # q read, not written
    torch.testing.assert_close(qos[0].float(), qos[1].float(), rtol=2**-7, atol=1e-6)
    assert not torch.allclose(qos[0][..., :rot_dim].float(), (q * s)[..., :rot_dim].bfloat16().float(), atol=1e-2)
    torch.testing.assert_close(
        qos[0][..., rot_dim:].float(), (q * s)[..., rot_dim:].bfloat16().float(), rtol=2**-7, atol=0
    )
    if kv == 'fp8':
        for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert fp8_ulps(a, b).max() <= 1
    else:
        for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


# ------------------------------------------------------------------------------------------------ reference itself


@pytest.mark.parametrize('window,softcap', [(None, None), (7, None), (None, 2.0), (7, 2.0)])
def test_reference_matches_naive_loop(window, softcap, monkeypatch):
    torch.manual_seed(1)
    monkeypatch.setattr(pa, 'REF_SCORE_BUDGET', 4 * 30)  # tiny query chunks: exercise the chunked path too
    # decode, prefill from scratch, chunked prefill over a cached prefix, a 1-token-context decode
    args = make_batch(
        [1, 9, 5, 1, 3], [20, 0, 13, 0, 30], H=4, Hkv=2, D=16, block_size=4, dtype=torch.float32, device='cpu'
    )
    ref = paged_attention_ref(*args, scale=0.25, sliding_window=window, softcap=softcap)
    naive = naive_attention(*args, scale=0.25, window=window, softcap=softcap)
    assert (ref.double() - naive).abs().max() < 1e-5
    if softcap:  # the cap changed the result (scores of N(0, 1) q, k at scale 0.25 reach well past 2)
        assert (ref - paged_attention_ref(*args, scale=0.25, sliding_window=window)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ paged_attention


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize('H,Hkv,D,bs', [(4, 1, 64, 16), (6, 2, 128, 32), (2, 2, 32, 16)])
def test_mixed_batch(dtype, H, Hkv, D, bs):
    "Prefill, chunked prefill over a cached prefix and decode tokens in one varlen batch."
    torch.manual_seed(2)
    args = make_batch([37, 1, 20, 1, 70], [0, 45, 33, 3, 17], H, Hkv, D, bs, dtype)
    out = paged_attention(*args, scale=D**-0.5)
    assert_close(out, paged_attention_ref(*args, scale=D**-0.5), dtype)


@pytest.mark.parametrize('window', [5, 40])
def test_sliding_window(window):
    torch.manual_seed(3)
    args = make_batch([30, 1, 12], [50, 90, 0], 4, 2, 32, 16, torch.float32)
    ref = paged_attention_ref(*args, scale=0.2, sliding_window=window)
    assert_close(paged_attention(*args, scale=0.2, sliding_window=window), ref, torch.float32)
    dec = make_batch([1, 1, 1], [50, 90, 3], 4, 2, 32, 16, torch.float32)
    ref = paged_attention_ref(*dec, scale=0.2, sliding_window=window)
    assert_close(paged_attention(*dec, scale=0.2, sliding_window=window, num_kv_splits=3), ref, torch.float32)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('window', [None, 6])
def test_softcap(dtype, window):
    "Gemma 2's tanh soft-capping of the scores: prefill + chunked + decode batch, and split-KV decode."
    torch.manual_seed(8)
    args = make_batch([21, 1, 9], [0, 40, 17], 4, 2, 32, 16, dtype)
    args[0] = (args[0].float() * 3).to(dtype)  # large scores, so that the cap bites
    out = paged_attention(*args, scale=0.5, sliding_window=window, softcap=5.0)
    ref = paged_attention_ref(*args, scale=0.5, sliding_window=window, softcap=5.0)
    assert_close(out, ref, dtype)
    assert (ref.float() - paged_attention_ref(*args, scale=0.5, sliding_window=window).float()).abs().max() > 0.1
    dec = make_batch([1, 1, 1], [50, 90, 3], 4, 2, 32, 16, dtype)
    dec[0] = (dec[0].float() * 3).to(dtype)
    out = paged_attention(*dec, scale=0.5, sliding_window=window, softcap=5.0, num_kv_splits=3)
    assert_close(out, paged_attention_ref(*dec, scale=0.5, sliding_window=window, softcap=5.0), dtype)


@pytest.mark.parametrize('window', [None, 7])
def test_sinks_reference_matches_naive_loop(window):
    "gpt-oss's attention sinks: the reference against the fp64 loop, and the sinks change the result."
    torch.manual_seed(11)
    args = make_batch([1, 9, 5, 1], [20, 0, 13, 0], H=4, Hkv=2, D=16, block_size=4, dtype=torch.float32, device='cpu')
    sinks = torch.randn(4) * 2
    ref = paged_attention_ref(*args, scale=0.25, sliding_window=window, sinks=sinks)
    assert (ref.double() - naive_attention(*args, scale=0.25, window=window, sinks=sinks)).abs().max() < 1e-5
    assert (ref - paged_attention_ref(*args, scale=0.25, sliding_window=window)).abs().max() > 1e-2


@pytest.mark.parametrize('chunk', [4, 8, 16])
def test_chunked_reference_matches_naive_loop(chunk, monkeypatch):
    "Llama 4's chunked local attention: the reference against the fp64 loop (chunk boundaries inside blocks and on them)."
    torch.manual_seed(13)
    monkeypatch.setattr(pa, 'REF_SCORE_BUDGET', 4 * 30)
    args = make_batch(
        [1, 9, 5, 1, 3], [20, 0, 13, 0, 30], H=4, Hkv=2, D=16, block_size=4, dtype=torch.float32, device='cpu'
    )
    ref = paged_attention_ref(*args, scale=0.25, attention_chunk_size=chunk)
    assert (ref.double() - naive_attention(*args, scale=0.25, chunk=chunk)).abs().max() < 1e-5
    assert (ref - paged_attention_ref(*args, scale=0.25)).abs().max() > 1e-2  # the chunks changed the result


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('chunk', [5, 16])
def test_chunked_local_attention(dtype, chunk):
    """Chunked local attention in the kernel: prefill (query tiles across chunk boundaries), chunked prefill over a
    cached prefix, decode in a mixed batch; then split-KV decode (the splits cover the query's chunk only)."""
    torch.manual_seed(14)
    args = make_batch([37, 1, 20, 1, 12], [0, 45, 33, 3, 17], 4, 2, 32, 16, dtype)
    out = paged_attention(*args, scale=0.3, attention_chunk_size=chunk)
    assert_close(out, paged_attention_ref(*args, scale=0.3, attention_chunk_size=chunk), dtype)
    dec = make_batch([1, 1, 1], [50, 90, 3], 4, 2, 32, 16, dtype)
    out = paged_attention(*dec, scale=0.3, attention_chunk_size=chunk, num_kv_splits=3)
    assert_close(out, paged_attention_ref(*dec, scale=0.3, attention_chunk_size=chunk), dtype)
    short = make_batch([3, 1, 6], [6, 20, 13], 4, 2, 32, 16, dtype)  # the decode path's 8-query tile across a boundary
    out = paged_attention(*short, scale=0.3, attention_chunk_size=chunk, num_kv_splits=2)
    assert_close(out, paged_attention_ref(*short, scale=0.3, attention_chunk_size=chunk), dtype)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('window', [None, 6])
def test_sinks(dtype, window):
    "Attention sinks in the kernel: prefill + chunked + decode batch (G = 3), and split-KV decode (split 0 holds the sink)."
    torch.manual_seed(12)
    args = make_batch([21, 1, 9], [0, 40, 17], 6, 2, 32, 16, dtype)
    sinks = torch.randn(6, device=DEV) * 2
    out = paged_attention(*args, scale=0.3, sliding_window=window, sinks=sinks)
    assert_close(out, paged_attention_ref(*args, scale=0.3, sliding_window=window, sinks=sinks), dtype)
    dec = make_batch([1, 1, 1], [50, 90, 3], 6, 2, 32, 16, dtype)
    out = paged_attention(*dec, scale=0.3, sliding_window=window, sinks=sinks.bfloat16(), num_kv_splits=3)
    assert_close(out, paged_attention_ref(*dec, scale=0.3, sliding_window=window, sinks=sinks.bfloat16()), dtype)


def test_pick_decode_config_buckets_and_tables():
    "The tuned decode config: the largest bucket <= the batch, `short` under short bounds, `default` for other head dims."
    c = lambda n: dict(tile_n=n, num_warps=4, num_stages=2, min_keys=128, waves=2)
    T = {'default': c(64), 'decode': {(128, 1): c(32), (128, 16): c(128), (64, 1): c(16)}, 'short': {(128, 1): c(256)}}
    pick = pa.pick_decode_config
    assert pick(T, 1, 4096, 128) == c(32) and pick(T, 15, 4096, 128) == c(32) and pick(T, 64, 4096, 128) == c(128)
    assert pick(T, 1, pa.MIN_KEYS_PER_SPLIT, 128) == c(256)  # the short-context graphs' bound
    assert pick(T, 16, 200, 128) == c(128)  # decode's bucket 16 is nearer than short's 1
    assert pick(T, 1, 4096, 256) == c(64) and pick(T, 8, 4096, 64) == c(16)
    assert pick({'default': c(64), 'decode': {}, 'short': {}}, 8, 100, 128) == c(64)
    default = pa.configs_for('paged_attention', torch.device('cpu'))
    assert pa.decode_config(64, 4096, 128, torch.device('cpu')) == default['default']


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


# ------------------------------------------------------------------------------------------------ FP8 KV cache

FP8 = torch.float8_e4m3fn
# FP8 vs unquantized K/V (N(0,1) data): e4m3 keeps 3 mantissa bits, so each cached value is off by up to 2^-4
# relative (rms ~2^-4/sqrt(3) = 3.6%); through the scores and the weighted sum of V the outputs differ by ~3%
# in relative L2 norm (measured here: 2.4% to 3.9%, largest element error 0.03 to 0.09). Bounds: 6%, 0.2.
FP8_LOOSE = dict(rel_l2=0.06, max_abs=0.2)


def to_fp8(cache):
    "Quantize a `[num_blocks, block_size, Hkv, D]` cache by rows: (fp8 cache, fp32 scales `[num_blocks, block_size, Hkv]`)."
    c8, sc = pa.quantize_kv_ref(cache.reshape(-1, *cache.shape[2:]))
    return c8.view(cache.shape), sc.view(cache.shape[:3])


def fp8_args(args):
    "A batch from `make_batch` with its caches quantized: (args with fp8 caches, k_scale, v_scale)."
    q, kc, vc, qsl, sl, bt = args
    (k8, ks), (v8, vs) = to_fp8(kc), to_fp8(vc)
    return [q, k8, v8, qsl, sl, bt], ks, vs


def assert_fp8_loose(out, exact):
    out, exact = out.float(), exact.float()
    rel = ((out - exact).norm() / exact.norm()).item()
    err = (out - exact).abs().max().item()
    assert rel < FP8_LOOSE['rel_l2'] and err < FP8_LOOSE['max_abs'], (rel, err)


def fp8_ulps(a, b):
    "Per element, how many e4m3 steps apart two fp8 tensors are."
    ia, ib = (t.view(torch.uint8).int() for t in (a, b))
    signed = lambda i: torch.where(i >= 128, -(i - 128), i)  # sign-magnitude -> monotone integers
    return (signed(ia) - signed(ib)).abs()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_reshape_and_cache_fp8(dtype):
    "Per-(token, head) scale max|x|/448, values rounded to nearest e4m3; Triton = reference; zero and huge rows."
    torch.manual_seed(20)
    nb, bs, Hkv, D, T = 6, 16, 3, 40, 24
    kv = (torch.randn(2, T, Hkv, D, device=DEV) * torch.logspace(-3, 3, T, device=DEV)[:, None, None]).to(dtype)
    kv[0, 2] = 0  # an all-zero row: no NaN
    kv[1, 5, 0, :3] = torch.tensor([3e4, 1e-6, -2e-4])  # huge values and ones that round to 0 in one row
    kv[0, 7, 1] = torch.logspace(0, -6, D) * (-1) ** torch.arange(D)  # down to e4m3's subnormals (2^-9..2^-6 x scale)
    key, value = kv
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[[4, 9]] = -1
    caches = [torch.zeros(nb, bs, Hkv, D, device=DEV, dtype=FP8) for _ in range(4)]
    scales = [torch.zeros(nb, bs, Hkv, device=DEV) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, scales[0], scales[1])
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots, scales[2], scales[3])
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        ulps = fp8_ulps(got, want)
        if pa._INTERPRET:
            assert ulps.max() == 0  # the same IEEE fp32 arithmetic: bit-exact
        else:
            assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3  # same arithmetic on a GPU; 1 step allowed
    for got, want in ((scales[0], scales[2]), (scales[1], scales[3])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    keep = slots >= 0
    for x, c, sc in ((key, caches[2], scales[2]), (value, caches[3], scales[3])):
        x = x[keep].float()
        rows = c.view(-1, Hkv, D)[slots[keep]].float()
        s = sc.view(-1, Hkv)[slots[keep]]
        torch.testing.assert_close(s, (x.abs().amax(-1).clamp_min(SCALE_MIN) / 448), rtol=1e-6, atol=0)
        assert rows.abs().amax(-1)[x.abs().amax(-1) > 0].eq(448).all()  # each row's max lands on e4m3's max
        # nearest e4m3 value: half a step, 2^-4 relative (normals) or 2^-10 * scale (subnormals below 2^-6)
        err = (rows * s[..., None] - x).abs()
        assert (err <= torch.maximum(x.abs() * 2**-4, s[..., None] * 2**-10) * (1 + 1e-6)).all()
    assert not any(torch.isnan(c.float()).any() for c in caches)


def test_fp8_reference_is_attention_over_dequantized_cache():
    "The reference reads FP8 as cache * scale in fp32; it then agrees with the naive fp64 loop."
    torch.manual_seed(21)
    args, ks, vs = fp8_args(make_batch([1, 9, 5, 1], [20, 0, 13, 30], 4, 2, 16, 4, torch.float32, device='cpu'))
    q, k8, v8, qsl, sl, bt = args
    deq = [q, k8.float() * ks[..., None], v8.float() * vs[..., None], qsl, sl, bt]
    ref = paged_attention_ref(*args, scale=0.25, k_scale=ks, v_scale=vs)
    assert torch.equal(ref, paged_attention_ref(*deq, scale=0.25))
    assert (ref.double() - naive_attention(*deq, scale=0.25)).abs().max() < 1e-5


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('H,Hkv,D,bs', [(4, 1, 64, 16), (6, 2, 32, 16)])
def test_fp8_mixed_batch(dtype, H, Hkv, D, bs):
    "Varlen prefill, chunked prefill over a cached prefix and decodes over an FP8 cache, GQA."
    torch.manual_seed(22)
    exact = make_batch([37, 1, 20, 1, 70], [0, 45, 33, 3, 17], H, Hkv, D, bs, dtype)
    args, ks, vs = fp8_args(exact)
    out = paged_attention(*args, scale=D**-0.5, k_scale=ks, v_scale=vs)
    assert_close(out, paged_attention_ref(*args, scale=D**-0.5, k_scale=ks, v_scale=vs), dtype)
    assert_fp8_loose(out, paged_attention_ref(*exact, scale=D**-0.5))


@pytest.mark.parametrize('splits', [1, 3])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_fp8_decode_split_kv(splits, dtype):
    "Split-KV decode over an FP8 cache (G = 4 query heads per KV head) and the merge of the splits."
    torch.manual_seed(23)
    exact = make_batch([1] * 4, [0, 130, 300, 64], 8, 2, 64, 16, dtype)
    args, ks, vs = fp8_args(exact)
    out = paged_attention(*args, scale=0.125, num_kv_splits=splits, max_seq_len=512, k_scale=ks, v_scale=vs)
    assert_close(out, paged_attention_ref(*args, scale=0.125, k_scale=ks, v_scale=vs), dtype)
    assert_fp8_loose(out, paged_attention_ref(*exact, scale=0.125))


def test_fp8_write_then_attend():
    "As a layer runs: a chunked prefill then a decode step write K/V through `reshape_and_cache` and attend."
    torch.manual_seed(24)
    H, Hkv, D, bs, nb = 4, 2, 32, 8, 12
    k8, v8 = torch.zeros(2, nb, bs, Hkv, D, device=DEV, dtype=FP8)
    ks, vs = torch.zeros(2, nb, bs, Hkv, device=DEV)
    kx, vx = torch.zeros(2, nb, bs, Hkv, D, device=DEV)  # the same K/V kept unquantized
    table = torch.tensor([[5, 2, 9, 0, 11]], dtype=torch.int32, device=DEV)
    L = 30
    q, k, v = torch.randn(L, H, D, device=DEV), torch.randn(L, Hkv, D, device=DEV), torch.randn(L, Hkv, D, device=DEV)
    for s, e in ((0, 19), (19, 29), (29, 30)):  # two prefill chunks, then one decode token
        slots = table[0, torch.arange(s, e, device=DEV) // bs].long() * bs + torch.arange(s, e, device=DEV) % bs
        reshape_and_cache(k[s:e], v[s:e], k8, v8, slots, ks, vs)
        reshape_and_cache_ref(k[s:e], v[s:e], kx, vx, slots)
        meta = (
            torch.tensor([0, e - s], dtype=torch.int32, device=DEV),
            torch.tensor([e], dtype=torch.int32, device=DEV),
            table,
        )
        out = paged_attention(q[s:e], k8, v8, *meta, scale=D**-0.5, k_scale=ks, v_scale=vs)
        want = paged_attention_ref(q[s:e], k8, v8, *meta, scale=D**-0.5, k_scale=ks, v_scale=vs)
        assert_close(out, want, torch.float32)
        assert_fp8_loose(out, paged_attention_ref(q[s:e], kx, vx, *meta, scale=D**-0.5))


# ------------------------------------------------------------------------------------------------ CUDA, real sizes


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('bs', [16, 32])
def test_cuda_decode_real_sizes(dtype, bs):
    torch.manual_seed(10)
    B = 64
    ctx = torch.randint(1, 8192, (B,)).tolist()
    args = make_batch([1] * B, ctx, 32, 8, 128, bs, dtype)
    out = paged_attention(*args, scale=128**-0.5, max_seq_len=8192)
    assert_close(out, paged_attention_ref(*args, scale=128**-0.5), dtype)
    # few long sequences: many KV splits
    args = make_batch([1, 1], [8000, 3000], 32, 8, 128, bs, dtype)
    out = paged_attention(*args, scale=128**-0.5, max_seq_len=8192)
    assert_close(out, paged_attention_ref(*args, scale=128**-0.5), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype,D', [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128)])
def test_cuda_prefill_real_sizes(dtype, D):
    "Long prefill, chunked prefill behind a long cached prefix, and decodes, in one batch."
    torch.manual_seed(11)
    args = make_batch([4096, 1, 512, 1, 2000, 1], [0, 7000, 6000, 100, 0, 1], 32, 8, D, 16, dtype)
    out = paged_attention(*args, scale=D**-0.5)
    assert_close(out, paged_attention_ref(*args, scale=D**-0.5), dtype)
    out = paged_attention(*args, scale=D**-0.5, sliding_window=1024)
    assert_close(out, paged_attention_ref(*args, scale=D**-0.5, sliding_window=1024), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_chunked_llama4_sizes(dtype):
    """Llama 4 Scout's attention shape (40 heads, 8 KV heads, D=128) with 2048-token chunks (8192 in the model): long
    prefill over several chunks, chunked prefill behind a cached prefix that ends mid-chunk, decodes; then split-KV
    decode of long contexts."""
    torch.manual_seed(15)
    args = make_batch([5000, 1, 700, 1, 2048], [0, 7000, 3000, 100, 2048], 40, 8, 128, 16, dtype)
    out = paged_attention(*args, scale=128**-0.5, attention_chunk_size=2048)
    assert_close(out, paged_attention_ref(*args, scale=128**-0.5, attention_chunk_size=2048), dtype)
    dec = make_batch([1] * 8, [8000, 2047, 2048, 6000, 1, 4100, 300, 8191], 40, 8, 128, 16, dtype)
    out = paged_attention(*dec, scale=128**-0.5, attention_chunk_size=2048, max_seq_len=8192)
    assert_close(out, paged_attention_ref(*dec, scale=128**-0.5, attention_chunk_size=2048), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize('window', [None, 4096])
def test_cuda_softcap_gemma2_sizes(window):
    "Gemma 2 2B's attention shape (8 heads, 4 KV heads, D=256, cap 50) in bf16: prefill, chunked, decode."
    torch.manual_seed(12)
    args = make_batch([3000, 1, 700, 1], [0, 6000, 5000, 9], 8, 4, 256, 16, torch.bfloat16)
    args[0] = (args[0].float() * 8).bfloat16()
    out = paged_attention(*args, scale=256**-0.5, sliding_window=window, softcap=50.0)
    assert_close(out, paged_attention_ref(*args, scale=256**-0.5, sliding_window=window, softcap=50.0), torch.bfloat16)


@pytest.mark.cuda
def test_cuda_graph_decode_replay():
    "Capture decode once with static max_seq_len; replay with new lengths and queries written into the inputs."
    torch.manual_seed(12)
    B, H, Hkv, D, bs, max_len = 8, 32, 8, 128, 16, 4096
    q, kc, vc, qsl, sl, bt = make_batch([1] * B, [max_len - 1] * B, H, Hkv, D, bs, torch.bfloat16)
    run = lambda: paged_attention(q, kc, vc, qsl, sl, bt, scale=D**-0.5, max_query_len=1, max_seq_len=max_len)
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
        assert_close(out, paged_attention_ref(q, kc, vc, qsl, sl, bt, scale=D**-0.5), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_cuda_fp8_real_sizes(dtype):
    "FP8 cache at the 8B shape: decode of 64 sequences up to 8k, two long ones (many splits), a mixed prefill batch."
    torch.manual_seed(13)
    for q_lens, ctx in (
        ([1] * 64, torch.randint(1, 8192, (64,)).tolist()),
        ([1, 1], [8000, 3000]),
        ([4096, 1, 512, 1, 2000, 1], [0, 7000, 6000, 100, 0, 1]),
    ):
        exact = make_batch(q_lens, ctx, 32, 8, 128, 16, dtype)
        args, ks, vs = fp8_args(exact)
        out = paged_attention(*args, scale=128**-0.5, k_scale=ks, v_scale=vs)
        assert_close(out, paged_attention_ref(*args, scale=128**-0.5, k_scale=ks, v_scale=vs), dtype)
        assert_fp8_loose(out, paged_attention_ref(*exact, scale=128**-0.5))


@pytest.mark.cuda
def test_cuda_graph_fp8_decode_replay():
    "FP8 decode captured once: the scales are device tensors, so replays with new lengths read the right ones."
    torch.manual_seed(14)
    B, H, Hkv, D, bs, max_len = 8, 32, 8, 128, 16, 4096
    args, ks, vs = fp8_args(make_batch([1] * B, [max_len - 1] * B, H, Hkv, D, bs, torch.bfloat16))
    q, kc, vc, qsl, sl, bt = args
    run = lambda: paged_attention(
        q, kc, vc, qsl, sl, bt, scale=D**-0.5, max_query_len=1, max_seq_len=max_len, k_scale=ks, v_scale=vs
    )
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for _ in range(3):
        sl.copy_(torch.randint(1, max_len + 1, (B,), dtype=torch.int32))
        ks.mul_(torch.rand_like(ks) + 0.5)  # new scales in place: the graph reads them, never a host copy
        g.replay()
        torch.cuda.synchronize()
        want = paged_attention_ref(q, kc, vc, qsl, sl, bt, scale=D**-0.5, k_scale=ks, v_scale=vs)
        assert_close(out, want, torch.bfloat16)


def compiled_variants(kernel):
    "How many binaries Triton's JIT holds for `kernel` (its per-device caches, keyed by specialization)."
    return sum(len(c[0]) for c in kernel.device_caches.values())


@pytest.mark.cuda
def test_cuda_step_sizes_do_not_recompile():
    """A serving step's sizes (sequences in the batch, block-table width, KV splits, the longest short query) vary
    every step; each value Triton specializes on (== 1, divisible by 16) or that picks a compile-time size would
    compile a new binary in the middle of serving (0.5-0.9 s at the 8B shape). Sizes are `do_not_specialize` and
    compile-time sizes come from a fixed few, which the runner compiles at start-up (`warm_up_kernels`)."""
    torch.manual_seed(14)
    kern = pak.paged_attention_kernel
    # mixed path: sequence counts and table widths of each residue class
    for i, (q_lens, ctx) in enumerate(
        (([300, 1, 1], [0, 40, 7]), ([17] * 16, [15] * 16), ([33], [1]), ([5, 90] * 8, [150] * 16))
    ):
        args = make_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16)
        if i == 0:
            paged_attention(*args, scale=128**-0.5)
            n = compiled_variants(kern)
        assert_close(
            paged_attention(*args, scale=128**-0.5), paged_attention_ref(*args, scale=128**-0.5), torch.bfloat16
        )
        assert compiled_variants(kern) == n, (q_lens[:3], args[-1].shape)
    # the split-KV decode path: 1 to 17 sequences, 3 to 32 splits, one-token queries, then queries of 2 to 8 tokens
    # (a short last prefill chunk): one binary each for one-token and short queries, one merge binary for all
    merge, seen, sizes = pak.merge_splits_kernel, None, ((3, 3), (16, 16), (1, 32), (17, 5))
    # one-token queries take the tuned config of their batch bucket (`decode_config`; the runner's graph captures
    # compile each one); longer ones the single `default`
    tuned = {
        tuple(pa.decode_config(B, 1500, 128, torch.device('cuda'))[k] for k in ('tile_n', 'num_warps', 'num_stages'))
        for B, _ in sizes
    }
    for q_len in (1, 3, 2, 8):
        before = compiled_variants(kern)
        for B, splits in sizes:
            args = make_batch([q_len] * B, [1500] * B, 32, 8, 128, 16, torch.bfloat16)
            out = paged_attention(*args, scale=128**-0.5, num_kv_splits=splits)
            assert_close(out, paged_attention_ref(*args, scale=128**-0.5), torch.bfloat16)
            if seen is None:
                seen = compiled_variants(merge)
            assert compiled_variants(merge) == seen, (q_len, B, splits)
        assert compiled_variants(kern) - before <= {1: len(tuned), 3: 1}.get(q_len, 0), (
            q_len
        )  # 2 and 8 reuse 3's binary
