"""Batch-invariant mode end to end on a GPU (`EngineConfig.batch_invariant`): a bf16 Llama's greedy stream gives the
same tokens and bit-identical log-probs alone, beside other requests, with its prompt in other chunks, and with its
prefix from the cache. Without the mode the same runs are reported (cuBLAS and split-KV follow the batch), not
asserted. Skipped without CUDA; the kernels' own checks are `test_batch_invariant_kernels.py`."""

import pytest
import torch

from test_gpu_engine import V, _model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


def _runs(d, invariant: bool):
    "The stream's (tokens, log-probs) in each situation, keyed by its name."
    from cvllm_lab import LLM, SamplingParams

    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, V, (48,), generator=g).tolist()
    target = {'prompt_token_ids': shared + torch.randint(0, V, (21,), generator=g).tolist()}
    others = [{'prompt_token_ids': torch.randint(0, V, (n,), generator=g).tolist()} for n in (4, 300, 33)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)

    def stream(o):
        c = o.outputs[0]
        return c.token_ids, [next(iter(d.values())).logprob for d in c.logprobs]

    out = {}
    for chunk in (512, 16):
        llm = LLM(
            str(d),
            progress=False,
            device='cuda',
            dtype='bfloat16',
            skip_tokenizer_init=True,
            kv_cache_memory=256 << 20,
            block_size=16,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=512,
            enable_prefix_caching=True,
            batch_invariant=invariant,
        )
        out[f'alone, chunk {chunk}'] = stream(llm.generate(target, sp, use_tqdm=False)[0])  # its prefix now cached
        out[f'warm prefix, chunk {chunk}'] = stream(llm.generate(target, sp, use_tqdm=False)[0])
        out[f'beside 3 others, chunk {chunk}'] = stream(llm.generate(others + [target], sp, use_tqdm=False)[-1])
        del llm
        torch.cuda.empty_cache()
    return out


def test_greedy_stream_is_batch_invariant():
    _, d = _model('llama')
    base = _runs(d, invariant=False)
    ref = base['alone, chunk 512']
    print('without the mode, differing from alone:', [k for k, v in base.items() if v != ref])
    runs = _runs(d, invariant=True)
    ref = runs['alone, chunk 512']
    for k, v in runs.items():
        assert v[0] == ref[0], k
        assert v[1] == ref[1], (k, max(abs(a - b) for a, b in zip(v[1], ref[1])))
