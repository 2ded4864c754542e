"""gpt-oss through the engine at the bench shape (conf/model/gpt_oss_20b.yaml), shrunk, with dummy weights on the
CPU: the config's fields survive (alternating windows, sinks, biased clamped-SwiGLU experts, YaRN), and a batch
gives what each prompt gives alone. The numerics against `transformers` are in notebook 33b_gpt_oss."""

import torch

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.layers.fused_moe import FusedMoE

from helpers import bench_model_dir

SHRINK = dict(
    num_hidden_layers=2,
    layer_types=['sliding_attention', 'full_attention'],
    hidden_size=64,
    intermediate_size=32,
    num_local_experts=8,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
)


def test_bench_shape_config_is_the_real_one():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bench_model_dir('gpt_oss_20b'))
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.sliding_window, cfg.head_dim) == (32, 4, 128, 64)
    assert cfg.layer_types[:2] == ['sliding_attention', 'full_attention'] and len(cfg.layer_types) == 24
    assert cfg.rope_parameters['rope_type'] == 'yarn' and cfg.swiglu_limit == 7.0


def test_bench_shape_builds_with_dummy_weights():
    llm = LLM(
        str(bench_model_dir('gpt_oss_20b', SHRINK)),
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
    assert type(model).__name__ == 'GptOssForCausalLM'
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all((m.num_experts, m.top_k, m.activation) == (8, 4, 'swigluoai') for m in moes)
    assert moes[0].w13_bias.shape == (8, 64) and moes[0].w2_bias.shape == (8, 64)
    attn = [l.self_attn.attn for l in model.model.layers]
    assert [a.sliding_window for a in attn] == [8, None] and attn[0].sinks.shape == (4,)
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 512, (n,), generator=g).tolist()} for n in (3, 19, 11)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 6 for t in together)
    assert together == [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
