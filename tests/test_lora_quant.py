"""LoRA over quantized base layers (QLoRA-style serving), fp32 on CPU through `LLM`.

A tiny random Llama quantized in situ (`quantization='fp8'`, 128 x 128 blocks, `'w4a16'`, group 128, GGUF `'q4_0'`
and `'mxfp4'`) with a PEFT adapter (made with `peft`, B random and non-zero) on every projection: prompt log-probs of
the base and of the adapter in one batch against a plain-PyTorch reference, transformers' Llama whose weights are the engine's
dequantized quantized weights plus, for the adapter, `scaling * B @ A` of each projection; greedy tokens equal that
reference and differ from the base's. A gate/up layer whose quantized GEMV applies the activation is refused.
"""

import tempfile
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip('peft')

from cvllm_lab import LLM, SamplingParams  # noqa: E402
from cvllm_lab.engine.lora_manager import LoRARequest  # noqa: E402

V, STEPS = 256, 6
TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
SP = SamplingParams(temperature=0, max_tokens=STEPS, prompt_logprobs=-1, ignore_eos=True)


def build():
    "The model folder and adapters (the fixture `setup`; the GPU tests reuse it)."
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
        architectures=['LlamaForCausalLM'],
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    root = Path(tempfile.mkdtemp())
    base.save_pretrained(root / 'base')
    torch.manual_seed(1)
    m = peft.get_peft_model(
        LlamaForCausalLM.from_pretrained(root / 'base'),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, use_rslora=True),
    )
    with torch.no_grad():
        for n, p in m.named_parameters():
            if 'lora_B' in n:
                p.normal_(0, 0.3)
    m.save_pretrained(root / 'ad')
    deltas = {}  # checkpoint module name -> scaling * B @ A
    for n, mod in m.named_modules():
        if hasattr(mod, 'lora_A') and 'default' in mod.lora_A:
            a, b = mod.lora_A['default'].weight, mod.lora_B['default'].weight
            deltas[n.removeprefix('base_model.model.')] = mod.scaling['default'] * (b @ a).detach()
    return root, base, deltas


SPLITS = {'self_attn.qkv_proj': ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'),
          'self_attn.o_proj': ('self_attn.o_proj',), 'mlp.gate_up_proj': ('mlp.gate_proj', 'mlp.up_proj'),
          'mlp.down_proj': ('mlp.down_proj',)}  # fmt: skip


@pytest.fixture(scope='module')
def setup():
    return build()


def reference_model(llm, base, deltas=None):
    "transformers' Llama with the engine's dequantized weights (plus `deltas`, the adapter's `scaling * B A`)."
    import copy

    ref = copy.deepcopy(base)
    ours = llm.engine.runner.model
    for i in range(base.config.num_hidden_layers):
        for mod, parts in SPLITS.items():
            q = ours.get_submodule(f'model.layers.{i}.{mod}').base
            for name, w in zip(parts, q.dequantize(torch.float32).split(q.output_sizes)):
                key = f'model.layers.{i}.{name}'
                ref.get_submodule(key).weight.data.copy_(w + (deltas[key] if deltas else 0))
    return ref


@torch.no_grad()
def reference(model, prompt):
    ids = torch.tensor([prompt])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    for _ in range(STEPS):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt) :].tolist(), lp


@pytest.mark.parametrize('method', ['fp8', 'w4a16', 'q4_0', 'mxfp4'])
def test_lora_on_quantized_base(setup, method):
    root, base, deltas = setup
    llm = LLM(str(root / 'base'), dtype='float32', progress=False, skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=8, quantization=method, block_size=4, max_model_len=64, num_gpu_blocks_override=64)  # fmt: skip
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert (
        type(qkv.base).__name__
        == {'fp8': 'FP8Linear', 'w4a16': 'W4A16Linear', 'q4_0': 'GGUFLinear', 'mxfp4': 'Mxfp4Linear'}[method]
    )
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (11, 9)]
    prompts += prompts
    lr = LoRARequest('ad', 1, str(root / 'ad'))
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[None, None, lr, lr])
    refs = {None: reference_model(llm, base), 'ad': reference_model(llm, base, deltas)}
    errs = []
    for o, p, n in zip(outs, prompts, [None, None, 'ad', 'ad']):
        toks, lp = reference(refs[n], p)
        got = torch.tensor([[d[t].logprob for t in range(V)] for d in o.prompt_logprobs[1:]])
        errs.append((got - lp).abs().max().item())
        assert o.outputs[0].token_ids == toks, (method, n)
    assert max(errs) < 1e-4, errs
    # the adapter matters: its greedy tokens differ from the base's on both prompts
    assert all(outs[k].outputs[0].token_ids != outs[k + 2].outputs[0].token_ids for k in (0, 1))
    # and the quantized base matters: the float model's log-probs are further away than the tolerance
    _, lp_float = reference(base, prompts[0])
    _, lp_q = reference(refs[None], prompts[0])
    assert (lp_float - lp_q).abs().max() > 1e-3


def test_fused_activation_refused():
    from torch import nn

    from cvllm_lab.layers.basic import Linear
    from cvllm_lab.layers.lora import apply_lora
    from cvllm_lab.quant.w4a16 import W4A16Linear

    lin = Linear(128, [64, 64])
    lin.weight.data.normal_()
    q = W4A16Linear.from_linear(lin)
    q.fuse_silu_and_mul()
    net = nn.Module()
    net.gate_up_proj = q
    with pytest.raises(NotImplementedError, match='gate_up_proj.*fuse_mlp_act'):
        apply_lora(net, ['gate_up_proj'], 1, 8, 8)
