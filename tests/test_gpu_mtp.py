"""MTP speculative decoding (issue 43, notebook 51e) on a GPU: a tiny random DeepSeek-V3 (MLA, MoE) in fp32 with one
MTP layer appended to its checkpoint; greedy output with MTP (k = 1 and 3) equals greedy output without, token for
token (with MTP the runner stays eager; without, decode steps replay CUDA graphs). Skipped without CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

DEVICE = 'cuda'
V, H = 512, 128


def _model() -> str:
    "A random 3-layer DeepSeek-V3 with a peaked LM head, and layer 3 of a 4-layer one (plus MTP tensors) as its MTP layer."
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    def cfg(layers):
        c = DeepseekV3Config(
            vocab_size=V,
            hidden_size=H,
            intermediate_size=256,
            moe_intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=64,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            max_position_embeddings=1024,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            num_nextn_predict_layers=1,
        )
        c.architectures = ['DeepseekV3ForCausalLM']
        return c

    torch.manual_seed(0)
    full = DeepseekV3ForCausalLM(cfg(4)).eval()
    with torch.no_grad():
        full.lm_head.weight.mul_(10)
    d = Path(tempfile.mkdtemp())
    full.save_pretrained(d)
    cfg(3).save_pretrained(d)
    sd = load_file(str(d / 'model.safetensors'))
    sd |= {
        'model.layers.3.enorm.weight': torch.ones(H),
        'model.layers.3.hnorm.weight': torch.ones(H),
        'model.layers.3.eh_proj.weight': torch.randn(H, 2 * H) / (2 * H) ** 0.5,
        'model.layers.3.shared_head.norm.weight': torch.ones(H),
        'model.layers.3.shared_head.head.weight': full.lm_head.weight.detach().clone(),
    }
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / 'model.safetensors'), metadata={'format': 'pt'})
    return str(d)


def test_mtp_greedy_equals_plain_greedy():
    from cvllm_lab import LLM, SamplingParams

    target = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 40, 200)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs, stats = {}, {}
    for k in (None, 1, 3):
        spec = None if k is None else dict(method='mtp', num_speculative_tokens=k)
        llm = LLM(
            target,
            progress=False,
            device=DEVICE,
            dtype='float32',
            skip_tokenizer_init=True,
            kv_cache_memory=256 << 20,
            max_num_seqs=8,
            speculative_config=spec,
        )
        res = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)
        outs[k], stats[k] = [o.outputs[0].token_ids for o in res], llm.engine.core.stats()
        del llm
        if DEVICE == 'cuda':
            torch.cuda.empty_cache()
    assert outs[1] == outs[None] and outs[3] == outs[None]
    assert stats[1]['spec_decode_num_draft_tokens'] > 0 and stats[3]['spec_decode_num_draft_tokens'] > 0
