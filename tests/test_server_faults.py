"""Faults and real clients against the real server (CPU, the embedded model; issue 49): the engine core never outlives
its API process (SIGTERM, SIGKILL, SIGINT, a failed start), a killed core is logged once, a frozen core turns
`/health` into a 503, SIGTERM drains streams and ends the rest with an error event and `[DONE]`, an unknown model is
a 404, `/openapi.json` documents the real responses, and lm-eval's default `local-completions` runs offline."""

from __future__ import annotations
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
import httpx
import pytest
from _serverproc import ServerProcess

MODEL = 'smol'
ARGS = ('--max-model-len', '512', '--mem', '32', '--served-model-name', MODEL)


def alive(pid: int) -> bool:
    "The process exists and is not a zombie."
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def core_pid(log: str) -> int:
    "The engine core's pid, from the server's start-up line."
    return int(re.search(r'the engine core is process (\d+)', log).group(1))


def wait_gone(pid: int, timeout: float) -> float:
    "Seconds until `pid` is gone (fails past `timeout`)."
    t0 = time.time()
    while alive(pid):
        assert time.time() - t0 < timeout, f'process {pid} still alive after {timeout} s'
        time.sleep(0.05)
    return time.time() - t0


def open_stream(url: str, **kw):
    "Start a streamed completion; returns (response, its line iterator) after the first event."
    body = dict(model=MODEL, prompt='Once upon a time', max_tokens=400, ignore_eos=True, stream=True) | kw
    cm = httpx.stream('POST', url + '/v1/completions', json=body, timeout=120)
    r = cm.__enter__()
    assert r.status_code == 200, r.read()
    lines = (l for l in r.iter_lines() if l)
    next(lines)
    return cm, lines


def events(lines) -> list:
    "The rest of an SSE stream: parsed events, with '[DONE]' as the string."
    return ['[DONE]' if l == 'data: [DONE]' else json.loads(l[6:]) for l in lines]


@pytest.fixture(scope='module')
def server():
    with ServerProcess(*ARGS, '--engine-iteration-timeout', '2', '--shutdown-timeout', '60') as s:
        yield s


def test_unknown_model_is_404(server):
    "vLLM's (and OpenAI's) answer: 404 NotFoundError naming the model param."
    for path, body in (
        ('/v1/chat/completions', dict(model='gpt-4o', messages=[{'role': 'user', 'content': 'hi'}])),
        ('/v1/completions', dict(model='nope', prompt='hi')),
        ('/tokenize', dict(model='nope', prompt='hi')),
    ):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 404, (path, r.text)
        err = r.json()['error']
        assert (err['type'], err['param'], err['code']) == ('NotFoundError', 'model', 404), err
        assert body['model'] in err['message']


def test_openapi_documents_real_responses(server):
    "Every error status the routes answer is in the schema with the error body; streams, /health, /metrics typed."
    spec = httpx.get(server.url + '/openapi.json', timeout=30).json()
    paths = spec['paths']
    for route in ('/v1/chat/completions', '/v1/completions'):
        rs = paths[route]['post']['responses']
        assert {'200', '400', '404', '413', '500', '503'} <= set(rs), sorted(rs)
        assert rs['404']['content']['application/json']['schema'] == {'$ref': '#/components/schemas/ErrorResponse'}
        assert 'text/event-stream' in rs['200']['content'] and 'application/json' in rs['200']['content']
    assert '401' not in paths['/v1/completions']['post']['responses']  # no --api-key on this server
    err = spec['components']['schemas']['ErrorDetail']['properties']
    assert {'message', 'type', 'param', 'code'} <= set(err)
    assert set(paths['/health']['get']['responses']) == {'200', '503'}
    assert 'text/plain' in paths['/metrics']['get']['responses']['200']['content']
    assert '/tokenizer_info' in paths


def test_tokenizer_info_as_vllm(server):
    "vLLM's shape: tokenizer_config.json's fields, the class and the chat template; lm-eval needs eos_token."
    info = httpx.get(server.url + '/tokenizer_info', timeout=30).json()
    assert info['eos_token'] == '<|im_end|>' and info['bos_token'] and 'tokenizer_class' in info
    assert '<|im_start|>' in info['chat_template']
    ids = httpx.post(server.url + '/tokenize', json=dict(prompt=info['eos_token'], add_special_tokens=False)).json()
    assert len(ids['tokens']) == 1  # lm-eval's eos_token_id: encode(eos_token)[0]


def test_frozen_core_is_503_while_work_waits(server):
    "SIGSTOP the core mid-stream: /health turns 503 after --engine-iteration-timeout (2 s) and back after SIGCONT."
    pid = core_pid(server.output())
    assert httpx.get(server.url + '/health', timeout=5).status_code == 200
    cm, lines = open_stream(server.url, max_tokens=40)
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        try:
            while (r := httpx.get(server.url + '/health', timeout=5)).status_code == 200:
                assert time.time() - t0 < 15, 'health stayed 200 with the core stopped'
                time.sleep(0.2)
            stalled = time.time() - t0
            assert r.status_code == 503 and 'has not answered' in r.json()['error']['message'], r.text
            assert 1.5 < stalled < 8, stalled
        finally:
            os.kill(pid, signal.SIGCONT)
        rest = events(lines)
    finally:
        cm.__exit__(None, None, None)
    assert rest[-1] == '[DONE]' and rest[-2]['choices'][0]['finish_reason'] == 'length', rest[-3:]
    assert httpx.get(server.url + '/health', timeout=5).status_code == 200


def test_lm_eval_local_completions_offline(server, tmp_path):
    "lm-eval's default `local-completions` command (remote tokenizer through /tokenizer_info), with the hub offline."
    if shutil.which('lm_eval') is None:
        pytest.skip('lm_eval is not installed (pip install "lm-eval[api]")')
    data = tmp_path / 'data.jsonl'
    rows = [
        dict(question='The capital of France is', choices=[' Paris', ' Berlin'], answer=0),
        dict(question='Two plus two equals', choices=[' four', ' seven'], answer=0),
        dict(question='The sky on a clear day is', choices=[' green', ' blue'], answer=1),
    ]
    data.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (tmp_path / 'tiny_mc.yaml').write_text(
        f'task: cvllm_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    (tmp_path / 'tiny_gen.yaml').write_text(
        f'task: cvllm_tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: " Paris"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n'
    )
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', TRANSFORMERS_OFFLINE='1', OPENAI_API_KEY='x')
    env['HF_DATASETS_CACHE'] = str(tmp_path / 'hf')
    cmd = [
        'lm_eval',
        '--model',
        'local-completions',
        '--model_args',
        f'model={MODEL},base_url={server.url}/v1/completions',
        '--tasks',
        'cvllm_tiny_mc,cvllm_tiny_gen',
        '--include_path',
        str(tmp_path),
        '--output_path',
        str(tmp_path / 'out'),
    ]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    took = time.time() - t0
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert 'remote tokenizer' in log.lower(), log[-4000:]  # it found /tokenizer_info: nothing from the hub
    results = json.loads(next((tmp_path / 'out').rglob('results_*.json')).read_text())['results']
    assert 0 <= results['cvllm_tiny_mc']['acc,none'] <= 1 and 'cvllm_tiny_gen' in results, results
    print(f'lm_eval local-completions: {took:.1f} s')


def test_sigterm_drains_in_flight_streams(server):
    "SIGTERM with --shutdown-timeout 60: a stream in flight finishes normally, a new request gets 503, then all exit."
    pid = core_pid(server.output())
    cm, lines = open_stream(server.url, max_tokens=24)
    try:
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(server.url + '/v1/completions', json=dict(prompt='hi', max_tokens=2), timeout=10)
        assert r.status_code == 503 and 'shutting down' in r.json()['error']['message'], r.text  # heard, not refused
        assert httpx.get(server.url + '/health', timeout=10).status_code == 503  # a load balancer stops sending
        rest = events(lines)
    finally:
        cm.__exit__(None, None, None)
    assert rest[-1] == '[DONE]' and rest[-2]['choices'][0]['finish_reason'] == 'length', rest[-3:]
    server.proc.wait(30)
    wait_gone(pid, 10)
    assert 'Traceback' not in server.output(), server.output()


@pytest.mark.own_server
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_shutdown_timeout_ends_open_streams_with_error(sig):
    "Past --shutdown-timeout the open stream gets an error event and [DONE]; no traceback; API and core exit."
    with ServerProcess(*ARGS, '--shutdown-timeout', '1') as s:
        pid = core_pid(s.output())
        cm, lines = open_stream(s.url)
        try:
            t0 = time.time()
            s.proc.send_signal(sig)
            rest = events(lines)
            took = time.time() - t0
        finally:
            cm.__exit__(None, None, None)
        assert rest[-1] == '[DONE]', rest[-3:]
        err = rest[-2]['error']
        assert err['type'] == 'ServiceUnavailable' and 'shut down' in err['message'], err
        assert 0.8 < took < 15, took
        s.proc.wait(30)
        wait_gone(pid, 10)
        out = s.output()
        assert 'Traceback' not in out and 'ending 1 request(s) still running' in out, out


@pytest.mark.own_server
def test_killed_api_process_takes_its_core():
    "SIGKILL of the API process (no clean-up runs): the core is gone within a few seconds (parent-death signal)."
    with ServerProcess(*ARGS) as s:
        pid = core_pid(s.output())
        cm, lines = open_stream(s.url)  # a busy core, not only an idle one
        try:
            s.proc.kill()
            took = wait_gone(pid, 5)
        finally:
            cm.__exit__(None, None, None)
        print(f'core gone {took:.2f} s after SIGKILL of the API process')


@pytest.mark.own_server
def test_killed_core_is_logged_once():
    "kill -9 of the core: clients get a 503 event, and the server log names the signal, once."
    with ServerProcess(*ARGS) as s:
        pid = core_pid(s.output())
        cm, lines = open_stream(s.url)
        try:
            os.kill(pid, signal.SIGKILL)
            rest = events(lines)
        finally:
            cm.__exit__(None, None, None)
        assert rest[-1] == '[DONE]' and 'SIGKILL' in rest[-2]['error']['message'], rest[-2:]
        httpx.post(s.url + '/v1/completions', json=dict(prompt='hi', max_tokens=2), timeout=10)
        time.sleep(0.5)
        deaths = [l for l in s.output().splitlines() if 'engine core process' in l and 'died' in l and 'ERROR' in l]
        assert len(deaths) == 1 and 'killed by SIGKILL' in deaths[0], s.output()


@pytest.mark.own_server
def test_failed_start_stops_the_core():
    "The port is taken: uvicorn gives up after the core started; the server exits 1 and the core goes with it."
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, '-m', 'cvllm_lab.entrypoints.serve', '--host', '127.0.0.1', '--port', str(port)]
        env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
        p = subprocess.run([*cmd, '--threads', '1', *ARGS], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0, p.stderr[-3000:]
    wait_gone(core_pid(p.stderr), 5)


@pytest.mark.own_server
def test_sigterm_while_idle_stops_core_quickly():
    "SIGTERM with nothing in flight: the API process and its core are gone within seconds."
    with ServerProcess(*ARGS) as s:
        pid = core_pid(s.output())
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(15)
        wait_gone(pid, 5)
        assert time.time() - t0 < 10
        assert 'Traceback' not in s.output(), s.output()
