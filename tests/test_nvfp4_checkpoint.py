"""NVFP4 checkpoints in ModelOpt's layout, loaded through `LLM(...)`.

A tiny random `transformers` Llama (fp32) is quantized here the way ModelOpt exports NVFP4 (`kernels.nvfp4.
quantize_nvfp4_ref`: per decoder linear `weight` uint8 `[N, K/2]` low nibble first, `weight_scale` e4m3 `[N, K/16]`,
`weight_scale_2` and `input_scale` fp32 scalars; `lm_head` excluded, `hf_quant_config.json` beside the config; the
q/k/v and gate/up shards each with their own global scale). It is loaded by `LLM(path)` and compared with the same
model whose weights are the dequantized ones, in fp32: prompt log-probs within 1e-3 and greedy tokens equal. The
dequantized weights are within FP4's bound of the original ones. A tiny Qwen3-MoE with NVFP4 attention and
per-expert NVFP4 experts (ModelOpt's config.json form, `quant_method: modelopt`) likewise.
"""

import json

import pytest
import torch
from helpers import tiny_tokenizer
from safetensors.torch import save_file

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.kernels.nvfp4 import NVFP4_GROUP, dequantize_nvfp4_ref, quantize_nvfp4_ref
from cvllm_lab.quant.nvfp4 import NVFP4Linear

V, H, I = 256, 64, 128
PROMPTS = [[5, 9, 33, 7, 100, 2, 61, 18, 240, 3, 77], [17, 4, 200, 150, 9, 9, 31]]


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    "(nvfp4 folder, dequantized fp32 folder, original fp32 state dict, dequantized state dict)."
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=['LlamaForCausalLM'],
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('v_proj.weight') or n.endswith('up_proj.weight'):
                p.mul_(3.0)  # shards of one fused layer with different global scales
    sd = {k: v.float().contiguous() for k, v in hf.state_dict().items()}
    q_dir, d_dir = tmp_path_factory.mktemp('nvfp4'), tmp_path_factory.mktemp('dequant')
    for d in (q_dir, d_dir):
        hf.save_pretrained(d)
        tiny_tokenizer(V).save_pretrained(d)
    out, deq = {}, {}
    for k, v in sd.items():
        if '.layers.' not in k or not k.endswith('_proj.weight'):
            out[k] = deq[k] = v
            continue
        q, s, gs = quantize_nvfp4_ref(v)
        base = k[: -len('weight')]
        out |= {
            k: q,
            base + 'weight_scale': s,
            base + 'weight_scale_2': gs.reshape(()),
            base + 'input_scale': torch.tensor(0.01),
        }
        deq[k] = dequantize_nvfp4_ref(q, s, gs)
    for f in q_dir.glob('*.safetensors'):
        f.unlink()
    save_file(out, q_dir / 'model.safetensors')
    save_file(deq, d_dir / 'model.safetensors', metadata={'format': 'pt'})
    hq = {
        'producer': {'name': 'modelopt', 'version': 'test'},
        'quantization': {
            'quant_algo': 'NVFP4',
            'kv_cache_quant_algo': None,
            'group_size': 16,
            'exclude_modules': ['lm_head'],
        },
    }
    (q_dir / 'hf_quant_config.json').write_text(json.dumps(hq))
    return q_dir, d_dir, sd, deq


def _run(path, **kw):
    kw = (
        dict(block_size=4, max_model_len=64, num_gpu_blocks_override=64)
        if kw.get('device') != 'cuda'
        else dict(block_size=16, max_model_len=64, kv_cache_memory=64 << 20)
    ) | kw
    llm = LLM(str(path), dtype='float32', progress=False, enable_prefix_caching=True, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate([{'prompt_token_ids': p} for p in PROMPTS], sp, use_tqdm=False)
    lps = [torch.tensor([[d[t].logprob for t in range(V)] for d in o.prompt_logprobs[1:]]) for o in outs]
    return llm, lps, [list(o.outputs[0].token_ids) for o in outs]


def test_quantization_error_within_fp4_bound(ckpts):
    "Each dequantized weight within half the largest FP4 step (2) of its group's unit, and about FP4's RMS error."
    _, _, sd, deq = ckpts
    for k, d in deq.items():
        if d is sd[k]:
            continue
        w = sd[k]
        q, s, gs = quantize_nvfp4_ref(w)
        unit = (s.float() * gs).repeat_interleave(NVFP4_GROUP, 1)
        assert ((d - w).abs() <= unit + 1e-9).all(), k
        rel = ((d - w).norm() / w.norm()).item()
        assert 0.03 < rel < 0.15, (k, rel)


def test_nvfp4_checkpoint_through_llm(ckpts):
    "The NVFP4 folder through LLM: layers kept 4-bit, log-probs within 1e-3 of the dequantized fp32 model, tokens equal."
    q_dir, d_dir, sd, deq = ckpts
    llm, lq, tq = _run(q_dir)
    lay = [m for m in llm.engine.runner.model.modules() if isinstance(m, NVFP4Linear)]
    assert len(lay) == 2 * 4  # qkv, o, gate_up, down in each layer
    qkv = next(m for m in lay if m.shard_ids == ['q', 'k', 'v'])
    assert qkv.row_scale.unique().numel() == 3  # q, k and v each keep their own global scale
    assert torch.equal(qkv.dequantize(), torch.cat([deq[f'model.layers.0.self_attn.{p}_proj.weight'] for p in 'qkv']))
    assert qkv.input_scale.item() == pytest.approx(0.01) and qkv.act_quant is None  # kept, unused: weight-only
    x = torch.randn(3, H)
    for m in lay[:4]:  # the Triton kernel (interpreter on CPU) on the loaded layers, against their CPU forward
        xi = x if m.input_size == H else torch.randn(3, m.input_size)
        assert (m.forward_kernel(xi) - m(xi)).abs().max().item() < 1e-5
    _, ld, td = _run(d_dir)
    for a, b in zip(lq, ld):
        assert (a - b).abs().max().item() < 1e-3
    assert tq == td
    _, _, tq2 = _run(q_dir, quantization='modelopt_fp4')  # vLLM's name for it is accepted
    assert tq2 == tq
    with pytest.raises(ValueError, match='already quantized'):
        _run(q_dir, quantization='gptq')


def test_nvfp4_moe_checkpoint_through_llm(tmp_path):
    """A Qwen3-MoE with NVFP4 attention and experts (per-expert tensors, as ModelOpt exports them; the router and
    `lm_head` excluded): the experts kept 4-bit in `NvFp4MoEMethod`, log-probs within 1e-3 of the dequantized fp32
    model and tokens equal."""
    from helpers import tiny_qwen3_moe

    from cvllm_lab.quant.nvfp4 import NvFp4MoEMethod

    _, hf, _ = tiny_qwen3_moe(hidden=64, head_dim=16)
    q_dir, d_dir = tmp_path / 'nvfp4', tmp_path / 'dequant'
    for d in (q_dir, d_dir):
        hf.save_pretrained(d)
        tiny_tokenizer(V).save_pretrained(d)
        for f in d.glob('*.safetensors'):
            f.unlink()
    out, deq = {}, {}

    def put(k, w):
        q, s, gs = quantize_nvfp4_ref(w.contiguous())
        base = k[: -len('weight')]
        out.update(
            {k: q, base + 'weight_scale': s, base + 'weight_scale_2': gs, base + 'input_scale': torch.tensor(0.01)}
        )
        deq[k] = dequantize_nvfp4_ref(q, s, gs)

    for k, v in hf.state_dict().items():  # per-expert tensors, as checkpoints (and ModelOpt's export) name them
        v = v.float()
        if k.endswith(('experts.gate_up_proj', 'experts.down_proj')):
            names = ('gate_proj', 'up_proj') if k.endswith('gate_up_proj') else ('down_proj',)
            for e in range(v.shape[0]):
                for name, w in zip(names, v[e].chunk(len(names))):
                    put(f'{k.rpartition(".")[0]}.{e}.{name}.weight', w)
        elif '.layers.' in k and k.endswith('_proj.weight'):
            put(k, v)
        else:
            out[k] = deq[k] = v.contiguous()
    save_file(out, q_dir / 'model.safetensors')
    save_file(deq, d_dir / 'model.safetensors', metadata={'format': 'pt'})
    cfg = json.loads((q_dir / 'config.json').read_text())
    cfg['quantization_config'] = {
        'quant_method': 'modelopt',
        'quant_algo': 'NVFP4',
        'group_size': 16,
        'ignore': ['lm_head', '*.mlp.gate'],
    }
    (q_dir / 'config.json').write_text(json.dumps(cfg))
    llm, lq, tq = _run(q_dir)
    moes = [
        m for m in llm.engine.runner.model.modules() if isinstance(getattr(m, 'quant_method', None), NvFp4MoEMethod)
    ]
    assert len(moes) == 2 and moes[0].w13_weight.dtype == torch.uint8
    assert sum(isinstance(m, NVFP4Linear) for m in llm.engine.runner.model.modules()) == 2 * 2  # qkv, o per layer
    _, ld, td = _run(d_dir)
    for a, b in zip(lq, ld):
        assert (a - b).abs().max().item() < 1e-3
    assert tq == td


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_nvfp4_checkpoint_on_gpu(ckpts):
    "On CUDA the NVFP4 layers run the Triton kernels (row kernel for decode, tiles for the prompt): fp32, 1e-3, tokens equal."
    q_dir, d_dir, _, _ = ckpts
    _, lq, tq = _run(q_dir, device='cuda')
    _, ld, td = _run(d_dir, device='cuda')
    for a, b in zip(lq, ld):
        assert (a - b).abs().max().item() < 1e-3
    assert tq == td
