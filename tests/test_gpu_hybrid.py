"""Hybrid Gated-DeltaNet models on a GPU, end to end: our engine (Triton GDN and attention kernels, state slots,
CUDA graphs, steps launched ahead) against `transformers` on the same device, and against itself eager, alone,
batched and preempted. Skipped without CUDA; a family whose class this `transformers` lacks is skipped by name."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V = 1024
BASE = dict(
    vocab_size=V,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,  # three GDN layers, one gated-attention layer (the models' default pattern)
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    eos_token_id=None,
    bos_token_id=None,
)
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512)
FAMILIES = {
    'qwen3_next': ('Qwen3NextConfig', 'Qwen3NextForCausalLM', MOE),
    'qwen3_5': ('Qwen3_5TextConfig', 'Qwen3_5ForCausalLM', {}),
    'qwen3_5_moe': ('Qwen3_5MoeTextConfig', 'Qwen3_5MoeForCausalLM', MOE),
}


def _model(kind):
    import transformers

    cfg_name, cls_name, extra = FAMILIES[kind]
    if not hasattr(transformers, cls_name):
        pytest.skip(f'transformers {transformers.__version__} has no {cls_name}')
    cls = getattr(transformers, cls_name)
    cfg = getattr(transformers, cfg_name)(**BASE, **extra)
    cfg.architectures = [cls_name]
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():  # decay rates and norms spread out, as in a trained model (the init leaves them uniform)
        for n, p in m.named_parameters():
            if 'norm' in n or n.endswith(('A_log', 'dt_bias')):
                p.normal_(0, 0.5)
    d = Path(tempfile.mkdtemp())
    m.save_pretrained(d)
    return m, d


def _llm(d, dtype='float32', **kw):
    from cvllm_lab import LLM

    args = dict(
        progress=False,
        device='cuda',
        dtype=dtype,
        skip_tokenizer_init=True,
        kv_cache_memory=256 << 20,
        block_size=16,
        prefill_chunk_size=64,
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    return LLM(str(d), **{**args, **kw})


def _prompts(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [{'prompt_token_ids': torch.randint(0, V, (n,), generator=g).tolist()} for n in lens]


def _lp_err(o, ref):
    "Largest gap between a request's prompt log-probs (its top 5 per position) and a reference's `[T, V]`."
    return max(
        abs(lp.logprob - ref[i, t].item()) for i, dct in enumerate(o.prompt_logprobs[1:]) for t, lp in dct.items()
    )


@pytest.mark.parametrize('kind', list(FAMILIES))
def test_hybrid_matches_transformers_fp32(kind):
    "fp32 prompt log-probs within 2e-3 and greedy tokens equal: prompts shorter and much longer than a 64-token chunk."
    from cvllm_lab import SamplingParams

    hf, d = _model(kind)
    hf = hf.to('cuda')
    llm = _llm(d)
    prompts = _prompts(1, (7, 100, 333, 1500))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5, logprobs=0)
    with torch.no_grad():
        for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
            ids = torch.tensor([p['prompt_token_ids']], device='cuda')
            ref = torch.log_softmax(hf(ids).logits[0].float(), -1).cpu()
            assert (err := _lp_err(o, ref)) < 2e-3, (kind, ids.shape[1], err)
            gen = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, ids.shape[1] :].tolist()
            assert o.outputs[0].token_ids == gen


@pytest.mark.parametrize('kind', list(FAMILIES))
def test_hybrid_bf16_error_like_transformers_bf16(kind):
    """bf16 against the fp32 model: our prompt log-probs are about as far from it as transformers' own bf16 run is,
    on the same entries: the mean gap within 1.5x of its mean plus 0.01, the largest within 2x of its largest plus
    0.05 (random MoE routers sit on near-ties: one token routed to other experts moves its log-probs by tenths, on
    either side, so the largest gap is the noisier measure). The first greedy token is the fp32 model's wherever
    its top two are 0.1 apart."""
    from cvllm_lab import SamplingParams

    hf, d = _model(kind)
    hf = hf.to('cuda')
    llm = _llm(d, 'bfloat16')
    prompts = _prompts(1, (7, 100, 333, 1500))
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=5, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    with torch.no_grad():
        ids = [torch.tensor([p['prompt_token_ids']], device='cuda') for p in prompts]
        ref = [torch.log_softmax(hf(x).logits[0].float(), -1).cpu() for x in ids]
        hf = hf.to(torch.bfloat16)
        hf16 = [torch.log_softmax(hf(x).logits[0].float(), -1).cpu() for x in ids]
    ours, theirs = [], []
    for o, r, h in zip(outs, ref, hf16):
        for i, dct in enumerate(o.prompt_logprobs[1:]):
            for t, lp in dct.items():
                ours.append(abs(lp.logprob - r[i, t].item()))
                theirs.append(abs(h[i, t] - r[i, t]).item())
        two = r[-1].topk(2).values
        if two[0] - two[1] > 0.1:
            assert o.outputs[0].token_ids[0] == r[-1].argmax().item()
    ours, theirs = torch.tensor(ours), torch.tensor(theirs)
    assert ours.mean() <= 1.5 * theirs.mean() + 0.01, (kind, ours.mean(), theirs.mean())
    assert ours.max() <= 2 * theirs.max() + 0.05, (kind, ours.max(), theirs.max())


@pytest.mark.parametrize('kind', ['qwen3_next', 'qwen3_5'])
def test_hybrid_graphs_batching_preemption(kind):
    """fp32 greedy tokens are the same: CUDA graphs (padded rows write the scratch slot) and eager, each prompt alone
    and all together, with steps launched ahead and synchronously, and with a KV cache so small that requests are
    preempted and recomputed (their state slots freed and taken again). Every block and slot comes back."""
    from cvllm_lab import SamplingParams

    _, d = _model(kind)
    prompts = _prompts(2, (5, 60, 300, 17, 900, 2, 33))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = _llm(d)
    assert llm.engine.cfg.async_scheduling
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert together == alone
    llm.engine.cfg.async_scheduling = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == alone
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    del llm
    eager = _llm(d, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)] == alone
    del eager
    small = _llm(
        d, num_gpu_blocks_override=72, max_model_len=1024
    )  # 1,152 tokens for ~1,450 of prompts and outputs: preemption
    outs = small.generate(prompts, sp, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_state_slots_that_do_not_fit_are_refused_by_name():
    "More sequences' recurrent state than the GPU holds: one clear error naming --max-num-seqs, before allocating."
    _, d = _model('qwen3_5')
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(RuntimeError, match='lower --max-num-seqs'):
        _llm(d, kv_cache_memory=None, max_num_seqs=int(free // (3 * 4 * 8 * 64 * 64)) + 1)
    assert torch.cuda.memory_allocated() < 1 << 30  # nothing of it left behind
