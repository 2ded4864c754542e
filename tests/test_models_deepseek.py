"""DeepSeek V2/V3 (MLA + MoE) through the engine: the DeepSeek-V2-Lite bench shape (conf/model/deepseek_v2_lite.yaml)
built with dummy weights at a shrunken scale on the CPU, tiny models with a word-level tokenizer built offline, preemption by recompute over the latent cache, and, on a GPU
(`-m cuda`), tiny random V2/V3 models on the Triton path (MLA decode kernel, fused MoE, CUDA graphs) against
`transformers`, and the real V2-Lite shape's graph decode with its latent cache."""

import tempfile
from pathlib import Path

import pytest
import torch

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.layers.fused_moe import FusedMoE
from cvllm_lab.layers.mla import MLAAttention

from helpers import bench_model_dir, tiny_tokenizer


SHRINK = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=16,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
)


def tiny_hf(v3: bool, seed: int = 0):
    "A tiny random HF DeepSeek model (3 layers, the first dense; routers and norms randomised), saved with a tokenizer."
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    base = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if v3:
        cfg = DeepseekV3Config(
            **base, q_lora_rank=48, routed_scaling_factor=2.5, architectures=['DeepseekV3ForCausalLM']
        )
    else:
        cfg = DeepseekV2Config(
            **base, q_lora_rank=None, topk_method='group_limited_greedy', architectures=['DeepseekV2ForCausalLM']
        )
    torch.manual_seed(seed)
    hf = (DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM)(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n:
                p.normal_(1, 0.3)
            elif '.gate.' in n:
                p.normal_(0, 0.3)
        for n, b in hf.named_buffers():
            if 'e_score_correction_bias' in n:
                b.normal_(0, 0.1)
    d = Path(tempfile.mkdtemp())
    hf.save_pretrained(d)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(d)
    return hf, d


def test_bench_shape_builds_with_dummy_weights():
    "The bench config's fields survive (no q LoRA, top-6 of 16, 2 shared experts, the first layer dense); batched = alone."
    llm = LLM(
        str(bench_model_dir('deepseek_v2_lite', SHRINK)),
        load_format='dummy',
        skip_tokenizer_init=True,
        dtype='float32',
        progress=False,
        max_model_len=256,
        kv_cache_memory=8 << 20,
        block_size=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
    )
    runner = llm.engine.runner
    model = runner.model
    assert type(model).__name__ == 'DeepseekV2ForCausalLM'
    assert type(model.model.layers[0].mlp).__name__ == 'LlamaMLP'
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all((m.num_experts, m.top_k, m.renormalize) == (16, 6, False) for m in moes)
    assert model.model.layers[1].mlp.shared_experts.gate_up_proj.weight.shape == (2 * 2 * 32, 64)
    attn = model.attention_layers()
    assert all(isinstance(a, MLAAttention) and a.q_lora_rank is None and hasattr(a, 'q_proj') for a in attn)
    assert all(c.shape[1:] == (4, 32 + 16) for c in runner.kv_caches)
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 512, (n,), generator=g).tolist()} for n in (3, 19, 11)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 6 for t in together)
    assert together == [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_bench_shape_config_is_the_real_one():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bench_model_dir('deepseek_v2_lite'))
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.kv_lora_rank,
        cfg.q_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_shared_experts,
        cfg.moe_intermediate_size,
        cfg.first_k_dense_replace,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (27, 2048, 16, 512, None, 64, 128, 128, 64, 6, 2, 1408, 1, 10944, 102400)
    assert cfg.rope_parameters['rope_type'] == 'yarn' and cfg.rope_parameters['mscale_all_dim'] == 0.707


def test_preemption_over_the_latent_cache():
    """Too few latent blocks for four sequences at once: the scheduler preempts (recompute) and the greedy tokens
    equal those of a run with room for everything."""
    hf, d = tiny_hf(v3=True, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (14, 21, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(progress=False, block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16, max_model_len=48)
    roomy = LLM(str(d), num_gpu_blocks_override=64, **kw)
    tight = LLM(str(d), num_gpu_blocks_override=14, **kw)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, sp, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0 and roomy.engine.scheduler.num_preemptions == 0
    assert got == want


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.cuda
@pytest.mark.parametrize('v3', [False, True])
def test_tiny_deepseek_triton_path_through_engine(v3):
    """Tiny random V2 / V3 on CUDA in fp32 (Triton MLA decode and cache write, Triton paged attention for prefill,
    fused MoE, CUDA graphs) against `transformers` on the CPU: prompt log-probs within 1e-3 and 12 greedy tokens."""
    hf, d = tiny_hf(v3)
    llm = LLM(
        str(d),
        device='cuda',
        dtype='float32',
        progress=False,
        block_size=16,
        prefill_chunk_size=16,
        max_num_batched_tokens=32,
        kv_cache_memory=64 << 20,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    assert llm.engine.runner.graphs, 'decode ran without CUDA graphs'
    assert all(a.backend == 'triton' for a in llm.engine.runner.model.attention_layers())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 41, 23, 300)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True), use_tqdm=False
    )
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]
            got = torch.tensor([[d[t].logprob for t in range(256)] for d in o.prompt_logprobs[1:]])
            torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
            gen = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert o.outputs[0].token_ids == gen[0, len(p) :].tolist()


@pytest.mark.cuda
def test_deepseek_v2_lite_decode_on_gpu():
    """The real V2-Lite shape in bf16 with dummy weights: builds, captures CUDA graphs, decodes a batch of 64; its
    cache is one [kv_lora_rank + qk_rope_head_dim] bf16 row per token and layer (1,152 bytes)."""
    from cvllm_lab.utils.context import kv_bytes_per_token

    llm = LLM(
        str(bench_model_dir('deepseek_v2_lite')),
        load_format='dummy',
        skip_tokenizer_init=True,
        progress=False,
        max_model_len=2048,
        max_num_seqs=64,
    )
    runner = llm.engine.runner
    assert all(c.shape[1:] == (runner.block_size, 576) and c.dtype == torch.bfloat16 for c in runner.kv_caches)
    assert sum(kv_bytes_per_token(a, torch.bfloat16) for a in runner.model.attention_layers()) == 27 * 1152
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 102400, (64,), generator=g).tolist()} for _ in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert runner.graphs, 'decode ran without CUDA graphs'
