"""The offline `LLM` and the server give the same results for the same requests: both front ends run the one input
processor and the one output processor over the same engine core (issue 40's behaviour check).

The server runs as a real `cvllm-serve` process (its engine core in a process of its own, grammars pickled across);
the offline engine in this process. Each case sends one request both ways and compares what a client reads."""

from __future__ import annotations
import json
import httpx
import pytest
import torch
from _serverproc import ServerProcess

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.engine.output_processor import OutputProcessor
from cvllm_lab.entrypoints.openai.structured import make_logits_processor
from cvllm_lab.entrypoints.openai.tool_parsers import get_tool_parser

MAX_LEN = 512
PROMPT = 'The capital of France is'
TOOLS = [
    {
        'type': 'function',
        'function': {
            'name': 'get_weather',
            'description': 'The weather in a city',
            'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
        },
    }
]


@pytest.fixture(scope='module')
def server():
    with ServerProcess('--max-model-len', str(MAX_LEN), '--mem', '64', '--generation-config', 'vllm') as s:
        yield s


@pytest.fixture(scope='module')
def llm():
    torch.set_num_threads(1)  # as the server's core runs (--threads 1): the same reduction order, the same floats
    llm = LLM(max_model_len=MAX_LEN, kv_cache_memory=64 << 20, progress=False)
    assert type(llm.engine.output_processor) is OutputProcessor
    return llm


def post(server, route: str, **body) -> dict:
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_strings_and_n(server, llm):
    "A stop string cuts the text the same way; two seeded samples are the same two samples."
    (o,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[' is', '.']), use_tqdm=False)
    r = post(server, '/v1/completions', prompt=PROMPT, temperature=0, max_tokens=24, stop=[' is', '.'])
    c = r['choices'][0]
    assert (c['text'], c['finish_reason'], c['stop_reason']) == (o.outputs[0].text, 'stop', o.outputs[0].stop_reason)
    sp = SamplingParams(temperature=0.9, top_p=0.95, n=2, seed=11, max_tokens=16)
    (o,) = llm.generate('Once upon a time', sp, use_tqdm=False)
    r = post(
        server, '/v1/completions', prompt='Once upon a time', temperature=0.9, top_p=0.95, n=2, seed=11, max_tokens=16
    )
    assert [c['text'] for c in r['choices']] == [s.text for s in o.outputs]
    assert o.outputs[0].text != o.outputs[1].text


def test_logprobs_and_prompt_logprobs(server, llm):
    "The sampled tokens' log-probs and the prompt's, with their top alternatives, agree."
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2)
    (o,) = llm.generate(PROMPT, sp, use_tqdm=False)
    r = post(server, '/v1/completions', prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2, echo=True)
    lp = r['choices'][0]['logprobs']
    n_prompt = len(o.prompt_token_ids)
    ours = [None] + [d[t].logprob for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    ours += [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    assert len(lp['token_logprobs']) == n_prompt + 6
    assert lp['token_logprobs'][0] is None
    assert lp['token_logprobs'][1:] == pytest.approx(ours[1:], abs=1e-4)
    top = [{d[k].decoded_token: d[k].logprob for k in d if d[k].rank <= 2} for d in o.outputs[0].logprobs]
    for got, want in zip(lp['top_logprobs'][n_prompt:], top):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert r['choices'][0]['text'] == PROMPT + o.outputs[0].text


def test_chat_with_tools(server, llm):
    "A conversation with tools renders to the same prompt (tools folded into the text for SmolLM2's template) and the same answer."
    msgs = [{'role': 'user', 'content': 'What is the weather in Paris? Use the tool.'}]
    (o,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False, tools=TOOLS)
    r = post(server, '/v1/chat/completions', messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    content, calls = get_tool_parser('hermes', TOOLS).extract(o.outputs[0].text)
    m = r['choices'][0]['message']
    assert (m['content'] or '') == (content or '')
    assert [(c['function']['name'], json.loads(c['function']['arguments'])) for c in m.get('tool_calls') or []] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    assert r['usage']['prompt_tokens'] == len(o.prompt_token_ids)


def test_structured_output(server, llm):
    "A JSON-object grammar: the server's (built in the API process, pickled to the core) and the offline one agree."
    tok = llm.get_tokenizer()
    proc = make_logits_processor(tok, {'type': 'json_object'}, eos_token_ids=sorted(llm.engine.eos_token_ids))
    (o,) = llm.generate(
        'Reply in JSON:', SamplingParams(temperature=0, max_tokens=24, logits_processors=[proc]), use_tqdm=False
    )
    r = post(
        server,
        '/v1/completions',
        prompt='Reply in JSON:',
        temperature=0,
        max_tokens=24,
        response_format={'type': 'json_object'},
    )
    assert r['choices'][0]['text'] == o.outputs[0].text
    assert o.outputs[0].text.lstrip().startswith('{'), o.outputs[0].text
