"""Draft-model speculative decoding (issue 43, notebook 51d) on a GPU: greedy output with a draft model equals greedy
output without, token for token, in fp32 (the target's plain decode steps replay CUDA graphs, its verification steps
and the draft's steps run eagerly); with the target as its own draft every draft is accepted. Skipped without CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V = 1024


def _save(m) -> str:
    d = Path(tempfile.mkdtemp())
    m.save_pretrained(d)
    return str(d)


def _models() -> tuple[str, str]:
    "A tiny random Llama with a peaked LM head, and its first layer alone as the draft."
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = lambda layers: LlamaConfig(
        vocab_size=V,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg(2)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(10)
    cut = LlamaForCausalLM(cfg(1)).eval()
    cut.load_state_dict(target.state_dict(), strict=False)
    return _save(target), _save(cut)


def test_draft_model_greedy_equals_plain_greedy():
    from cvllm_lab import LLM, SamplingParams

    target, cut = _models()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 40, 200)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs, stats = {}, {}
    for name, draft in (('plain', None), ('cut', cut), ('self', target)):
        spec = None if draft is None else dict(method='draft_model', model=draft, num_speculative_tokens=4)
        llm = LLM(
            target,
            progress=False,
            device='cuda',
            dtype='float32',
            skip_tokenizer_init=True,
            kv_cache_memory=256 << 20,
            max_num_seqs=8,
            speculative_config=spec,
        )
        res = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)
        outs[name], stats[name] = [o.outputs[0].token_ids for o in res], llm.engine.core.stats()
        del llm
        torch.cuda.empty_cache()
    assert outs['cut'] == outs['plain'] and outs['self'] == outs['plain']
    st = stats['self']
    assert st['spec_decode_num_accepted_tokens'] == st['spec_decode_num_draft_tokens'] > 0
    assert 0 < stats['cut']['spec_decode_num_draft_tokens']
