"""Requests that cannot hurt each other (issue 15): every bad input the fuzzing found is a 400/413/503 in OpenAI's
error shape while a concurrent normal request still completes with the same greedy text as alone; the fuzz-found
engine crashes as regressions; a 2 MB request does not stall another stream; structured output closes."""

from __future__ import annotations
import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import httpx
import pytest

from _serverproc import API_ARGS, ServerProcess, metric, shared_server

MODEL = 'smol'
Q = [{'role': 'user', 'content': 'What is the capital of France?'}]
C, CMPL = '/v1/chat/completions', '/v1/completions'
STORY = dict(model=MODEL, prompt='Once upon a time', max_tokens=24, temperature=0, ignore_eos=True)


SERVER_ARGS = API_ARGS  # the server shared with the other API modules (tests/_serverproc.py)


@pytest.fixture(scope='module')
def server():
    return shared_server(*SERVER_ARGS)


def serve_has(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, '-m', 'cvllm_lab.entrypoints.serve', '--help'], capture_output=True, text=True, timeout=120
    ).stdout
    return flag in out


def assert_error(r: httpx.Response, status: int, param: str | None = None):
    "OpenAI's error shape: message, type, param, and `code` a string or null; the HTTP status is the response's."
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()['error']
    assert set(err) == {'message', 'type', 'param', 'code'}, err
    assert (
        isinstance(err['message'], str) and err['message'] and (err['code'] is None or isinstance(err['code'], str))
    ), err
    if param is not None:
        assert err['param'] == param, err


JSON = {'content-type': 'application/json'}
# (path, json body or raw bytes, status, param): each found by fuzzing the server, or named in issue 15
BAD = [
    (C, dict(messages=Q, top_k=10**30), 400, 'top_k'),  # crashed the engine step
    (C, dict(messages=Q, stop_token_ids=[60000], min_tokens=2), 400, 'stop_token_ids'),  # crashed the engine step
    (CMPL, dict(prompt='hi', stop_token_ids=[60000], min_tokens=2, max_tokens=4), 400, 'stop_token_ids'),
    (C, dict(messages=Q, logit_bias={'60000': 3}), 400, 'logit_bias'),
    (C, dict(messages=Q, allowed_token_ids=[3, 70000]), 400, 'allowed_token_ids'),
    (CMPL, dict(prompt=[1, 2, 60000], max_tokens=4), 400, 'prompt'),
    (CMPL, dict(prompt=[2**63], max_tokens=4), 400, 'prompt'),
    (C, dict(messages=Q, max_tokens='8'), 400, 'max_tokens'),
    (C, dict(messages=Q, max_tokens=8.0), 400, 'max_tokens'),
    (C, dict(messages=Q, stream='yes'), 400, 'stream'),
    (C, dict(messages=Q, seed=2**64), 400, 'seed'),
    (C, dict(messages=Q, max_tokens=5000), 400, 'max_tokens'),  # more than the room left
    (C, dict(messages=Q, max_completion_tokens=1020), 400, 'max_completion_tokens'),
    (CMPL, dict(prompt='hi', max_tokens=2000), 400, 'max_tokens'),
    (C, dict(messages=Q, use_beam_search=True, stream=True), 400, 'stream'),  # vLLM's 400 for a beam-search stream
    (CMPL, dict(prompt='hi', use_beam_search=True, stream=True), 400, 'stream'),
    (CMPL, dict(prompt='hi', use_beam_search=True, n=11), 400, 'n'),  # 2n log-probs a step, more than max_logprobs
    (C, dict(messages=Q, use_beam_search=True, guided_regex='a+'), 400, 'guided_regex'),
    (C, dict(messages=Q, priority=1), 400, 'priority'),  # fcfs server
    (C, dict(messages=Q, guided_regex='(['), 400, 'guided_regex'),
    (C, dict(messages=Q, guided_choice=['a'], guided_regex='b'), 400, None),
    ('/detokenize', dict(tokens=[False]), 400, 'tokens.0'),
    ('/detokenize', dict(tokens=[60000]), 400, 'tokens'),
    (
        C,
        b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}',
        400,
        'repetition_penalty',
    ),
    (C, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, 'temperature'),
    (C, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, 'messages.0.content'),
    (CMPL, b'{"prompt": "caf\\udfff", "max_tokens": 2}', 400, 'prompt'),
    ('/tokenize', b'{"prompt": "\\ud83d"}', 400, 'prompt'),
    (C, b'{"messages": [', 400, None),
]


async def post(c: httpx.AsyncClient, path, body) -> httpx.Response:
    if isinstance(body, bytes):
        return await c.post(path, content=body, headers=JSON)
    return await c.post(path, json=body)


async def stream_times(c: httpx.AsyncClient, body: dict) -> tuple[str, list[float]]:
    "A streamed completion's text and the arrival time of each chunk that carries text."
    text, times = [], []
    async with c.stream('POST', CMPL, json=body | dict(stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith('data: {'):
                t = json.loads(line[6:])['choices'][0]['text']
                if t:
                    text.append(t)
                    times.append(time.perf_counter())
    return ''.join(text), times


def test_bad_inputs_are_errors_and_hurt_no_one(server):
    ref = httpx.post(server.url + CMPL, json=STORY, timeout=120).json()['choices'][0]['text']

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            normal = asyncio.ensure_future(stream_times(c, STORY))
            await asyncio.sleep(0.2)  # the stream is running
            bad = await asyncio.gather(*[post(c, path, body) for path, body, _, _ in BAD])
            return (await normal)[0], bad

    text, bad = asyncio.run(run())
    for (path, body, status, param), r in zip(BAD, bad):
        assert_error(r, status, param)
    assert text == ref and len(text) > 0  # the concurrent request is unaffected
    assert httpx.get(server.url + '/health').status_code == 200
    assert metric(server.url, 'cvllm:engine_step_errors_total') == 0  # nothing reached a step and failed it
    # the valid edge of the vocabulary still works
    r = httpx.post(
        server.url + CMPL,
        json=dict(prompt='hi', stop_token_ids=[49151], min_tokens=2, max_tokens=4, temperature=0),
        timeout=60,
    )
    assert r.status_code == 200 and r.json()['usage']['completion_tokens'] >= 2


def read_response(s) -> str:
    "One whole HTTP response from a socket: the headers, then the body up to its Content-Length (it may come in pieces)."
    data = b''
    while b'\r\n\r\n' not in data and (chunk := s.recv(65536)):
        data += chunk
    head, _, body = data.partition(b'\r\n\r\n')
    m = re.search(rb'(?i)content-length:\s*(\d+)', head)
    while m and len(body) < int(m.group(1)) and (chunk := s.recv(65536)):
        body += chunk
    return (head + b'\r\n\r\n' + body).decode('latin-1')


def test_body_size_refused_from_content_length(server):
    "A Content-Length over the limit is a 413 before the body is sent (the server never waits for it)."
    host, port = server.url.removeprefix('http://').split(':')
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f'POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n'.encode()
        )
        head = read_response(s)
    assert head.startswith('HTTP/1.1 413'), head[:200]
    body = json.loads(head.split('\r\n\r\n', 1)[1])
    assert body['error']['type'] == 'RequestTooLargeError' and body['error']['code'] is None


def test_openapi_publishes_request_bodies(server):
    spec = httpx.get(server.url + '/openapi.json').json()
    for path, model in (
        (C, 'ChatCompletionRequest'),
        (CMPL, 'CompletionRequest'),
        ('/tokenize', 'TokenizeRequest'),
        ('/detokenize', 'DetokenizeRequest'),
    ):
        assert spec['paths'][path]['post']['requestBody']['content']['application/json']['schema']['$ref'].endswith(
            '/' + model
        )
    props = spec['components']['schemas']['ChatCompletionRequest']['properties']
    assert {'messages', 'max_tokens', 'temperature', 'structured_outputs', 'priority'} <= set(props)


def test_json_schema_integer_closes(server):
    "Issue 15: {city: string, population: integer} at temperature 0 used to write digits until max_tokens."
    schema = {
        'type': 'object',
        'properties': {'city': {'type': 'string'}, 'population': {'type': 'integer'}},
        'required': ['city', 'population'],
    }
    for content in ('What is the capital of France and its population?', 'Give me a big city and its population.'):
        r = httpx.post(
            server.url + C,
            timeout=120,
            json=dict(
                messages=[{'role': 'user', 'content': content}],
                temperature=0,
                max_tokens=80,
                response_format={'type': 'json_schema', 'json_schema': {'name': 'city', 'schema': schema}},
            ),
        ).json()
        d = json.loads(r['choices'][0]['message']['content'])
        assert isinstance(d['city'], str) and isinstance(d['population'], int) and abs(d['population']) < 10**16, d
        assert r['choices'][0]['finish_reason'] == 'stop'


def test_vllm_structured_outputs(server):
    r = httpx.post(
        server.url + C,
        timeout=60,
        json=dict(messages=Q, temperature=0, max_tokens=10, guided_choice=['Paris', 'London']),
    ).json()
    assert r['choices'][0]['message']['content'] in ('Paris', 'London')
    r = httpx.post(
        server.url + CMPL,
        timeout=60,
        json=dict(
            prompt='Call me at', temperature=0, max_tokens=16, structured_outputs={'regex': r' [0-9]{3}-[0-9]{4}'}
        ),
    ).json()
    import re

    assert re.fullmatch(r' [0-9]{3}-[0-9]{4}', r['choices'][0]['text']), r
    r = httpx.post(
        server.url + CMPL,
        timeout=60,
        json=dict(
            prompt='2+3=', temperature=0, max_tokens=16, structured_outputs={'grammar': 'start: NUM\nNUM: /[0-9]{1,2}/'}
        ),
    ).json()
    assert r['choices'][0]['text'].isdigit(), r


def test_request_success_counts_requests(server):
    before = metric(server.url, 'cvllm:request_success_total')
    r = httpx.post(server.url + C, timeout=60, json=dict(messages=Q, n=2, max_tokens=4, temperature=1.0, seed=3))
    assert r.status_code == 200 and len(r.json()['choices']) == 2
    assert metric(server.url, 'cvllm:request_success_total') == before + 1


@pytest.mark.timing
def test_big_request_does_not_stall_other_streams(server):
    "While 2 MB requests are posted, another greedy stream's tokens keep arriving about one step apart."
    big = json.dumps(
        dict(model=MODEL, messages=[{'role': 'user', 'content': 'lorem ipsum ' * (2_000_000 // 12)}])
    ).encode()
    body = STORY | dict(max_tokens=60)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            _, alone = await stream_times(c, body)  # the step time, undisturbed
            task = asyncio.ensure_future(stream_times(c, body))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            rs = [await c.post(C, content=big, headers=JSON) for _ in range(4)]
            t1 = time.perf_counter()
            _, times = await task
            return alone, times, rs, (t0, t1)

    alone, times, rs, (t0, t1) = asyncio.run(run())
    for r in rs:
        assert_error(r, 400, 'messages')  # far longer than the context: refused early
    step = statistics.median(b - a for a, b in zip(alone, alone[1:]))
    gaps = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    assert gaps, 'the big requests did not overlap the stream'
    bound = 2 * step + 0.05  # one step late at most, plus scheduling noise
    print(
        f'step {step * 1e3:.1f} ms; max gap while 2 MB requests were posted {max(gaps) * 1e3:.1f} ms (bound {bound * 1e3:.1f} ms)'
    )
    assert max(gaps) < bound, (max(gaps), step)


@pytest.mark.own_server
def test_queue_full_is_503():
    if not serve_has('--max-num-queued-requests'):
        pytest.skip('cvllm-serve has no --max-num-queued-requests flag yet')
    with ServerProcess(
        '--max-model-len', '256', '--mem', '16', '--max-num-seqs', '1', '--max-num-queued-requests', '2'
    ) as s:

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(
                    *[
                        c.post(CMPL, json=dict(prompt=f'Count to {i}:', max_tokens=24, ignore_eos=True))
                        for i in range(10)
                    ]
                )

        rs = asyncio.run(run())
        full = [r for r in rs if r.status_code == 503]
        assert full and all(r.status_code in (200, 503) for r in rs), [r.status_code for r in rs]
        for r in full:
            assert_error(r, 503)
            assert r.headers['retry-after'] == '1'
        ok = httpx.post(
            s.url + CMPL, json=dict(prompt='hi', max_tokens=2), timeout=60
        )  # the queue drains; the engine goes on
        assert ok.status_code == 200 and metric(s.url, 'cvllm:num_requests_waiting') == 0


@pytest.mark.own_server
def test_priority_policy():
    if not serve_has('--scheduling-policy'):
        pytest.skip('cvllm-serve has no --scheduling-policy flag yet')
    with ServerProcess('--max-model-len', '256', '--mem', '16', '--scheduling-policy', 'priority') as s:
        for prio in (-5, 0, 7):
            r = httpx.post(
                s.url + CMPL,
                json=dict(prompt='The capital of France is', max_tokens=4, temperature=0, priority=prio),
                timeout=60,
            )
            assert r.status_code == 200, r.text
        assert_error(httpx.post(s.url + CMPL, json=dict(prompt='hi', priority=2**63)), 400, 'priority')
