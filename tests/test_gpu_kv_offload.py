"""The CPU tier for KV blocks (notebook 10a_kv_offload) on a GPU: its side stream and events, and the engine with
async scheduling and CUDA graphs against an unlimited pool. Skipped without CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


def test_store_then_reuse_then_load():
    "A block rewritten right after its store (the compute stream waits for it) comes back from the tier unchanged."
    from cvllm_lab.engine.kv_offload import CpuKVTier

    kc = torch.randn(2, 6, 256, 8, 128, device='cuda')  # 2 MiB a block: a copy the overwrite could overtake
    t = CpuKVTier([[(kc, 1)]], 4)
    assert t.groups[0][0][2].is_pinned() and t.stream is not None
    for _ in range(5):
        orig = kc[:, 3].clone()
        t.store(0, b'x', 3)
        t.before_reuse(3)
        kc[:, 3].fill_(7.0)  # the slot's next owner writes it
        t.load(0, b'x', 5)
        torch.cuda.synchronize()
        assert torch.equal(kc[:, 5], orig)
        t.reset()
        kc.normal_()


@pytest.mark.parametrize('eager', [False, True])
def test_engine_with_tier_matches_unlimited_pool(eager):
    "More distinct prefixes than the device pool holds: equal greedy tokens and log-probs, blocks loaded back, none leaked."
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        architectures=['LlamaForCausalLM'],
    )
    d = Path(tempfile.mkdtemp())
    LlamaForCausalLM(cfg).save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 512, (160,), generator=g).tolist() for _ in range(8)]
    order = [i for _ in range(3) for i in torch.randperm(8, generator=g).tolist()]
    prompts = [{'prompt_token_ids': prefixes[i] + torch.randint(0, 512, (5,), generator=g).tolist()} for i in order]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    kw = dict(
        progress=False,
        skip_tokenizer_init=True,
        dtype='float32',
        max_model_len=256,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        enforce_eager=eager,
    )

    def run(llm):
        return [o for i in range(0, len(prompts), 4) for o in llm.generate(prompts[i : i + 4], sp, use_tqdm=False)]

    ref_llm = LLM(str(d), kv_cache_memory=64 << 20, **kw)
    ref = run(ref_llm)
    del ref_llm
    llm = LLM(str(d), num_gpu_blocks_override=48, kv_offloading_size=0.25, **kw)
    got = run(llm)
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
            assert max(abs(b[k].logprob - a[k].logprob) for k in a) < 2e-3
    s, kv = llm.engine.stats(), llm.engine.kv
    assert s['external_prefix_cache_hits'] > 0 and s['kv_offload_loads'] > 0
    assert kv.num_free_blocks == kv.num_usable_blocks == 48
    assert len(kv.cpu_tier.lru) + len(kv.cpu_tier.free) == kv.cpu_tier.num_blocks
