"""The int4 KV cache (`kernels/kv_cache_int4.py`): the Triton write against its reference (the same bytes and scales),
the paged attention kernel over an int4 cache against the reference (decode, prefill and chunked prefill, GQA), and
the quantization error of the format. CPU sizes run under TRITON_INTERPRET=1; the `cuda` ones on a GPU (conftest skips them without one)."""

import pytest
import torch

from cvllm_lab.kernels.kv_cache_int4 import dequantize_kv4_ref, kv4_group, quantize_kv4_ref
from cvllm_lab.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    rotary_and_cache,
    rotary_and_cache_ref,
)


def _caches(nb, bs, Hkv, D, device):
    g = kv4_group(D)
    c = [torch.zeros(nb, bs, Hkv, D // 2, dtype=torch.uint8, device=device) for _ in range(2)]
    s = [torch.zeros(nb, bs, Hkv, D // g, dtype=torch.float16, device=device) for _ in range(2)]
    return c, s


def test_quantize_roundtrip():
    torch.manual_seed(0)
    x = torch.randn(64, 2, 64)
    p, s = quantize_kv4_ref(x)
    assert p.shape == (64, 2, 32) and s.shape == (64, 2, 2) and s.dtype == torch.float16
    y = dequantize_kv4_ref(p, s)
    # half a step at most: |x - y| <= scale / 2 (fp16 scale rounding adds a little)
    step = s.float().repeat_interleave(32, -1)
    assert ((x - y).abs() <= step * 0.5 + 1e-3 * step).all()
    rel = (x - y).norm() / x.norm()
    assert 0.05 < rel < 0.2, rel  # 4 bits: ~10% relative error on Gaussian rows
    assert kv4_group(48) == 48 and kv4_group(128) == 32


@pytest.mark.parametrize('D,Hkv', [(64, 2), (48, 3)])
def test_write_matches_ref(D, Hkv):
    torch.manual_seed(1)
    T, nb, bs = 9, 4, 4
    k, v = torch.randn(T, Hkv, D), torch.randn(T, Hkv, D) * 3
    k[0] = 0  # an all-zero row: the scale floor, codes 8
    slots = torch.tensor([0, 3, 5, -1, 7, 8, 9, 12, 15])
    (kc, vc), (ks, vs) = _caches(nb, bs, Hkv, D, 'cpu')
    (kc2, vc2), (ks2, vs2) = _caches(nb, bs, Hkv, D, 'cpu')
    reshape_and_cache_ref(k, v, kc, vc, slots, ks, vs)
    reshape_and_cache(k, v, kc2, vc2, slots, ks2, vs2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(ks, ks2) and torch.equal(vs, vs2)
    assert kc.view(-1, Hkv, D // 2)[0].eq(0x88).all()


def _attention_case(device, dtype, q_lens, ctx_lens, H=4, Hkv=2, D=64, bs=8, seed=0, **kw):
    torch.manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // bs) for s in seq_lens]
    nb = sum(nblk) + 2
    perm = torch.randperm(nb)
    bt = torch.zeros(len(q_lens), max(nblk), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i : i + n]
        i += n
    (kc, vc), (ks, vs) = _caches(nb, bs, Hkv, D, device)
    S = sum(seq_lens)
    k, v = torch.randn(S, Hkv, D, device=device), torch.randn(S, Hkv, D, device=device)
    slots = torch.cat([bt[b, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs for b, L in enumerate(seq_lens)])
    reshape_and_cache_ref(k, v, kc, vc, slots.to(device), ks, vs)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=device, dtype=dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, kc, vc, qsl, sl, bt.to(device), D**-0.5)
    ref = paged_attention_ref(*args, k_scale=ks, v_scale=vs, **kw)
    out = paged_attention(*args, k_scale=ks, v_scale=vs, **kw)
    return out, ref


@pytest.mark.parametrize('q_lens,ctx_lens', [([1, 1, 1], [5, 17, 30]), ([7, 1, 12], [0, 9, 21])])
def test_attention_matches_ref(q_lens, ctx_lens):
    "Decode (one-token queries: the split-KV path) and prefill / chunked prefill (the tiled path), GQA 2."
    out, ref = _attention_case('cpu', torch.float32, q_lens, ctx_lens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize('D', [80, 96])
def test_attention_matches_ref_padded_head_dims(D):
    "Head dims that are not powers of 2: one scale per row (80) and three groups padded to four (96)."
    out, ref = _attention_case('cpu', torch.float32, [1, 6], [19, 4], D=D)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_attention_options_pass_through_the_rotation():
    "Sliding window, soft-cap and sinks reach the kernel and the reference through the int4 wrappers (and matter)."
    kw = dict(sliding_window=6, softcap=5.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    out, ref = _attention_case('cpu', torch.float32, [1, 9], [20, 7], **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    plain, _ = _attention_case('cpu', torch.float32, [1, 9], [20, 7])
    assert (plain - out).abs().max() > 1e-2


def test_attention_matches_ref_bf16():
    out, ref = _attention_case('cpu', torch.bfloat16, [1, 5], [20, 3], D=32)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_rotary_and_cache_int4():
    "The fused rotary + cache write on an int4 cache: rotates, then the int4 write (same bytes as the reference)."

    torch.manual_seed(2)
    T, H, Hkv, D = 5, 4, 2, 64
    cos_sin = torch.randn(64, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    pos, slots = torch.tensor([0, 3, 4, 9, 1]), torch.tensor([0, 1, 2, 6, 7])
    outs = []
    for fn in (rotary_and_cache_ref, rotary_and_cache):
        (kc, vc), (ks, vs) = _caches(2, 4, Hkv, D, 'cpu')
        kr = torch.empty_like(k)
        qr = fn(q.clone(), k, v, pos, cos_sin, D, True, kc, vc, slots, ks, vs, k_out=kr)
        outs.append((qr, kr, kc, vc, ks, vs))
    for a, b in zip(*outs):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a, b)
    assert outs[0][2].any()  # something was written


def test_rotary_and_cache_int4_rms_q_out():
    "The decode step's form: fp32 sums in, q_out in bf16, a deferred RMSNorm's 1/rms applied as they are read."
    torch.manual_seed(4)
    T, H, Hkv, D = 3, 4, 2, 32
    cos_sin = torch.randn(16, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    rms = (torch.rand(T) * 50 + 1, D, 1e-6)
    pos, slots = torch.tensor([2, 5, 7]), torch.tensor([1, 4, 6])
    outs = []
    for fn in (rotary_and_cache_ref, rotary_and_cache):
        (kc, vc), (ks, vs) = _caches(2, 4, Hkv, D, 'cpu')
        qo = torch.empty(T, H, D, dtype=torch.bfloat16)
        fn(q, k, v, pos, cos_sin, D, False, kc, vc, slots, ks, vs, q_out=qo, rms=rms)
        outs.append((qo, kc, vc, ks, vs))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_attention_matches_ref_cuda(dtype):
    out, ref = _attention_case(
        'cuda', dtype, [1] * 16 + [200, 37], [300] * 8 + [1000] * 8 + [0, 700], H=32, Hkv=8, D=128, bs=16
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_write_matches_ref_cuda():
    torch.manual_seed(3)
    T, Hkv, D, nb, bs = 300, 8, 128, 40, 16
    k, v = torch.randn(T, Hkv, D, device='cuda'), torch.randn(T, Hkv, D, device='cuda')
    slots = torch.randperm(nb * bs, device='cuda')[:T]
    (kc, vc), (ks, vs) = _caches(nb, bs, Hkv, D, 'cuda')
    (kc2, vc2), (ks2, vs2) = _caches(nb, bs, Hkv, D, 'cuda')
    reshape_and_cache_ref(k, v, kc, vc, slots, ks, vs)
    reshape_and_cache(k, v, kc2, vc2, slots, ks2, vs2)
    assert torch.equal(ks, ks2) and torch.equal(vs, vs2)
    assert (kc != kc2).float().mean() < 1e-3 and (vc != vc2).float().mean() < 1e-3  # division rounding ties only


@pytest.mark.cuda
def test_engine_int4_cuda_graphs():
    "LLM(kv_cache_dtype='int4') on a GPU: CUDA graphs on give the eager run's tokens; prompt log-probs near the bf16 cache."
    import tempfile
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        architectures=['LlamaForCausalLM'],
    )
    d = tempfile.mkdtemp()
    LlamaForCausalLM(cfg).save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    prompts = [{'prompt_token_ids': torch.randint(0, 256, (n,), generator=g).tolist()} for n in (90, 300, 17, 64)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    kw = dict(progress=False, skip_tokenizer_init=True, dtype='bfloat16', max_model_len=512, kv_cache_memory=64 << 20)
    runs = {}
    for name, extra in (
        ('bf16', {}),
        ('int4', {'kv_cache_dtype': 'int4'}),
        ('int4-eager', {'kv_cache_dtype': 'int4', 'enforce_eager': True}),
    ):
        llm = LLM(d, **kw, **extra)
        runs[name] = llm.generate(prompts, sp, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(runs['int4'], runs['int4-eager']):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp = lambda o: torch.tensor([next(iter(x.values())).logprob for x in o.prompt_logprobs[1:]])
    diff = torch.cat([(lp(a) - lp(b)).abs() for a, b in zip(runs['int4'], runs['bf16'])])
    assert diff.max() < 0.2 and diff.mean() < 0.05, (diff.max(), diff.mean())
