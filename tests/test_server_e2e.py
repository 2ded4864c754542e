"""End to end: the real `python -m cvllm_lab.entrypoints.serve` on 127.0.0.1 with the embedded model, driven by the official
`openai` client (and raw HTTP where the client would hide what is checked)."""

from __future__ import annotations
import asyncio
import json
import subprocess
import sys
import time
import httpx
import jsonschema
import pytest

openai = pytest.importorskip('openai')
from _serverproc import API_ARGS, ServerProcess, metric, shared_server  # noqa: E402 (after the skip)

MODEL = 'smol'
Q = [{'role': 'user', 'content': 'What is the capital of France?'}]
WEATHER = [
    {
        'type': 'function',
        'function': {
            'name': 'get_weather',
            'description': 'Get the current weather in a city',
            'parameters': {
                'type': 'object',
                'properties': {'city': {'type': 'string', 'maxLength': 30}},
                'required': ['city'],
                'additionalProperties': False,
            },
        },
    }
]


SERVER_ARGS = API_ARGS  # the server shared with the other API modules (tests/_serverproc.py)


@pytest.fixture(scope='module')
def server():
    return shared_server(*SERVER_ARGS)


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=120)


def assert_error(status: int, body: dict, param: str | None = None):
    "OpenAI's error shape: `code` is a string or null (the HTTP status is the response's own)."
    err = body['error']
    assert set(err) == {'message', 'type', 'param', 'code'}, body
    assert (
        (err['code'] is None or isinstance(err['code'], str)) and isinstance(err['message'], str) and err['message']
    ), body
    if param is not None:
        assert err['param'] == param, body


def chat_text(client, **kw) -> str:
    return client.chat.completions.create(model=MODEL, **kw).choices[0].message.content


# ---- basics ----


def test_models_health_ui(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, 'alias']
    assert httpx.get(server.url + '/health').status_code == 200
    r = httpx.get(server.url + '/')
    assert r.status_code == 200 and 'cvllm_lab chat' in r.text


def test_chat_non_stream_and_stream(client):
    kw = dict(messages=Q, max_tokens=16, temperature=0)
    r = client.chat.completions.create(model=MODEL, **kw)
    assert r.object == 'chat.completion' and r.id.startswith('chatcmpl-') and r.model == MODEL
    assert abs(r.created - time.time()) < 300
    c = r.choices[0]
    assert c.index == 0 and c.message.role == 'assistant' and c.finish_reason in ('stop', 'length')
    assert 'Paris' in c.message.content
    assert (
        r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        and 0 < r.usage.completion_tokens <= 16
    )
    # the same request again hits the prefix cache, whose K/V are stored in the cache's dtype: on this prompt the top two
    # first tokens of the embedded model are within one bf16 step of the logits, so stream against the cached answer
    r = client.chat.completions.create(model=MODEL, **kw)
    c = r.choices[0]
    chunks = list(
        client.chat.completions.create(model=MODEL, stream=True, stream_options={'include_usage': True}, **kw)
    )
    assert len({ch.id for ch in chunks}) == 1
    text = ''.join(ch.choices[0].delta.content or '' for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_ends_with_done(server):
    with httpx.stream(
        'POST', server.url + '/v1/chat/completions', timeout=60, json=dict(messages=Q, max_tokens=4, stream=True)
    ) as r:
        assert r.headers['content-type'].startswith('text/event-stream')
        events = [l for l in r.iter_lines() if l]
    assert events[-1] == 'data: [DONE]' and all(e.startswith('data: ') for e in events)


def test_completions_echo_logprobs(server, client):
    prompt = 'The capital of France is'
    G = dict(
        max_tokens=5, temperature=0, extra_body={'repetition_penalty': 1.0}
    )  # plain greedy: the sampled token is the top-1
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, **G)
    c = r.choices[0]
    n_prompt = httpx.post(server.url + '/tokenize', json={'prompt': prompt}).json()['count']
    assert r.usage.prompt_tokens == n_prompt
    lp = c.logprobs
    assert c.text.startswith(prompt) and ''.join(lp.tokens) == c.text
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for tok, l, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert (
            len(top) == 2 and top[tok] == pytest.approx(l) and l == pytest.approx(max(top.values()))
        )  # greedy = top-1
    # the same prompt as token ids, and as a list of prompts
    ids = httpx.post(server.url + '/tokenize', json={'prompt': prompt}).json()['tokens']
    plain = client.completions.create(model=MODEL, prompt=prompt, **G).choices[0].text
    assert c.text == prompt + plain
    assert client.completions.create(model=MODEL, prompt=ids, **G).choices[0].text == plain
    many = client.completions.create(model=MODEL, prompt=[prompt, 'Hello'], **G)
    assert [x.index for x in many.choices] == [0, 1] and many.choices[0].text == plain


def test_n_and_seed(client):
    kw = dict(messages=Q, max_tokens=12, temperature=1.0, seed=1234)
    a = client.chat.completions.create(model=MODEL, n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    b = client.chat.completions.create(model=MODEL, n=2, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    texts = {chat_text(client, **{**kw, 'seed': s}) for s in (1, 2, 3)}
    assert len(texts) > 1  # other seeds sample other texts
    assert chat_text(client, **kw) == chat_text(client, **kw)


def test_beam_search(server, client):
    "vLLM's `use_beam_search` through the official client: width 1 is greedy; n=3 is 3 beams, best first; no stream."
    prompt, G = 'The capital of France is', dict(temperature=0, extra_body={'repetition_penalty': 1.0})
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=0, **G).choices[0]
    one = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={'use_beam_search': True}
    )
    assert one.choices[0].text == greedy.text
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        n=3,
        logprobs=1,
        extra_body={'use_beam_search': True, 'length_penalty': 0.0, 'best_of': 9},  # best_of: ignored, as vLLM
    )
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    if all(c.finish_reason == 'length' for c in r.choices):  # length_penalty 0: ranked by cumulative log-prob
        assert sums == sorted(sums, reverse=True) and sums[0] >= sum(greedy.logprobs.token_logprobs) - 1e-4
    s = httpx.post(server.url + '/v1/completions', json=dict(prompt=prompt, use_beam_search=True, stream=True))
    assert s.status_code == 400
    assert_error(400, s.json(), 'stream')


def test_stop_strings_never_leak(client):
    full = chat_text(client, messages=Q, max_tokens=16, temperature=0)
    words = full.split()
    stop = words[len(words) // 2]
    want = full[: full.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0, stop=[stop, 'zzzz'])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == 'stop'
    pieces = [
        ch.choices[0].delta.content or ''
        for ch in client.chat.completions.create(
            model=MODEL, messages=Q, max_tokens=16, temperature=0, stop=stop, stream=True
        )
        if ch.choices
    ]
    assert ''.join(pieces) == want
    assert stop not in ''.join(pieces)


def test_json_schema(client):
    schema = {
        'type': 'object',
        'properties': {
            'city': {'type': 'string', 'maxLength': 20},
            'country': {'type': 'string', 'maxLength': 20},
            'is_capital': {'type': 'boolean'},
        },
        'required': ['city', 'country', 'is_capital'],
        'additionalProperties': False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=Q,
        max_tokens=60,
        temperature=0,
        response_format={'type': 'json_schema', 'json_schema': {'name': 'answer', 'schema': schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=60, temperature=0.7, seed=3, response_format={'type': 'json_object'}
    )
    if r.choices[0].finish_reason == 'stop':
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_call_round_trip(client):
    ask = [{'role': 'user', 'content': 'What is the weather like in Paris today?'}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        tools=WEATHER,
        max_tokens=40,
        temperature=0,
        tool_choice={'type': 'function', 'function': {'name': 'get_weather'}},
    )
    ch = r.choices[0]
    assert ch.finish_reason == 'tool_calls' and ch.message.content is None
    call = ch.message.tool_calls[0]
    assert call.type == 'function' and call.function.name == 'get_weather' and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER[0]['function']['parameters'])
    back = ask + [
        ch.message.model_dump(exclude_none=True),
        {'role': 'tool', 'tool_call_id': call.id, 'content': json.dumps({'temperature_c': 21, 'sky': 'sunny'})},
    ]
    final = client.chat.completions.create(model=MODEL, messages=back, tools=WEATHER, max_tokens=30, temperature=0)
    assert final.choices[0].message.content and final.choices[0].finish_reason in ('stop', 'length')
    # required, streamed: the call's arguments arrive as deltas that add up to the same JSON
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ask, tools=WEATHER, max_tokens=40, temperature=0, tool_choice='required', stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == 'get_weather' and deltas[0].id and all(d.index == 0 for d in deltas)
    jsonschema.validate(
        json.loads(''.join(d.function.arguments or '' for d in deltas)), WEATHER[0]['function']['parameters']
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'tool_calls'


# ---- concurrency ----


def test_32_concurrent_streams(server):
    aclient = openai.AsyncOpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=300)
    # greedy on the raw logits (the model's default repetition penalty off), with the top-2 log-probs of every token
    reqs = [
        dict(
            model=MODEL,
            messages=[{'role': 'user', 'content': f'Write the number {i} in words.'}],
            max_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body=dict(repetition_penalty=1.0),
        )
        for i in range(32)
    ]

    async def streamed(kw):
        s = await aclient.chat.completions.create(stream=True, stream_options=dict(include_usage=True), **kw)
        parts, toks, finish, n = [], [], None, None
        async for ch in s:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or '')
                toks += ch.choices[0].logprobs.content if ch.choices[0].logprobs else []
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                n = ch.usage.completion_tokens
        assert len(toks) == n, (toks, n)  # one log-prob entry per generated token: none lost or repeated
        return ''.join(parts), finish, toks

    async def bad():  # bad requests mixed in must not disturb the others
        with pytest.raises(openai.BadRequestError):
            await aclient.chat.completions.create(model=MODEL, messages=Q, top_p=7)

    async def run():
        await asyncio.gather(*[aclient.chat.completions.create(**kw) for kw in reqs])  # both runs below: cached prompts
        t0 = time.time()
        res = await asyncio.gather(*[streamed(kw) for kw in reqs], bad(), bad())
        t1 = time.time()
        ref = await asyncio.gather(*[aclient.chat.completions.create(**kw) for kw in reqs])
        await aclient.close()
        return res[:32], ref, t1 - t0

    streams, refs, dt = asyncio.run(run())
    for (text, finish, toks), r in zip(streams, refs):
        ref = r.choices[0].logprobs.content
        assert text and len(ref) == r.usage.completion_tokens
        same = [a.token for a in toks] == [b.token for b in ref]
        if same:
            assert text == r.choices[0].message.content and finish == r.choices[0].finish_reason
        else:  # the runs batched the request with other neighbours: only a near-tie may flip. The CPU decode path
            # computes in bf16, so logits near 20 come in steps of 0.125; a few steps is a tie.
            k = next(
                i
                for i, (a, b) in enumerate(zip(toks + [None], ref + [None]))
                if a is None or b is None or a.token != b.token
            )
            top = (ref[k] if k < len(ref) else toks[k]).top_logprobs
            assert abs(top[0].logprob - top[1].logprob) <= 0.5, (text, r.choices[0].message.content, k, top)
    assert metric(server.url, 'cvllm:num_requests_running') == 0
    print(f'32 concurrent streams: {dt:.1f} s')


def test_disconnect_aborts(server):
    aborted = metric(server.url, 'cvllm:request_aborted_total')
    body = dict(prompt='Once upon a time', max_tokens=800, ignore_eos=True, stream=True)
    with httpx.stream('POST', server.url + '/v1/completions', json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith('data: ')
        assert metric(server.url, 'cvllm:num_requests_running') == 1
    # non-streamed, the client gives up after 1 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + '/v1/completions', json=body | {'stream': False}, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.time() + 10
    while time.time() < deadline:
        if (
            metric(server.url, 'cvllm:request_aborted_total') == aborted + 2
            and metric(server.url, 'cvllm:num_requests_running') == 0
            and metric(server.url, 'cvllm:kv_cache_usage_perc') == 0
        ):
            break
        time.sleep(0.2)
    assert metric(server.url, 'cvllm:request_aborted_total') == aborted + 2
    assert (
        metric(server.url, 'cvllm:num_requests_running') == 0 and metric(server.url, 'cvllm:kv_cache_usage_perc') == 0
    )


def test_metrics(server):
    text = httpx.get(server.url + '/metrics').text
    for name in (
        'cvllm:num_requests_running',
        'cvllm:num_requests_waiting',
        'cvllm:kv_cache_usage_perc',
        'cvllm:prefix_cache_hits_total',
        'cvllm:prefix_cache_queries_total',
        'cvllm:prompt_tokens_total',
        'cvllm:generation_tokens_total',
        'cvllm:time_to_first_token_seconds_bucket',
        'cvllm:inter_token_latency_seconds_bucket',
        'cvllm:e2e_request_latency_seconds_count',
    ):
        assert name in text, name
    assert metric(server.url, 'cvllm:prefix_cache_hits_total') > 0  # the chat template's system prompt is shared
    assert (
        metric(server.url, 'cvllm:time_to_first_token_seconds_count')
        >= metric(server.url, 'cvllm:e2e_request_latency_seconds_count')
        > 30
    )


# ---- errors ----


@pytest.mark.parametrize(
    'kw, param',
    [
        (dict(messages=Q, temperature='hot'), 'temperature'),  # wrong type
        (dict(messages=Q, top_p=5), 'top_p'),  # out of range
        (dict(messages=Q, max_tokens=-1), 'max_tokens'),
        (dict(messages=Q, n=1000), 'n'),  # n too large
        (dict(messages=[{'role': 'user', 'content': 'hello ' * 1200}]), 'messages'),  # longer than the context
        (
            dict(messages=Q, tools=WEATHER, tool_choice={'type': 'function', 'function': {'name': 'launch_rockets'}}),
            None,
        ),
        (dict(messages=[{'role': 'wizard', 'content': 'hi'}]), None),
        (dict(messages=Q, response_format={'type': 'json_schema', 'json_schema': {'name': 'x'}}), None),
    ],
)
def test_bad_chat_requests(client, kw, param):
    kw = {'model': MODEL, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.status_code == 400
    assert_error(400, e.value.response.json(), param)


def test_unknown_model_is_not_found(client):
    "OpenAI's and vLLM's answer to an unknown model: 404, which the openai client raises as NotFoundError."
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model='gpt-4o', messages=Q)
    assert e.value.response.json()['error']['param'] == 'model'
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model='nope', prompt='hi', max_tokens=4)


def test_bad_completion_requests(server, client):
    for kw in (
        dict(prompt='hi ' * 1100),
        dict(prompt=[999999999]),
        dict(prompt=''),
        dict(prompt='hi', logprobs=50),
        dict(prompt={'text': 'hi'}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{'model': MODEL, 'max_tokens': 4, **kw})
        assert_error(400, e.value.response.json())


def test_malformed_bodies_never_crash(server):
    url = server.url + '/v1/chat/completions'
    for raw in (
        b'{"messages": [',
        b'',
        b'null',
        b'[]',
        b'"text"',
        b'{"messages": null}',
        b'\xff\xfe',
        b'{' * 5000 + b'}' * 5000,
        json.dumps(
            {'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'x'}}]}]}
        ).encode(),
        json.dumps({'messages': Q, 'stop': [1, 2]}).encode(),
        json.dumps({'messages': Q, 'stream_options': {'include_usage': True}}).encode(),
    ):
        r = httpx.post(url, content=raw, headers={'content-type': 'application/json'}, timeout=30)
        assert r.status_code == 400, (raw[:40], r.text)
        assert_error(400, r.json())
    r = httpx.get(server.url + '/v1/nope')
    assert r.status_code == 404
    assert_error(404, r.json())
    assert httpx.get(server.url + '/health').status_code == 200
    assert httpx.post(url, json=dict(messages=Q, max_tokens=2), timeout=60).status_code == 200


@pytest.mark.own_server
def test_api_key_and_refused_flags():
    with ServerProcess('--load-format', 'dummy', '--max-model-len', '128', '--mem', '8', '--api-key', 'sekrit') as s:
        for headers in (
            {},
            {'Authorization': 'Bearer wrong'},
            {'Authorization': 'sekrit'},
            {'Authorization': 'Basic sekrit'},
        ):
            r = httpx.get(s.url + '/v1/models', headers=headers)
            assert r.status_code == 401
            assert_error(401, r.json())
        for scheme in ('bearer', 'BEARER', 'Bearer'):  # the scheme is case-insensitive
            assert httpx.get(s.url + '/v1/models', headers={'Authorization': f'{scheme} sekrit'}).status_code == 200
        c = openai.OpenAI(base_url=s.url + '/v1', api_key='wrong', max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        ok = openai.OpenAI(base_url=s.url + '/v1', api_key='sekrit', max_retries=0)
        assert (
            ok.completions.create(model=ok.models.list().data[0].id, prompt='hi', max_tokens=2).choices[0].text
            is not None
        )
        assert httpx.get(s.url + '/health').status_code == 200
    for flags, word in (
        (['--tensor-parallel-size', '2'], 'quantized layers are not sharded'),
        (['--isq', 'q9k'], 'unknown quantization'),
        (['--quantization', 'int3'], 'quantiz'),
    ):
        p = subprocess.run(
            [sys.executable, '-m', 'cvllm_lab.entrypoints.serve', *flags], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 2 and word in p.stderr.lower(), (flags, p.returncode, p.stderr[-500:])


def test_generation_config_defaults(client):
    "A request that leaves sampling fields unset gets the model's defaults (GGUF: GGUF_SAMPLING_DEFAULTS); set ones win."
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.sampling_params import GGUF_SAMPLING_DEFAULTS

    prompt, n = 'Once upon a time, in a land far away,', 24
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text
    llm = LLM(max_model_len=256, progress=False)
    want = (
        llm.generate([prompt], SamplingParams(**{**GGUF_SAMPLING_DEFAULTS, 'temperature': 0, 'max_tokens': n}))[0]
        .outputs[0]
        .text
    )
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0].outputs[0].text
    assert got == want and len(got) > 0, (got, want)
    assert (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={'repetition_penalty': 1.0}
        )
        .choices[0]
        .text
        == plain
    )


@pytest.mark.own_server
def test_fp8_kvcache_serving():
    """`--fp8-kvcache` (candle-vllm) serves from an FP8 KV cache; greedy text equals the offline API's with kv_cache_dtype='fp8'
    (the request sets repetition_penalty, which the offline SamplingParams set and the GGUF defaults would otherwise fill)."""
    from cvllm_lab import LLM, SamplingParams

    prompt, n = 'The capital of France is', 12
    with ServerProcess('--fp8-kvcache', '--max-model-len', '256', '--mem', '16') as s:
        c = openai.OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=120)
        got = (
            c.completions.create(
                model=c.models.list().data[0].id,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                extra_body={'repetition_penalty': 1.0},
            )
            .choices[0]
            .text
        )
    want = (
        LLM(kv_cache_dtype='fp8', max_model_len=256, progress=False)
        .generate([prompt], SamplingParams(max_tokens=n, temperature=0))[0]
        .outputs[0]
        .text
    )
    assert got == want and len(got) > 0, (got, want)


@pytest.mark.own_server
def test_quantized_serving():
    "`--quantization gguf` keeps the embedded Q4_1 blocks quantized; greedy text equals the offline API's with the same setting."
    from cvllm_lab import LLM, SamplingParams

    prompt, n = 'The capital of France is', 12
    with ServerProcess('--quantization', 'gguf', '--max-model-len', '256', '--mem', '16') as s:
        c = openai.OpenAI(base_url=s.url + '/v1', api_key='unused', max_retries=0, timeout=120)
        got = (
            c.completions.create(
                model=c.models.list().data[0].id,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                extra_body={'repetition_penalty': 1.0},
            )
            .choices[0]
            .text
        )
    want = (
        LLM(quantization='gguf', max_model_len=256, progress=False)
        .generate([prompt], SamplingParams(max_tokens=n, temperature=0))[0]
        .outputs[0]
        .text
    )
    assert got == want and len(got) > 0, (got, want)
