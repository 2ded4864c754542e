"""gpt-oss's harmony format through the server and the offline `LLM.chat` (issue 42).

A tiny `GptOssForCausalLM` (dummy weights) with a byte-level tokenizer that has harmony's special tokens. Random weights write
no harmony, so each request carries a grammar (vLLM's `structured_outputs`, llguidance's special-token syntax) that
forces a scripted completion: the real route, engine, detokenizer and parser run on it. The server runs with vLLM's
flags for gpt-oss (harmony is on for the architecture without them: `test_offline_chat_renders_harmony`);
`<|call|>` and `<|return|>` stop it though the model's EOS is `<|endoftext|>`.
"""

from __future__ import annotations
import json
import httpx
import openai
import pytest
from _serverproc import ServerProcess
from cvllm_lab.utils.harmony import render_harmony

SPECIALS = (
    '<|startoftext|>',
    '<|endoftext|>',
    '<|return|>',
    '<|constrain|>',
    '<|channel|>',
    '<|start|>',
    '<|end|>',
    '<|message|>',
    '<|call|>',
)
TOOLS = [
    {
        'type': 'function',
        'function': {
            'name': 'get_weather',
            'description': 'The weather in a city.',
            'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
        },
    }
]
Q = [{'role': 'user', 'content': 'Weather in Paris?'}]
# the scripted completions as lark grammars: special tokens as <|...|>, text quoted
CALL = (
    'start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> <|start|> "assistant" <|channel|> '
    '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Paris\\"}" <|call|>'
)
FINAL = (
    'start: <|channel|> "analysis" <|message|> "The tool said sunny." <|end|> <|start|> "assistant" <|channel|> '
    '"final" <|message|> "Sunny in Paris." <|return|>'
)


def tiny_gpt_oss(d):
    "A tiny gpt-oss config (vocab: the 256 byte tokens, then harmony's special ones) and tokenizer in folder `d`; the tokenizer."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GptOssConfig, PreTrainedTokenizerFast

    tok = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>', bos_token='<|startoftext|>')
    ft.save_pretrained(d)
    c = GptOssConfig(
        vocab_size=len(ft),
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=1024,
        eos_token_id=ft.convert_tokens_to_ids('<|endoftext|>'),
        bos_token_id=None,
        pad_token_id=None,
    )
    c.architectures = ['GptOssForCausalLM']
    c.save_pretrained(d)  # no weights: the server and LLM load random ones (--load-format dummy)
    return ft


@pytest.fixture(scope='module')
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp('tiny_gpt_oss')
    return d, tiny_gpt_oss(d)


@pytest.fixture(scope='module')
def server(model):
    # vLLM's names for its harmony parsers are accepted (harmony is on for this architecture without them)
    flags = ('--tool-call-parser', 'openai', '--reasoning-parser', 'openai_gptoss', '--enable-auto-tool-choice')
    with ServerProcess(
        '--model', str(model[0]), '--max-model-len', '1024', '--mem', '16', '--load-format', 'dummy', *flags
    ) as s:
        yield s


def _client(s):
    return openai.OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=120)


def _ask(c, messages, grammar, **kw):
    return c.chat.completions.create(
        model=c.models.list().data[0].id,
        messages=messages,
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        extra_body={'structured_outputs': {'grammar': grammar}},
        **kw,
    )


def _reassemble(chunks):
    "A streamed message put back together: (reasoning_content, content, [(name, arguments)], ids, finish_reason)."
    r, c, calls, ids, finish = '', '', {}, [], None
    for ch in chunks:
        if not ch.choices:
            continue
        d, finish = ch.choices[0].delta, ch.choices[0].finish_reason or finish
        r += (d.model_extra or {}).get('reasoning_content') or ''
        c += d.content or ''
        for t in d.tool_calls or []:
            if t.id:
                ids.append(t.id)
            e = calls.setdefault(t.index, ['', ''])
            e[0] += t.function.name or ''
            e[1] += t.function.arguments or ''
    return r or None, c or None, [tuple(v) for _, v in sorted(calls.items())], ids, finish


def test_tool_call_reasoning_and_stream(server, model):
    "A tool call in OpenAI's shape, the analysis in reasoning_content, `reasoning_effort` in the prompt; the stream's deltas add up to the same message."
    c, tok = _client(server), model[1]
    r = _ask(c, Q, CALL, reasoning_effort='low')
    ch = r.choices[0]
    assert ch.finish_reason == 'tool_calls', ch
    assert ch.message.content is None and ch.message.model_extra['reasoning_content'] == 'Need the weather.'
    (call,) = ch.message.tool_calls
    assert call.type == 'function' and call.id.startswith('call_') and call.function.name == 'get_weather'
    assert json.loads(call.function.arguments) == {'city': 'Paris'}
    # the prompt is harmony's, with the request's effort (one byte token per character here: 'low' vs 'high')
    want = render_harmony(Q, TOOLS, 'low')
    assert r.usage.prompt_tokens == len(tok(want, add_special_tokens=False).input_ids)
    assert _ask(c, Q, CALL, reasoning_effort='high').usage.prompt_tokens == r.usage.prompt_tokens + 1

    chunks = list(_ask(c, Q, CALL, reasoning_effort='low', stream=True))
    got = _reassemble(chunks)
    assert got[:3] == ('Need the weather.', None, [('get_weather', call.function.arguments)]), got
    assert len(got[3]) == 1 and got[3][0].startswith('call_') and got[4] == 'tool_calls'
    assert not any('<|' in ch.model_dump_json() for ch in chunks)  # no harmony marker leaks into a delta


def test_tool_result_turn_and_final_answer(server, model):
    "The tool's result goes back as harmony's tool message; a final answer becomes content, finish_reason stop."
    c, tok = _client(server), model[1]
    call = {'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}
    msgs = Q + [
        {'role': 'assistant', 'content': None, 'tool_calls': [call]},
        {'role': 'tool', 'tool_call_id': 'call_1', 'content': '{"sky": "sunny"}'},
    ]
    r = _ask(c, msgs, FINAL)
    m = r.choices[0]
    assert (m.message.content, m.message.model_extra['reasoning_content'], m.message.tool_calls, m.finish_reason) == (
        'Sunny in Paris.',
        'The tool said sunny.',
        None,
        'stop',
    )
    want = render_harmony(msgs, TOOLS, 'medium')  # the default effort
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sky": "sunny"}<|end|>' in want
    assert r.usage.prompt_tokens == len(tok(want, add_special_tokens=False).input_ids)
    got = _reassemble(_ask(c, msgs, FINAL, stream=True))
    assert got == ('The tool said sunny.', 'Sunny in Paris.', [], [], 'stop'), got
    # a forced tool call would need a JSON grammar that stops the model writing harmony: refused by name
    bad = httpx.post(
        server.url + '/v1/chat/completions', json=dict(messages=Q, tools=TOOLS, tool_choice='required'), timeout=60
    )
    assert bad.status_code == 400 and bad.json()['error']['param'] == 'tool_choice', bad.text


def test_offline_chat_renders_harmony(model):
    "`LLM.chat` renders a gpt-oss conversation as harmony too, `reasoning_effort` through chat_template_kwargs (as HF's template)."
    from cvllm_lab import LLM, SamplingParams

    llm = LLM(str(model[0]), load_format='dummy', max_model_len=1024, kv_cache_memory=8 << 20, progress=False)
    (out,) = llm.chat(
        Q, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS, chat_template_kwargs={'reasoning_effort': 'high'}
    )
    assert out.prompt == render_harmony(Q, TOOLS, 'high'), out.prompt
