"""The foundation's correctness checks on a GPU: our engine (Triton attention, CUDA graphs) against `transformers`
on the same device, in fp32 (tight) and bf16 (bf16 tolerance). Skipped without CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V = 1024


def _model(kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    base = dict(
        vocab_size=V,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    if kind == 'llama':
        m = LlamaForCausalLM(LlamaConfig(**base, architectures=['LlamaForCausalLM']))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**base, head_dim=64, architectures=['Qwen3ForCausalLM']))
    d = Path(tempfile.mkdtemp())
    m.save_pretrained(d)
    return m.eval(), d


@pytest.mark.parametrize('kind', ['llama', 'qwen3'])
@pytest.mark.parametrize('dtype,tol', [('float32', 2e-3), ('bfloat16', 0.15)])
def test_logprobs_and_greedy_match_transformers(kind, dtype, tol):
    from cvllm_lab import LLM, SamplingParams

    hf, d = _model(kind)
    td = getattr(torch, dtype)
    hf = hf.to('cuda', td)
    llm = LLM(
        str(d),
        progress=False,
        device='cuda',
        dtype=dtype,
        skip_tokenizer_init=True,
        kv_cache_memory=512 << 20,
        block_size=16,
        prefill_chunk_size=64,
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 100, 333, 1500)]
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5, logprobs=0),
        use_tqdm=False,
    )
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p], device='cuda')).logits[0].float(), -1).cpu()
            err = max(
                abs(lp.logprob - ref[i, t].item())
                for i, dct in enumerate(o.prompt_logprobs[1:])
                for t, lp in dct.items()
            )
            assert err < tol, (kind, dtype, len(p), err)
            gen = hf.generate(torch.tensor([p], device='cuda'), max_new_tokens=8, do_sample=False, min_new_tokens=8)[
                0, len(p) :
            ].tolist()
            if dtype == 'float32':
                assert o.outputs[0].token_ids == gen
            else:
                assert o.outputs[0].token_ids[:2] == gen[:2]  # bf16: later tokens may flip on near ties


def test_batching_invariance_fp32():
    from cvllm_lab import LLM, SamplingParams

    _, d = _model('llama')
    llm = LLM(
        str(d), progress=False, device='cuda', dtype='float32', skip_tokenizer_init=True, kv_cache_memory=512 << 20
    )
    g = torch.Generator().manual_seed(2)
    prompts = [
        {'prompt_token_ids': torch.randint(0, V, (int(n),), generator=g).tolist()} for n in (5, 60, 300, 17, 900, 2)
    ]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert together == alone


def test_async_scheduling_matches_sync():
    "Steps launched ahead (CUDA graphs, ids fed device to device) give exactly the synchronous loop's tokens."
    from cvllm_lab import LLM, SamplingParams

    _, d = _model('llama')
    llm = LLM(
        str(d),
        progress=False,
        device='cuda',
        dtype='float32',
        skip_tokenizer_init=True,
        kv_cache_memory=256 << 20,
        max_num_seqs=16,
    )
    assert llm.engine.cfg.async_scheduling  # the CUDA default
    g = torch.Generator().manual_seed(3)
    prompts = [
        {'prompt_token_ids': torch.randint(0, V, (int(n),), generator=g).tolist()} for n in (5, 60, 300, 17, 900, 2, 33)
    ]
    stop_ids = prompts[0]['prompt_token_ids'][:3]
    sps = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=64, stop_token_ids=stop_ids, n=2),
        SamplingParams(temperature=0, max_tokens=31, min_tokens=5, ignore_eos=True),
    ]
    runs = {}
    for mode in (False, True):
        llm.engine.cfg.async_scheduling = mode
        ahead = llm.engine.num_steps_ahead
        outs = llm.generate(prompts * len(sps), [sp for sp in sps for _ in prompts], use_tqdm=False)
        runs[mode] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        assert (llm.engine.num_steps_ahead > ahead) == mode
    assert runs[True] == runs[False]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_no_compiles_after_start_up():
    """After `LLM(...)` (graph capture and `warm_up_kernels`), a serving-like mix compiles no Triton kernel: chunked
    prefills beside decodes, a prompt cached but for its last 3 tokens, long contexts (KV splits), greedy and sampled
    requests, prompt log-probs. Counts every binary the JIT holds for the attention and sampling kernels."""
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.kernels import paged_attention_kernel as pak, sampling as ks

    _, d = _model('llama')
    llm = LLM(
        str(d),
        progress=False,
        device='cuda',
        dtype='bfloat16',
        skip_tokenizer_init=True,
        kv_cache_memory=512 << 20,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        enable_prefix_caching=True,
    )
    kernels = [pak.paged_attention_kernel, pak.merge_splits_kernel, ks._sample_kernel, ks._argmax_kernel]
    count = lambda: [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    before = count()
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, V, (700,), generator=g).tolist()
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(5, 1500, (12,), generator=g)]
    llm.generate([{'prompt_token_ids': base}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    prompts += [base[:-3] + [1, 2, 3]]  # all but the last few tokens cached: a short query
    sps = [
        SamplingParams(
            temperature=0 if i % 2 else 0.8,
            top_p=0.9,
            max_tokens=20,
            ignore_eos=True,
            prompt_logprobs=0 if i == 3 else None,
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate([{'prompt_token_ids': p} for p in prompts], sps, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert outs[-1].num_cached_tokens >= 688
    assert count() == before, (before, count())


def test_no_moe_compiles_after_start_up():
    """The same for a Qwen3-MoE: the fused-MoE tile configs are picked per row bucket, so the warm-up's
    power-of-two prefill steps compile each bucket's binary before serving; mixed steps of any size then compile
    nothing."""
    from helpers import tiny_qwen3_moe
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.kernels import fused_moe_gemm as fg, moe_sum, fused_moe_router as fr

    _, _, d = tiny_qwen3_moe()
    llm = LLM(
        str(d),
        progress=False,
        device='cuda',
        dtype='bfloat16',
        skip_tokenizer_init=True,
        kv_cache_memory=256 << 20,
        max_num_batched_tokens=1024,
        max_num_seqs=16,
    )
    kernels = [fg._fused_moe_kernel, moe_sum._moe_sum_kernel, fr._topk_softmax_kernel]
    count = lambda: [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    before = count()
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 250, (24,), generator=g)
    ]
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert count() == before, (before, count())


@pytest.mark.parametrize('defer', [False, True], ids=['norm-kernels', 'deferred-norms'])
def test_w4a16_fp32_stream_matches_bf16_adds(monkeypatch, defer):
    """W4A16 at one row runs the Llama layers on the fp32 residual stream (the output and down projections' MMA
    kernels add into it); greedy tokens and their logprobs agree with the same engine on the fused bf16 adds.
    `defer`: `EngineConfig.defer_norms`, the stream's norms as kernels or split around their matmuls (`DeferredRMS`)."""
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.models.llama import LlamaDecoderLayer, LlamaForCausalLM as Ours

    deferred, defers = [], LlamaDecoderLayer.defers_norms
    monkeypatch.setattr(LlamaDecoderLayer, 'defers_norms', lambda self: deferred.append(defers(self)) or deferred[-1])
    _, d = _model('llama')
    prompt = {'prompt_token_ids': torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(3)).tolist()}
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    kw = dict(
        progress=False,
        device='cuda',
        dtype='bfloat16',
        quantization='w4a16',
        skip_tokenizer_init=True,
        kv_cache_memory=256 << 20,
        max_num_seqs=4,
        defer_norms=defer,
    )
    seen, stream = [], Ours.fp32_stream
    monkeypatch.setattr(Ours, 'fp32_stream', lambda self, h: seen.append(stream(self, h)) or seen[-1])
    a = LLM(str(d), **kw).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert True in seen and False in seen  # decode rows on the stream, the prompt's prefill not
    assert set(deferred) == {defer}
    monkeypatch.setattr(Ours, 'fp32_stream', lambda self, h: False)
    b = LLM(str(d), **kw).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids[:4] == b.token_ids[:4], (a.token_ids, b.token_ids)
    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    err = max(abs(la[t].logprob - lb[t].logprob) for la, lb, t in zip(a.logprobs[:n], b.logprobs[:n], a.token_ids))
    assert err < 0.1, err
