"""EAGLE-3 speculative decoding (issue 43, notebook 51f) on a GPU: a tiny random fp32 Llama target and a tiny EAGLE-3
head written in the public layout (config.json with `LlamaForCausalLMEagle3`, safetensors with `fc`, `midlayer.*`,
`norm`, `lm_head` over a draft vocabulary, `d2t`, `t2d`); greedy output with EAGLE-3 (k = 1 and 3) equals greedy
output without, token for token (with EAGLE-3 the runner stays eager; without, decode steps replay CUDA graphs); a
head made to copy the target's own prediction on a target whose last layer adds nothing gets drafts accepted.
Skipped without CUDA."""

import json
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

DEVICE = 'cuda'
V, H, L, I, D = 1024, 128, 7, 256, 32


def _target(copying: bool) -> tuple[str, dict]:
    "A random 7-layer Llama with a peaked LM head (`copying`: it often repeats a token, its last layer adds nothing)."
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=256,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd['lm_head.weight'] *= 10
    if copying:
        sd['lm_head.weight'] += 2 * sd['model.embed_tokens.weight']
        for n in ('self_attn.o_proj', 'mlp.down_proj'):
            sd[f'model.layers.{L - 1}.{n}.weight'].zero_()
    m.load_state_dict(sd)
    d = tempfile.mkdtemp()
    m.save_pretrained(d)
    return d, sd


def _head(sd: dict, copying: bool) -> str:
    "An EAGLE-3 head folder: random, or (`copying`) one whose draft is the target's prediction at its row."
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    rn = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5
    Vd = V if copying else 768
    sel = torch.randperm(V, generator=g)[:Vd] if copying else torch.randperm(V, generator=g)[:Vd].sort().values
    W = {
        'fc.weight': torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1) if copying else rn(H, 3 * H),
        'midlayer.input_layernorm.weight': torch.ones(H),
        'midlayer.hidden_norm.weight': torch.ones(H),
        'midlayer.self_attn.q_proj.weight': rn(4 * D, 2 * H),
        'midlayer.self_attn.k_proj.weight': rn(2 * D, 2 * H),
        'midlayer.self_attn.v_proj.weight': rn(2 * D, 2 * H),
        'midlayer.self_attn.o_proj.weight': torch.zeros(H, 4 * D) if copying else rn(H, 4 * D),
        'midlayer.post_attention_layernorm.weight': torch.ones(H),
        'midlayer.mlp.gate_proj.weight': rn(I, H),
        'midlayer.mlp.up_proj.weight': rn(I, H),
        'midlayer.mlp.down_proj.weight': torch.zeros(H, I) if copying else rn(H, I),
        'norm.weight': sd['model.norm.weight'].clone(),
        'lm_head.weight': sd['lm_head.weight'][sel].clone(),
        'd2t': sel - torch.arange(Vd),
        't2d': torch.zeros(V, dtype=torch.bool).index_fill_(0, sel, True),
    }
    cfg = dict(
        architectures=['LlamaForCausalLMEagle3'],
        model_type='llama',
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        vocab_size=V,
        draft_vocab_size=Vd,
    )
    if copying:
        cfg['eagle_aux_hidden_state_layer_ids'] = [2, 3, L - 1]
    d = Path(tempfile.mkdtemp())
    (d / 'config.json').write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in W.items()}, str(d / 'model.safetensors'), metadata={'format': 'pt'})
    return str(d)


def _run(target: str, spec, prompts) -> tuple[list, dict]:
    from cvllm_lab import LLM, SamplingParams

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
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    res = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)
    out, st = [o.outputs[0].token_ids for o in res], llm.engine.core.stats()
    del llm
    torch.cuda.empty_cache()
    return out, st


@pytest.mark.parametrize('copying', [False, True])
def test_eagle3_greedy_equals_plain_greedy(copying):
    target, sd = _target(copying)
    head = _head(sd, copying)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 40, 200)]
    ref, _ = _run(target, None, prompts)
    for k in (1, 3):
        got, st = _run(target, dict(method='eagle3', model=head, num_speculative_tokens=k), prompts)
        assert got == ref
        assert st['spec_decode_num_draft_tokens'] > 0
        assert sum(st['spec_decode_num_accepted_tokens_per_pos']) == st['spec_decode_num_accepted_tokens']
        if copying:  # the head drafts the token just sampled: accepted where the target repeats it
            assert 0 < st['spec_decode_num_accepted_tokens'] < st['spec_decode_num_draft_tokens']
