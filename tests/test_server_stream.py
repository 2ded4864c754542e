"""The server's process split end to end (CPU, the embedded model): the engine core runs in its own process, the API
process streams every step's tokens as they come (one SSE chunk per token), a disconnect frees the request's KV blocks,
and a dead core fails requests with a 503 instead of leaving them hanging."""

from __future__ import annotations
import json
import os
import signal
import time
from pathlib import Path
import httpx
import pytest
from _serverproc import API_ARGS, ServerProcess, metric, shared_server

STORY = [{'role': 'user', 'content': 'Write a long story about a cat who lives in a lighthouse.'}]


def core_pids(pid: int) -> list[int]:
    "Pids of the engine-core processes that `pid` spawned (its children running multiprocessing's spawn_main, from /proc)."
    out = []
    for st in Path('/proc').glob('[0-9]*/stat'):
        try:
            ppid = int(st.read_text().rsplit(')', 1)[1].split()[1])
            if ppid == pid and b'spawn_main' in (st.parent / 'cmdline').read_bytes():
                out.append(int(st.parent.name))
        except OSError:
            continue
    return out


def sse_events(r: httpx.Response) -> list[dict]:
    "The JSON events of an SSE response, up to `[DONE]`."
    out = []
    for line in r.iter_lines():
        if not line:
            continue
        assert line.startswith('data: '), line
        if line == 'data: [DONE]':
            break
        out.append(json.loads(line[6:]))
    return out


SERVER_ARGS = API_ARGS  # the server shared with the other API modules (tests/_serverproc.py)


@pytest.fixture(scope='module')
def server():
    return shared_server(*SERVER_ARGS)


def test_core_is_its_own_process(server):
    "The model runs in a child process of the server (the engine core), not in the API process."
    assert len(core_pids(server.proc.pid)) == 1


def test_one_chunk_per_token(server):
    "A greedy streamed chat answer: exactly one content chunk per generated token, text equal to the non-streamed answer."
    body = dict(messages=STORY, max_tokens=40, temperature=0)
    ref = httpx.post(server.url + '/v1/chat/completions', json=body, timeout=120).json()
    assert ref['choices'][0]['finish_reason'] == 'length', ref
    with httpx.stream(
        'POST',
        server.url + '/v1/chat/completions',
        timeout=120,
        json=body | {'stream': True, 'stream_options': {'include_usage': True}},
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    usage = events[-1]['usage']
    content = [e['choices'][0]['delta'].get('content') for e in events if e['choices']]
    chunks = [c for c in content if c]  # the first event is the role with empty content
    assert len(chunks) == usage['completion_tokens'] == ref['usage']['completion_tokens'] == 40
    assert ''.join(chunks) == ref['choices'][0]['message']['content']
    assert [e['choices'][0]['finish_reason'] for e in events if e['choices']][-1] == 'length'


def test_completion_stream_chunks_and_stop_string(server):
    "/v1/completions streams one chunk per token too; a stop string (found in the API process) ends the stream as 'stop'."
    body = dict(prompt='1, 2, 3, 4,', max_tokens=30, temperature=0)
    ref = httpx.post(server.url + '/v1/completions', json=body, timeout=120).json()['choices'][0]
    with httpx.stream('POST', server.url + '/v1/completions', json=body | {'stream': True}, timeout=120) as r:
        events = sse_events(r)
    texts = [e['choices'][0]['text'] for e in events if e['choices'][0]['text']]
    assert ''.join(texts) == ref['text'] and len(texts) == 30
    stop = ref['text'][8:12]
    got = httpx.post(server.url + '/v1/completions', json=body | {'stop': [stop]}, timeout=120).json()['choices'][0]
    assert got['finish_reason'] == 'stop' and got['stop_reason'] == stop
    assert got['text'] == ref['text'][: ref['text'].index(stop)]
    deadline = time.time() + 10
    while metric(server.url, 'cvllm:num_requests_running') and time.time() < deadline:
        time.sleep(0.1)
    assert (
        metric(server.url, 'cvllm:num_requests_running') == 0 and metric(server.url, 'cvllm:kv_cache_usage_perc') == 0
    )


def test_abort_on_disconnect_frees_blocks(server):
    "A client that goes away mid-stream: its request is aborted and its KV blocks are free a step later."
    aborted = metric(server.url, 'cvllm:request_aborted_total')
    body = dict(prompt='Once upon a time', max_tokens=800, ignore_eos=True, stream=True)
    with httpx.stream('POST', server.url + '/v1/completions', json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert metric(server.url, 'cvllm:num_requests_running') == 1
        assert metric(server.url, 'cvllm:kv_cache_usage_perc') > 0
    deadline = time.time() + 10
    while time.time() < deadline:
        if (
            metric(server.url, 'cvllm:kv_cache_usage_perc') == 0
            and metric(server.url, 'cvllm:num_requests_running') == 0
        ):
            break
        time.sleep(0.05)
    assert (
        metric(server.url, 'cvllm:kv_cache_usage_perc') == 0 and metric(server.url, 'cvllm:num_requests_running') == 0
    )
    assert metric(server.url, 'cvllm:request_aborted_total') == aborted + 1


@pytest.mark.own_server
def test_dead_core_is_503():
    "Kill the engine core: the stream in flight ends with a 503 error event at once, new requests get 503, /health 503."
    with ServerProcess('--max-model-len', '512', '--mem', '32') as s:
        body = dict(prompt='Once upon a time', max_tokens=400, ignore_eos=True, stream=True)
        with httpx.stream('POST', s.url + '/v1/completions', json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            (core,) = core_pids(s.proc.pid)
            t0 = time.time()
            os.kill(core, signal.SIGKILL)
            rest = [l for l in lines if l]
        assert time.time() - t0 < 30
        err = json.loads(rest[-2][6:]) if rest[-1] == 'data: [DONE]' else json.loads(rest[-1][6:])
        assert 'died' in err['error']['message'] and 'ServiceUnavailable' in err['error']['type'], rest[-3:]
        r = httpx.post(s.url + '/v1/completions', json=dict(prompt='hi', max_tokens=4), timeout=30)
        assert r.status_code == 503 and 'engine core' in r.json()['error']['message'], r.text
        assert httpx.get(s.url + '/health', timeout=10).status_code == 503
        assert s.proc.poll() is None  # the API process is still up, answering
