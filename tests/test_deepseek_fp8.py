"""Tiny DeepSeek V2 and V3 through the engine with an FP8 latent cache (`kv_cache_dtype='fp8'`) against the same
model with its fp32 cache: prompt log-probs within a tolerance set by e4m3's rounding, greedy tokens that part only at
near-ties, the cache's bytes per token = `(kv_lora_rank + qk_rope_head_dim) * 1 + 4` (one fp32 scale per row).

"""

import pytest
import torch

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.kernels.kv_cache import FP8_DTYPE

from test_models_deepseek import tiny_hf


def run(d, kv_cache_dtype, prompts, backend='torch', **kw):
    kw = (
        dict(
            block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, max_model_len=64, num_gpu_blocks_override=64
        )
        | kw
    )
    llm = LLM(str(d), dtype='float32', progress=False, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, **kw)
    sp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=-1, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    lps = [torch.tensor([[d[t].logprob for t in range(256)] for d in o.prompt_logprobs[1:]]) for o in outs]
    return llm, lps, [o.outputs[0] for o in outs]


def parts_at_near_ties(got, ref, margin):
    "Greedy tokens equal up to the first difference, where the reference's two best tokens were within `margin` nats."
    for a, b in zip(got, ref):
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            continue
        top2 = sorted((lp.logprob for lp in b.logprobs[i].values()), reverse=True)[:2]
        if top2[0] - top2[1] > margin:
            return False
    return True


@pytest.mark.parametrize('v3', [False, True])
def test_fp8_latent_cache_through_engine(v3):
    """Chunked (8-token chunks), batched prefill and decode over an FP8 latent cache. Tolerance: a cached row is
    rounded to e4m3 (relative error <= 2^-4 per value, ~3.6% RMS), and it reaches the logits through the attention
    output (relative error ~3%, measured at the layer in nbs/26) and the residual stream, which also carries the
    unquantized embedding and MLP outputs: the log-probs' RMS difference must stay under 0.05 nats and their worst
    under 0.35 (measured: RMS 0.007 / worst 0.03 for V2, 0.018 / 0.20 for V3, over 35 positions x 256 tokens),
    the fp8 run must differ from the fp32 one (it did quantize), and the
    greedy tokens of a sequence may part only where the fp32 run's two best tokens were within twice that worst."""
    hf, d = tiny_hf(v3, seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19, 13)]
    _, ref, ref_toks = run(d, 'auto', prompts)
    llm, got, toks = run(d, 'fp8', prompts)
    runner = llm.engine.runner
    attn = runner.model.attention_layers()
    assert all(a.kv_cache.dtype == FP8_DTYPE and a.kv_scale.shape == a.kv_cache.shape[:2] for a in attn)
    assert all(a.kv_scale.dtype == torch.float32 for a in attn)
    assert runner.bytes_per_block == 4 * len(attn) * (64 + 16 + 4)  # (L + R) e4m3 bytes + a 4-byte scale per row
    diff = torch.cat(got) - torch.cat(ref)
    rms, worst = diff.pow(2).mean().sqrt().item(), diff.abs().max().item()
    print(f'fp8 vs fp32 cache: log-prob RMS {rms:.4f}, worst {worst:.4f}')
    assert 1e-4 < rms < 0.05 and worst < 0.35, (rms, worst)
    assert parts_at_near_ties(toks, ref_toks, 2 * 0.35), ([t.token_ids for t in toks], [t.token_ids for t in ref_toks])


@pytest.mark.interp
def test_fp8_latent_cache_triton_equals_torch():
    "The Triton path (prepare kernel, absorbed decode kernel, under the interpreter) on FP8 = the PyTorch path on FP8."
    hf, d = tiny_hf(v3=True, seed=6)
    prompts = [list(range(3, 14)), list(range(40, 47))]
    _, ref, ref_toks = run(d, 'fp8', prompts, 'torch')
    _, got, toks = run(d, 'fp8', prompts, 'triton')
    torch.testing.assert_close(torch.cat(got), torch.cat(ref), atol=2e-3, rtol=0)
    assert [t.token_ids for t in toks] == [t.token_ids for t in ref_toks]


@pytest.mark.cuda
@pytest.mark.parametrize('v3', [False, True])
def test_fp8_latent_cache_on_gpu(v3):
    """The Triton path on CUDA (prepare kernel, FP8 absorbed decode under CUDA graphs, decompressed prefill) with an
    FP8 latent cache against the same engine with its fp32 cache: the bounds of the CPU test."""
    hf, d = tiny_hf(v3, seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19, 13, 300)]
    kw = dict(
        device='cuda',
        block_size=16,
        prefill_chunk_size=32,
        max_num_batched_tokens=64,
        max_model_len=512,
        num_gpu_blocks_override=128,
    )
    _, ref, ref_toks = run(d, 'auto', prompts, 'triton', **kw)
    llm, got, toks = run(d, 'fp8', prompts, 'triton', **kw)
    assert llm.engine.runner.graphs, 'decode ran without CUDA graphs'
    diff = torch.cat(got) - torch.cat(ref)
    rms, worst = diff.pow(2).mean().sqrt().item(), diff.abs().max().item()
    print(f'fp8 vs fp32 cache (cuda): log-prob RMS {rms:.4f}, worst {worst:.4f}')
    assert 1e-4 < rms < 0.05 and worst < 0.35, (rms, worst)
    assert parts_at_near_ties(toks, ref_toks, 2 * 0.35)
