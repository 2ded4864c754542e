"""Llama 4 (text) through the engine at the bench shape (conf/model/llama4_scout.yaml), shrunk, with dummy weights on
the CPU: the config's fields survive (chunked / NoPE layers, top-1 experts with a shared expert) and a batch gives what
each prompt gives alone; on a GPU (`-m cuda`), a tiny random model against `transformers` through the Triton paged
kernels with chunks and the fused MoE kernel. The CPU numerics against `transformers` are in notebook 30a_llama4."""

import pytest
import torch

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.layers.fused_moe import FusedMoE

from helpers import bench_model_dir

SHRINK = dict(
    num_hidden_layers=4,
    hidden_size=64,
    intermediate_size=32,
    intermediate_size_mlp=48,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_chunk_size=8,
    floor_scale=4,
    max_position_embeddings=256,
)


def test_bench_shape_config_is_the_real_one():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bench_model_dir('llama4_scout'))
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.attention_chunk_size, cfg.head_dim) == (
        16,
        1,
        8192,
        128,
    )
    assert cfg.layer_types[:4] == ['chunked_attention'] * 3 + ['full_attention'] and len(cfg.layer_types) == 48
    assert cfg.no_rope_layers[:4] == [1, 1, 1, 0] and cfg.moe_layers == list(range(48))
    assert cfg.rope_parameters['rope_type'] == 'llama3' and cfg.rope_parameters['factor'] == 16.0


def test_bench_shape_builds_with_dummy_weights():
    llm = LLM(
        str(bench_model_dir('llama4_scout', SHRINK)),
        load_format='dummy',
        skip_tokenizer_init=True,
        dtype='float32',
        progress=False,
        max_model_len=128,
        kv_cache_memory=8 << 20,
        block_size=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
    )
    model = llm.engine.runner.model
    assert type(model).__name__ == 'Llama4ForCausalLM'
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 4 and all((m.num_experts, m.top_k) == (16, 1) for m in moes)
    attn = [l.self_attn for l in model.model.layers]
    assert [a.attn.attention_chunk_size for a in attn] == [8, 8, 8, None]
    assert [(a.use_rope, a.qk_norm_eps is not None, a.temperature_tuning) for a in attn] == [
        (True, True, False)
    ] * 3 + [(False, False, True)]
    assert len(llm.engine.runner.kv_cache_groups) == 4  # the full layer's group, one per chunked layer
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 512, (n,), generator=g).tolist()} for n in (3, 19, 11)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 6 for t in together)
    assert together == [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_gpu_tiny_llama4_matches_transformers(tmp_path):
    """fp32 on the GPU (Triton paged kernels with the chunk mask, the fused MoE kernel, chunked prefill, prefix caching):
    prompt log-probs within 1e-3 of `transformers` and 12 greedy tokens equal, prompts of up to five 8-token chunks."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    c = Llama4TextConfig(
        **{**SHRINK, 'vocab_size': 256},
        num_local_experts=4,
        interleave_moe_layer_step=2,
        attn_scale=0.5,
        rope_parameters=dict(
            rope_type='llama3',
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    c.architectures = ['Llama4ForCausalLM']
    c._attn_implementation = 'eager'
    hf = Llama4ForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n:
                p.normal_(1.0, 0.3)
            elif 'experts' in n or 'router' in n:
                p.normal_(0, 0.3)
            elif 'proj' in n:
                p.normal_(0, 0.15)
    hf.save_pretrained(tmp_path)
    hf = hf.cuda()
    llm = LLM(
        str(tmp_path),
        device='cuda',
        dtype='float32',
        skip_tokenizer_init=True,
        progress=False,
        block_size=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=True,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 41)]
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate([{'prompt_token_ids': p} for p in prompts], sp, use_tqdm=False)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p], device='cuda')).logits[0].float(), -1).cpu()
            got = torch.tensor([[d[t].logprob for t in range(256)] for d in o.prompt_logprobs[1:]])
            torch.testing.assert_close(got, ref[:-1], atol=1e-3, rtol=0)
            gen = hf.generate(torch.tensor([p], device='cuda'), max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert o.outputs[0].token_ids == gen[0, len(p) :].tolist()
