"""Speculative decoding (n-gram, issue 43) on a GPU: greedy output with speculation equals greedy output without,
token for token (verification steps run eagerly with several query rows per sequence through the Triton paged
kernel; plain decode steps replay CUDA graphs), in fp32, and in bf16 under the batch-invariant mode. Skipped without
CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V = 1024
SPEC = {'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_min': 1, 'prompt_lookup_max': 3}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            architectures=['LlamaForCausalLM'],
        )
    )
    d = Path(tempfile.mkdtemp())
    m.save_pretrained(d)
    return d


@pytest.mark.parametrize('dtype,invariant', [('float32', False), ('bfloat16', True)])
def test_ngram_greedy_equals_plain_greedy(dtype, invariant):
    from cvllm_lab import LLM, SamplingParams

    d = _llama()
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(0, V, (9,), generator=g).tolist()
    prompts = [
        phrase * 4,
        phrase * 2 + torch.randint(0, V, (30,), generator=g).tolist(),
        torch.randint(0, V, (200,), generator=g).tolist(),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1 if i == 0 else None) for i in range(3)
    ]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=24, ignore_eos=True)
    outs, stats = {}, {}
    for spec in (None, SPEC):
        llm = LLM(
            str(d),
            progress=False,
            device='cuda',
            dtype=dtype,
            skip_tokenizer_init=True,
            kv_cache_memory=256 << 20,
            max_num_seqs=8,
            batch_invariant=invariant,
            speculative_config=spec,
        )
        res = llm.generate([{'prompt_token_ids': p} for p in prompts + prompts[:1]], params + [sampled], use_tqdm=False)
        outs[spec is None], stats[spec is None] = res, llm.engine.core.stats()
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(outs[True][:3], outs[False][:3]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    la, lb = (o[0].outputs[0].logprobs for o in (outs[True], outs[False]))
    assert [list(x) for x in la] == [list(x) for x in lb]
    assert [len(c.token_ids) for c in outs[False][3].outputs] == [24, 24]
    st = stats[False]
    assert 0 < st['spec_decode_num_accepted_tokens'] <= st['spec_decode_num_draft_tokens']
