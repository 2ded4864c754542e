"""Sleep mode and weight updates (issue 47; design in nbs/51c_sleep, routes in nbs/77j_serving_sleep).

The server test runs a real `cvllm-serve` process (its engine core in a process of its own, the calls pickled across) on
a tiny random Llama. The CUDA test measures what `sleep(level=1)` gives back with `torch.cuda.mem_get_info`, and that
CUDA graphs work after a wake-up (recaptured) and after a weight update (kept: the update copies in place)."""

from __future__ import annotations
import tempfile
import time
import httpx
import pytest
import torch
from _serverproc import ServerProcess
from helpers import tiny_tokenizer

from cvllm_lab import LLM, SamplingParams

PROMPT = 'w5 w9 w17 w33 w2 w250 w7 w7 w1 w3 w11 w12 w13 w14 w15 w16 w40'


def tiny_llama(seed: int) -> str:
    "A random fp32 Llama (vocab 256, 2 layers) with a word-level tokenizer, saved to a folder."
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    d = tempfile.mkdtemp()
    LlamaForCausalLM(cfg).save_pretrained(d)
    tiny_tokenizer(256).save_pretrained(d)
    return d


def test_server_sleep_wake_and_update():
    "Sleep, a request refused with 503 + Retry-After while asleep, wake, the same answer; B's weights from disk, B's answer."
    a, b = tiny_llama(0), tiny_llama(1)
    torch.set_num_threads(1)  # as the server's core (--threads 1)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want_b = LLM(b, max_model_len=128, kv_cache_memory=1 << 20, dtype='float32', progress=False).generate(
        PROMPT, sp, use_tqdm=False
    )[0]
    body = dict(prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    args = ('--model', a, '--max-model-len', '128', '--mem', '1', '--dtype', 'float32', '--generation-config', 'vllm')
    with ServerProcess(*args, '--enable-sleep-mode') as s:
        post = lambda route, **kw: httpx.post(s.url + route, timeout=60, **kw)
        r = post('/v1/completions', json=body)
        assert r.status_code == 200, r.text
        before = r.json()['choices'][0]['text']
        assert post('/sleep', params={'level': 1}).status_code == 200
        assert httpx.get(s.url + '/is_sleeping').json() == {'is_sleeping': True}
        r = post('/v1/completions', json=body)
        assert (r.status_code, r.headers.get('retry-after')) == (503, '10'), r.text
        assert r.json()['error']['type'] == 'ServiceUnavailableError'
        assert post('/wake_up').status_code == 200
        assert httpx.get(s.url + '/is_sleeping').json() == {'is_sleeping': False}
        r = post('/v1/completions', json=body)
        assert r.status_code == 200 and r.json()['choices'][0]['text'] == before
        r = post('/update_weights_from_disk', json={'model_path': b})
        assert r.status_code == 200 and r.json()['success'], r.text
        r = post('/v1/completions', json=body)
        assert r.json()['choices'][0]['text'] == want_b.outputs[0].text != before


def test_tensor_parallel_sleep_and_update():
    """At tensor parallel 2 (gloo) the calls reach both workers' runners through `collective_rpc`: level 1 and level 2
    (with a reload) answer as before, an update to B's tensors (each rank takes its shard) answers as B does."""
    from safetensors.torch import load_file

    a, b = tiny_llama(0), tiny_llama(1)
    kw = dict(max_model_len=128, kv_cache_memory=1 << 20, dtype='float32', progress=False, skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 17, 33, 2, 250, 7, 7, 1, 3, 11, 12, 13, 14, 15, 16, 40], [100, 101, 102]]

    def greedy(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    want_b = greedy(LLM(b, **kw))
    llm = LLM(a, tensor_parallel_size=2, enable_sleep_mode=True, **kw)
    try:
        ref = greedy(llm)
        assert ref != want_b
        llm.sleep(level=1)
        llm.wake_up()
        assert greedy(llm) == ref
        llm.sleep(level=2)
        llm.wake_up()
        llm.reload_weights()
        assert greedy(llm) == ref
        llm.update_weights(load_file(f'{b}/model.safetensors').items())
        assert greedy(llm) == want_b
    finally:
        llm.engine.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_cuda_sleep_gives_memory_back():
    """sleep(level=1) gives back most of the weights and the KV cache (as `mem_get_info` sees it); after wake_up the
    recaptured CUDA graphs answer as before; an update to another model's tensors (checkpoint names) answers as that
    model loaded fresh, with the same graph objects (the update copied in place)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
    )
    dirs, sds = [], []
    for seed in (0, 1):  # random checkpoints (HF's init: meaningful logits, unlike dummy weights)
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16)
        dirs.append(tempfile.mkdtemp())
        hf.save_pretrained(dirs[-1])
        sds.append(hf.state_dict())
        del hf
    kw = dict(skip_tokenizer_init=True, max_model_len=1024, kv_cache_memory=2 << 30, dtype='bfloat16', progress=False)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(1 + i, 200 + i)) for i in range(4)]

    def greedy(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    llm = LLM(dirs[0], enable_sleep_mode=True, **kw)
    runner = llm.engine.runner
    assert runner.graphs, 'CUDA graphs were captured'
    ref = greedy(llm)
    parts = runner.tagged_storages()
    weights, kv = (sum(s.nbytes() for s in parts[k]) for k in ('params', 'kv_cache'))
    torch.cuda.synchronize()
    free0, alloc0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    t1 = time.perf_counter()
    freed = torch.cuda.mem_get_info()[0] - free0
    # on failure: did the storages give their bytes to PyTorch's allocator (allocated), and it to the driver (reserved)?
    why = dict(
        freed=freed,
        weights=weights,
        kv=kv,
        allocated_drop=alloc0 - torch.cuda.memory_allocated(),
        reserved_drop=res0 - torch.cuda.memory_reserved(),
        left={k: sum(s.nbytes() for s in v) for k, v in parts.items()},
        resizable={k: sorted({s.resizable() for s in v}) for k, v in parts.items()},
    )
    assert freed >= 0.9 * (weights + kv), why
    llm.wake_up()
    t2 = time.perf_counter()
    print(
        f'sleep(1) freed {freed / 2**30:.2f} GiB (weights {weights / 2**30:.2f} GiB, KV cache {kv / 2**30:.2f} GiB) '
        f'in {t1 - t0:.2f} s; wake_up (with the graph capture) {t2 - t1:.2f} s'
    )
    assert runner.graphs, 'CUDA graphs captured again'
    assert greedy(llm) == ref
    other = LLM(dirs[1], **kw)
    want = greedy(other)
    other.engine.shutdown()
    del other
    assert want != ref
    graphs = dict(runner.graphs)
    llm.update_weights(sds[1].items())
    assert runner.graphs == graphs  # the same graph objects: nothing recaptured
    assert greedy(llm) == want
