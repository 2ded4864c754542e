"""LoRA on MoE experts through the engine against `transformers` + `peft`, fp32 on CPU.

A tiny random Qwen3-MoE (transformers 5's fused experts) and PEFT adapters made with `peft` itself (B random and
non-zero): `a1` rank 4 on q/k/v/o and, through `target_parameters`, on the experts' `gate_up_proj` and `down_proj`;
`a2` rank 8 with rsLoRA on the experts only (`gate_up_proj`, `down_proj`); `a2e` the same adapter written in the
per-expert layout (`experts.{e}.gate_proj` / `up_proj` / `down_proj`, transformers 4's and vLLM's naming). The base
and the adapters in one batch: prompt log-probs within 1e-4 of peft's forward and greedy tokens equal; the experts'
terms matter (without them the log-probs move by more than 1e-2); with one slot for two adapters, swapped.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

peft = pytest.importorskip('peft')

from cvllm_lab import LLM, SamplingParams  # noqa: E402
from cvllm_lab.engine.lora_manager import LoRARequest  # noqa: E402

V, STEPS, E = 256, 6, 16
SP = SamplingParams(temperature=0, max_tokens=STEPS, prompt_logprobs=-1, ignore_eos=True)
EXPERTS = ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']
ADAPTERS = {  # name: (rank, alpha, target_modules, target_parameters, rslora)
    'a1': (4, 8, ['q_proj', 'k_proj', 'v_proj', 'o_proj'], EXPERTS, False),
    'a2': (8, 16, [], EXPERTS, True),
}


def per_expert_copy(src: Path, dst: Path):
    "Write `src`'s fused expert tensors in the per-expert layout (`experts.{e}.gate_proj.lora_A.weight`, ...)."
    from safetensors.torch import load_file

    t, out = load_file(str(src / 'adapter_model.safetensors')), {}
    cfg = json.loads((src / 'adapter_config.json').read_text())
    r = cfg['r']
    for k, a in t.items():
        if '.lora_A.' not in k:
            continue
        mod = k.split('.lora_A.')[0]
        b = t[k.replace('.lora_A.', '.lora_B.')]
        A, B = a.reshape(E, r, -1), b.reshape(b.shape[0], r, E).permute(2, 0, 1)  # PEFT's ParamWrapper layout
        head = mod.split('.experts')[0] + '.experts'
        H, out_rows = A.shape[2], B.shape[1]
        for e in range(E):
            if out_rows != H:  # gate_up_proj: gate rows then up rows, one A
                I = out_rows // 2
                for name, rows in (('gate_proj', slice(0, I)), ('up_proj', slice(I, 2 * I))):
                    out[f'{head}.{e}.{name}.lora_A.weight'] = A[e].clone()
                    out[f'{head}.{e}.{name}.lora_B.weight'] = B[e, rows].clone()
            else:
                out[f'{head}.{e}.down_proj.lora_A.weight'] = A[e].contiguous()
                out[f'{head}.{e}.down_proj.lora_B.weight'] = B[e].contiguous()
    dst.mkdir()
    save_file(out, str(dst / 'adapter_model.safetensors'))
    cfg.update(target_parameters=None, target_modules=['gate_proj', 'up_proj', 'down_proj'])
    (dst / 'adapter_config.json').write_text(json.dumps(cfg))


@torch.no_grad()
def reference(model, prompt):
    ids = torch.tensor([prompt])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    for _ in range(STEPS):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt) :].tolist(), lp


def build():
    "The model folder and adapters (the fixture `setup`; the GPU tests reuse it)."
    from helpers import tiny_qwen3_moe
    from transformers import Qwen3MoeForCausalLM

    _, hf, d = tiny_qwen3_moe(hidden=64, head_dim=16)
    refs, reqs = {None: hf}, {None: None}
    for k, (name, (r, alpha, mods, params, rs)) in enumerate(ADAPTERS.items(), 1):
        torch.manual_seed(10 + k)
        m = peft.get_peft_model(
            Qwen3MoeForCausalLM.from_pretrained(d).eval(),
            peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=mods, target_parameters=params, use_rslora=rs),
        )
        with torch.no_grad():
            for n, p in m.named_parameters():
                if 'lora_B' in n:
                    p.normal_(0, 0.3)
        m.save_pretrained(d / name)
        refs[name], reqs[name] = m.eval(), LoRARequest(name, k, str(d / name))
    per_expert_copy(d / 'a2', d / 'a2e')
    refs['a2e'], reqs['a2e'] = refs['a2'], LoRARequest('a2e', 3, str(d / 'a2e'))
    return d, refs, reqs


@pytest.fixture(scope='module')
def setup():
    return build()


def engine(d, **kw):
    kw = (
        dict(block_size=4, max_model_len=64, num_gpu_blocks_override=96, max_lora_rank=8, max_num_batched_tokens=32)
        | kw
    )
    return LLM(str(d), dtype='float32', progress=False, skip_tokenizer_init=True, enable_lora=True, **kw)


def check(outs, prompts, names, refs, tol=1e-4):
    errs = []
    for o, p, n in zip(outs, prompts, names):
        toks, lp = reference(refs[n], p)
        got = torch.tensor([[x[t].logprob for t in range(V)] for x in o.prompt_logprobs[1:]])
        errs.append((got - lp).abs().max().item())
        assert o.outputs[0].token_ids == toks, n
    assert max(errs) < tol, errs
    return errs


def test_expert_terms_matter(setup):
    "peft's adapters move the log-probs, and a1 without its expert terms is far from a1: the checks can fail."
    d, refs, _ = setup
    p = list(range(3, 17))
    lp = {n: reference(refs[n], p)[1] for n in (None, 'a1', 'a2')}
    assert (lp['a1'] - lp[None]).abs().max() > 0.05 and (lp['a2'] - lp[None]).abs().max() > 0.05
    m = refs['a2']
    with m.disable_adapter():
        assert (reference(m, p)[1] - lp[None]).abs().max() < 1e-5


def test_mixed_batch(setup):
    "Base, a1, a2 and the per-expert a2e in one batch (max_loras=3)."
    d, refs, reqs = setup
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 13, 11, 7, 10)]
    prompts[4] = prompts[2]
    names = [None, 'a1', 'a2', 'a1', 'a2e']
    llm = engine(d, max_loras=3)
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[reqs[n] for n in names])
    check(outs, prompts, names, refs)
    mgr = llm.engine.runner.lora_manager
    assert mgr.loads == 3 and sum('experts' in n for n in mgr.layers) == 2


def test_one_slot_swapping(setup):
    "max_loras=1: a1 and a2 take turns in the one slot."
    d, refs, reqs = setup
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (8, 12, 6)]
    names = ['a2', 'a1', None]
    llm = engine(d, max_loras=1)
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[reqs[n] for n in names])
    check(outs, prompts, names, refs)
    assert llm.engine.runner.lora_manager.loads >= 2


def test_refused_experts(setup):
    "Quantized experts are not wrapped: an adapter with expert tensors is refused by name, attention ones still load."
    d, _, reqs = setup
    llm = engine(d, quantization='fp8', max_lora_rank=8)
    mgr = llm.engine.runner.lora_manager
    assert mgr.refused and all('quantized' in v for v in mgr.refused.values())
    with pytest.raises(NotImplementedError, match='experts.*quantized'):
        mgr.add(reqs['a2'])


@pytest.mark.parametrize('arch', ['mixtral', 'qwen2_moe'])
def test_other_moe_families(arch, tmp_path):
    """Mixtral (renormalized top-2) and Qwen2-MoE (a sigmoid-gated shared expert, itself a dense SwiGLU whose
    gate/up/down take the adapter through `target_modules`): one adapter on attention, the shared expert and the
    routed experts (`target_parameters`), rsLoRA, with the base in the same batch, against peft (1e-4, greedy equal).
    Qwen2-MoE: naming gate/up/down makes PEFT target the experts' `gate_up_proj` at twice the rank and alpha too
    (`rank_pattern` / `alpha_pattern`), so its scaling differs from the rest's."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, eos_token_id=None, bos_token_id=None)  # fmt: skip
    if arch == 'mixtral':
        cfg = tf.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                               architectures=['MixtralForCausalLM'], **common)  # fmt: skip
        cls, mods = tf.MixtralForCausalLM, ['q_proj', 'v_proj', 'o_proj']
    else:
        cfg = tf.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                num_experts=6, num_experts_per_tok=2, architectures=['Qwen2MoeForCausalLM'], **common)  # fmt: skip
        cls, mods = tf.Qwen2MoeForCausalLM, ['q_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'gate.weight' in n:
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    torch.manual_seed(5)
    m = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=mods, target_parameters=EXPERTS, use_rslora=True)
    )
    with torch.no_grad():
        for n, p in m.named_parameters():
            if 'lora_B' in n:
                p.normal_(0, 0.3)
    m.save_pretrained(tmp_path / 'ad')
    assert any('experts' in k for k in m.state_dict() if 'lora_A' in k)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (10, 10)]
    prompts[1] = prompts[0]
    with m.disable_adapter():
        base = reference(m, prompts[0])
    llm = engine(tmp_path, max_loras=1)
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[None, LoRARequest('ad', 1, str(tmp_path / 'ad'))])
    errs = []
    for o, (toks, lp) in zip(outs, [base, reference(m.eval(), prompts[1])]):
        got = torch.tensor([[x[t].logprob for t in range(V)] for x in o.prompt_logprobs[1:]])
        errs.append((got - lp).abs().max().item())
        assert o.outputs[0].token_ids == toks
    assert max(errs) < 1e-4, errs
    assert (reference(m, prompts[1])[1] - base[1]).abs().max() > 0.05
