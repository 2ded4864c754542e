"""Cheap requests that used to cost seconds (issue 49): request-supplied chat templates are refused unless the
operator trusts them (and bounded even then), huge lists under the body cap are refused by count before anything
walks them, and none of it slows a neighbour's greedy stream or /health."""

from __future__ import annotations
import asyncio
import json
import time
import httpx
import pytest

from _serverproc import API_ARGS, ServerProcess, shared_server
from test_server_bad_inputs import C, CMPL, JSON, MODEL, Q, STORY, assert_error, serve_has, stream_times

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
LOOP = '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}'


SERVER_ARGS = API_ARGS  # the server shared with the other API modules (tests/_serverproc.py)


@pytest.fixture(scope='module')
def server():
    return shared_server(*SERVER_ARGS)


CALL = {'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '{}'}}


def body(**kw) -> bytes:
    return json.dumps(dict(model=MODEL, messages=Q, max_tokens=4) | kw).encode()


@pytest.fixture(scope='module')
def huge() -> list[tuple[str, bytes, int, str | None]]:
    """(name, body, status, param): each under the 16 MB body cap, each cost seconds before. Bodies with more than
    `--max-request-body-containers` (2**18) arrays and objects are 413s while they are read, before any parsing."""
    parts = [{'type': 'text', 'text': 'a'}]
    return [
        ('100k stop strings', body(stop=[f'stop{i}' for i in range(100_000)]), 400, 'stop'),
        ('1.75M stop strings', body(stop=['s'] * 1_750_000), 400, 'stop'),
        ('350k messages', body(messages=[{'role': 'user', 'content': 'hi'}] * 350_000), 413, None),
        ('100k messages', body(messages=[{'role': 'user', 'content': 'hi'}] * 100_000), 400, 'messages'),
        ('500k content parts', body(messages=[{'role': 'user', 'content': parts * 500_000}]), 413, None),
        ('100k content parts', body(messages=[{'role': 'user', 'content': parts * 100_000}]), 400, 'messages'),
        ('50k tool calls', body(messages=[{'role': 'assistant', 'tool_calls': [CALL] * 50_000}] + Q), 400, 'messages'),
        ('a million tiny lists', body(prompt_ids=[[1]] * 1_000_000), 413, None),
        ('600k logit_bias keys', body(logit_bias={str(i): 1 for i in range(600_000)}), 400, 'logit_bias'),
        (
            '200 tools',
            body(tools=[{'type': 'function', 'function': {'name': f'f{i}'}} for i in range(200)]),
            400,
            'tools',
        ),
        ('a request template', body(chat_template=TEMPLATE), 400, 'chat_template'),
        ('a request template in kwargs', body(chat_template_kwargs={'chat_template': LOOP}), 400, 'chat_template'),
        ('a 6 MB template', body(chat_template="{{ 'hello ' * 1000000 }}"), 400, 'chat_template'),
    ]


@pytest.mark.timing
def test_huge_and_untrusted_requests_are_refused_fast(server, huge):
    "Each is a 400 in OpenAI's shape naming its field (or a 413), in well under a second."
    for name, b, status, param in huge:
        assert len(b) < 16 << 20, (name, len(b))
        t0 = time.perf_counter()
        r = httpx.post(server.url + C, content=b, headers=JSON, timeout=60)
        took = time.perf_counter() - t0
        assert_error(r, status, param)
        print(f'{name}: {len(b) / 1e6:.1f} MB refused in {took * 1e3:.0f} ms: {r.json()["error"]["message"][:100]}')
        assert took < 1.0, (name, took)
    msg = httpx.post(server.url + C, content=huge[-1][1], headers=JSON).json()['error']['message']
    assert '--trust-request-chat-template' in msg, msg


@pytest.mark.timing
def test_neighbour_and_health_undisturbed(server, huge):
    "A greedy stream gives the same text as alone while all of the above are posted, and /health stays under 1 s."
    ref = httpx.post(server.url + CMPL, json=STORY, timeout=120).json()['choices'][0]['text']

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            normal = asyncio.ensure_future(stream_times(c, STORY))
            await asyncio.sleep(0.2)
            bad = asyncio.gather(*[c.post(C, content=b, headers=JSON) for _, b, _, _ in huge])
            health = []
            while not bad.done():
                t0 = time.perf_counter()
                assert (await c.get('/health')).status_code == 200
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            return (await normal)[0], await bad, health

    text, bad, health = asyncio.run(run())
    for (_, _, status, param), r in zip(huge, bad):
        assert_error(r, status, param)
    assert text == ref and text, (text, ref)
    assert health and max(health) < 1.0, (max(health), health)


def test_long_message_error_says_characters_and_tokens(server):
    r = httpx.post(server.url + C, json=dict(model=MODEL, messages=[{'role': 'user', 'content': 'x' * 5_242_880}]))
    assert_error(r, 400, 'messages')
    m = r.json()['error']['message']
    assert m.startswith(
        "The messages (5242880 characters) can't fit this model's maximum context length of 1024 tokens"
    )
    assert 'more than 5242880 tokens' not in m, m


@pytest.mark.skipif(
    not serve_has('--trust-request-chat-template'), reason='cvllm-serve has no --trust-request-chat-template yet'
)
@pytest.mark.own_server
def test_trusted_request_template_is_bounded():
    "With the operator's flag a request's template is used, and a looping or huge one is a 400 within the bound."
    with ServerProcess(
        '--max-model-len', '1024', '--mem', '64', '--served-model-name', MODEL, '--trust-request-chat-template'
    ) as s:
        r = httpx.post(
            s.url + '/v1/chat/completions',
            content=body(chat_template=TEMPLATE, temperature=0),
            headers=JSON,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()['usage']['prompt_tokens'] == len(
            httpx.post(
                s.url + '/tokenize',
                json=dict(prompt='user: What is the capital of France?\nassistant:', add_special_tokens=False),
            ).json()['tokens']
        )
        for b, what in (
            (body(chat_template=LOOP), 'within'),
            (body(chat_template="{{ 'hello ' * 1000000 }}"), 'longer than'),
        ):
            t0 = time.perf_counter()
            r = httpx.post(s.url + C, content=b, headers=JSON, timeout=60)
            assert_error(r, 400, 'chat_template')
            assert what in r.json()['error']['message'] and time.perf_counter() - t0 < 8, r.json()
        assert httpx.get(s.url + '/health', timeout=1).status_code == 200


@pytest.mark.timing
def test_stop_strings_do_not_slow_a_neighbour(server):
    "Four requests with the most stop strings allowed (128 of 128 characters) cost a greedy neighbour no more per token than four without."
    import random
    import statistics

    rng = random.Random(0)
    many = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz ') for _ in range(125)) + f'{i:03d}' for i in range(128)]
    other = STORY | dict(prompt='The history of the city begins', max_tokens=40)

    async def gaps(stop):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            others = [asyncio.ensure_future(c.post(CMPL, json=other | dict(stop=stop))) for _ in range(4)]
            await asyncio.sleep(0.3)  # they are running
            text, times = await stream_times(c, STORY | dict(max_tokens=30))
            for r in await asyncio.gather(*others):
                assert r.status_code == 200, r.text
            return text, statistics.median(b - a for a, b in zip(times, times[1:]))

    base_text, base = asyncio.run(gaps(None))
    text, with_stops = asyncio.run(gaps(many))
    print(
        f'neighbour step: {base * 1e3:.1f} ms beside 4 plain requests, {with_stops * 1e3:.1f} ms beside 4 with 128 stop strings'
    )
    assert text == base_text
    assert with_stops < 1.25 * base + 0.01, (base, with_stops)


@pytest.mark.timing
def test_stop_string_flood_does_not_delay_a_neighbour(server):
    "While 100k-stop-string bodies are posted and refused, a greedy stream's tokens keep arriving about one step apart."
    import statistics

    flood = body(stop=[f'stop{i}' for i in range(100_000)])
    stream_body = STORY | dict(max_tokens=60)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            _, alone = await stream_times(c, stream_body)
            task = asyncio.ensure_future(stream_times(c, stream_body))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            rs = [await c.post(C, content=flood, headers=JSON) for _ in range(6)]
            t1 = time.perf_counter()
            return alone, (await task)[1], rs, (t0, t1)

    alone, times, rs, (t0, t1) = asyncio.run(run())
    for r in rs:
        assert_error(r, 400, 'stop')
    step = statistics.median(b - a for a, b in zip(alone, alone[1:]))
    gaps = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
    assert gaps, 'the flood did not overlap the stream'
    print(f'step {step * 1e3:.1f} ms; largest gap during the flood {max(gaps) * 1e3:.1f} ms')
    assert max(gaps) < 2 * step + 0.05, (max(gaps), step)
