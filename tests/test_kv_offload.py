"""The CPU tier for KV blocks (notebook 10a_kv_offload) with the cache layouts the notebook does not run: an MLA
latent cache (tiny DeepSeek V2) and an FP8 cache with its per-token scales (tiny Llama), on the CPU. Each: more distinct
prefixes than the device pool holds, greedy tokens and top-5 log-probs equal to an unlimited pool, blocks loaded back
from the tier, every block of both tiers free at the end."""

import tempfile
from pathlib import Path

import pytest
import torch

from cvllm_lab import LLM, SamplingParams


def _deepseek():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=['DeepseekV2ForCausalLM'],
    )
    return DeepseekV2ForCausalLM(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=['LlamaForCausalLM'],
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize('kind,extra', [('mla', {}), ('fp8', {'kv_cache_dtype': 'fp8'})])
def test_tier_matches_unlimited_pool(kind, extra):
    torch.manual_seed(0)
    d = Path(tempfile.mkdtemp())
    (_deepseek if kind == 'mla' else _llama)().eval().save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 128, (24,), generator=g).tolist() for _ in range(6)]
    order = [i for _ in range(3) for i in torch.randperm(6, generator=g).tolist()]
    prompts = [{'prompt_token_ids': prefixes[i] + torch.randint(0, 128, (3,), generator=g).tolist()} for i in order]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    kw = dict(
        progress=False,
        skip_tokenizer_init=True,
        device='cpu',
        block_size=4,
        max_model_len=48,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        **extra,
    )

    def run(llm):
        return [o for i in range(0, len(prompts), 2) for o in llm.generate(prompts[i : i + 2], sp, use_tqdm=False)]

    ref = run(LLM(str(d), kv_cache_memory=16 << 20, **kw))
    llm = LLM(str(d), num_gpu_blocks_override=16, kv_offloading_size=1 / 256, **kw)
    tier = llm.engine.kv.cpu_tier
    if kind == 'mla':
        assert [h.dim() for _, _, h in tier.groups[0]] == [3, 3]  # latent rows [block, token, width] per layer
    else:
        assert len(tier.groups[0]) == 4  # each layer's cache and its scales
    got = run(llm)
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
            assert max(abs(b[k].logprob - a[k].logprob) for k in a) < 1e-4
    if kind == 'fp8':  # the scales travel with the rows: a round trip through the tier restores both tensors
        before = [t.select(d, 1).clone() for t, d, _ in tier.groups[0]]
        tier.store(0, b'probe', 1)
        for t, d, _ in tier.groups[0]:
            t.select(d, 1).zero_()
        tier.load(0, b'probe', 1)
        for (t, d, _), b in zip(tier.groups[0], before):
            assert torch.equal(t.select(d, 1).view(torch.uint8), b.view(torch.uint8))
    s, kv = llm.engine.stats(), llm.engine.kv
    assert s['external_prefix_cache_hits'] > 0 and s['kv_offload_loads'] > 0
    assert kv.num_free_blocks == kv.num_usable_blocks == 16
    assert len(tier.lru) + len(tier.free) == tier.num_blocks
