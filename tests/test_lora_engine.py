"""Multi-LoRA through the engine against `transformers` + `peft` (adapters merged into the weights), fp32 on CPU.

A tiny random Llama and two PEFT adapters of different ranks (made with `peft`, B random and non-zero; one with
rsLoRA on a subset of the projections): greedy tokens equal and prompt log-probs within 1e-3 of the merged reference
for the base and each adapter, all three in one batch; with one device slot for two adapters (the scheduler admits
one adapter at a time, the manager swaps); the same prompt under two adapters one after the other (the prefix cache
keys blocks by adapter, so the second does not reuse the first's KV). A tiny Qwen3-MoE with LoRA on its attention
(LoRA on its experts: tests/test_lora_moe.py).
"""

import tempfile
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip('peft')

from cvllm_lab import LLM, SamplingParams  # noqa: E402
from cvllm_lab.engine.lora_manager import LoRARequest  # noqa: E402
from cvllm_lab.engine.request import Request  # noqa: E402

V, STEPS = 256, 6
ADAPTERS = {  # name: (rank, alpha, targets, rslora)
    'a1': (4, 8, ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'], False),
    'a2': (8, 16, ['q_proj', 'v_proj', 'o_proj', 'down_proj'], True),
}


@pytest.fixture(scope='module')
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=None,
        bos_token_id=None,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    root = Path(tempfile.mkdtemp())
    base.save_pretrained(root / 'base')
    refs, reqs = {None: base}, {None: None}
    for k, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items(), 1):
        torch.manual_seed(k)
        m = peft.get_peft_model(
            LlamaForCausalLM.from_pretrained(root / 'base'),
            peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs),
        )
        with torch.no_grad():
            for n, p in m.named_parameters():
                if 'lora_B' in n:
                    p.normal_(0, 0.3)
        m.save_pretrained(root / name)
        refs[name] = m.merge_and_unload().eval()
        reqs[name] = LoRARequest(name, k, str(root / name))
    return root, refs, reqs


@torch.no_grad()
def reference(model, prompt):
    "Greedy tokens (STEPS) and the prompt's log-probs `[len - 1, V]` of `model`."
    ids = torch.tensor([prompt])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    for _ in range(STEPS):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt) :].tolist(), lp


def engine(root, **kw):
    kw = (
        dict(block_size=4, max_num_batched_tokens=32, max_model_len=64, num_gpu_blocks_override=64, max_lora_rank=8)
        | kw
    )
    return LLM(str(root / 'base'), dtype='float32', progress=False, skip_tokenizer_init=True, enable_lora=True, **kw)


SP = SamplingParams(temperature=0, max_tokens=STEPS, prompt_logprobs=-1, ignore_eos=True)


def check(outs, prompts, names, refs):
    for o, p, n in zip(outs, prompts, names):
        toks, lp = reference(refs[n], p)
        got = torch.tensor([[d[t].logprob for t in range(V)] for d in o.prompt_logprobs[1:]])
        assert o.outputs[0].token_ids == toks, n
        assert (got - lp).abs().max().item() < 1e-3, n


def test_adapters_change_outputs(setup):
    "The references differ (the adapters matter), so the comparisons below can fail."
    _, refs, _ = setup
    p = list(range(3, 15))
    lps = [reference(refs[n], p)[1] for n in (None, 'a1', 'a2')]
    assert min((lps[i] - lps[j]).abs().max() for i, j in ((0, 1), (0, 2), (1, 2))) > 0.05


def test_mixed_batch(setup):
    "Base and both adapters in one batch (max_loras=2), interleaved, one prompt repeated under each."
    root, refs, reqs = setup
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 14, 9, 5, 11)]
    prompts[2] = prompts[0]
    names = [None, 'a1', 'a2', 'a2', 'a1']
    llm = engine(root, max_loras=2)
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[reqs[n] for n in names])
    check(outs, prompts, names, refs)
    assert llm.engine.runner.lora_manager.loads == 2


def test_swapping_and_prefix_cache(setup):
    "More adapters than slots (max_loras=1): one adapter at a time, swapped; the same prompt under a1 then a2."
    root, refs, reqs = setup
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (10, 7, 12, 10)]
    names = ['a1', 'a2', None, 'a1']
    llm = engine(root, max_loras=1)
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[reqs[n] for n in names])
    check(outs, prompts, names, refs)
    mgr = llm.engine.runner.lora_manager
    assert mgr.loads >= 2 and len(mgr.slot_of) == 1
    # without prompt log-probs a request may start from cached blocks: prompt 0's are cached under a1 only
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    p = prompts[0]
    for n, hit in (('a2', 0), ('a1', 8), (None, 0)):
        o = llm.generate([p], sp, use_tqdm=False, lora_request=reqs[n])[0]
        assert o.num_cached_tokens == hit and o.outputs[0].token_ids == reference(refs[n], p)[0], n


def test_block_hashes_keyed_by_adapter(setup):
    _, _, reqs = setup
    sp = SamplingParams(max_tokens=1)
    h = lambda lr: Request('r', list(range(12)), sp, block_size=4, lora_request=lr).block_hashes
    assert h(None) != h(reqs['a1']) != h(reqs['a2']) and h(reqs['a1']) == h(LoRARequest('x', 1, ''))
    assert len(h(None)) == 3


def test_refusals(setup):
    root, _, reqs = setup
    llm = LLM(str(root / 'base'), dtype='float32', progress=False, skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(ValueError, match='enable_lora'):
        llm.generate([[1, 2, 3]], SP, use_tqdm=False, lora_request=reqs['a1'])
    lora = engine(root, max_lora_rank=4)
    with pytest.raises(ValueError, match='max_lora_rank'):
        lora.generate([[1, 2, 3]], SP, use_tqdm=False, lora_request=reqs['a2'])


def test_qwen3_moe_attention_lora():
    """A tiny Qwen3-MoE with a rank-8 adapter on q/k/v/o only (its experts wrapped, their slots empty, so the
    experts run their base path): the base and the adapter in one batch."""
    from helpers import tiny_qwen3_moe

    _, hf, d = tiny_qwen3_moe(hidden=64, head_dim=16)
    torch.manual_seed(3)
    m = peft.get_peft_model(
        hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])
    )
    with torch.no_grad():
        for n, p in m.named_parameters():
            if 'lora_B' in n:
                p.normal_(0, 0.3)
    m.save_pretrained(d / 'ad')
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 13)]
    with m.disable_adapter():
        base = [reference(m, p) for p in prompts]
    merged = m.merge_and_unload().eval()
    refs = [base[0], reference(merged, prompts[1])]
    assert (refs[1][1] - base[1][1]).abs().max() > 0.05  # the adapter matters
    llm = LLM(str(d), dtype='float32', progress=False, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8,
              block_size=4, max_model_len=64, num_gpu_blocks_override=64)  # fmt: skip
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[None, LoRARequest('ad', 1, str(d / 'ad'))])
    for o, (toks, lp) in zip(outs, refs):
        got = torch.tensor([[x[t].logprob for t in range(V)] for x in o.prompt_logprobs[1:]])
        assert o.outputs[0].token_ids == toks and (got - lp).abs().max().item() < 1e-3
