"""MCP tools run by the server (issue 45), end to end: a real `cvllm-serve` started with
`--tool-server "python tests/mcp_test_server.py"` (the test MCP server over stdio: `add`, `boom` that raises, `hang`
that never answers in time), talked to with the `openai` SDK's `client.responses.create`.

The embedded model (SmolLM2-135M) will not call a tool by itself, so each request forces the first step's call with
a named MCP `tool_choice` (constrained decoding: arguments valid for the tool's schema); the server runs the call
on the MCP server, feeds the result back and lets the model answer. What is checked is the server's side: the
tool's real output in the `mcp_call` item, errors and timeouts as results, the loop's end, the refusals, the
streamed events, and that no MCP child process outlives the server."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from _serverproc import ServerProcess

SRV = shlex.join([sys.executable, str(Path(__file__).with_name('mcp_test_server.py'))])
CALC = {'type': 'mcp', 'server_label': 'calc', 'allowed_tools': ['add'], 'require_approval': 'never'}
REQUEST_TIMEOUT = -32001  # the MCP SDK's code of a request that timed out


@pytest.fixture(scope='module')
def server():
    args = ['--max-model-len', '512', '--mem', '64', '--generation-config', 'vllm', '--served-model-name', 'smol']
    with ServerProcess(*args, '--tool-server', SRV, '--tool-call-timeout', '2') as s:
        yield s


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(api_key='none', base_url=server.url + '/v1', timeout=120, max_retries=0)


def forced(name: str, **kw) -> dict:
    "A request whose first step must call `name` of the calc server."
    return (
        dict(
            model='smol',
            input=f'Use the {name} tool.',
            tools=[CALC | {'allowed_tools': [name]}],
            tool_choice={'type': 'mcp', 'server_label': 'calc', 'name': name},
            max_output_tokens=60,
            temperature=0,
        )
        | kw
    )


def mcp_children(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if 'mcp_test_server.py' in ' '.join(p.cmdline())]


def test_add_runs_on_the_server(client):
    "The call is run on the MCP server: the item's output is the sum of the arguments the model wrote; then it answers."
    r = client.responses.create(**forced('add', input='What is 2 + 3? Use the add tool.'))
    assert [i.type for i in r.output[:2]] == ['mcp_list_tools', 'mcp_call']
    assert [t.name for t in r.output[0].tools] == ['add']
    call = r.output[1]
    args = json.loads(call.arguments)
    assert (call.server_label, call.name, call.status, call.error) == ('calc', 'add', 'completed', None)
    assert call.output == str(args['a'] + args['b'])
    assert all(i.type != 'mcp_call' for i in r.output[2:])  # the second step answered: the loop ended
    assert r.status in ('completed', 'incomplete') and r.usage.output_tokens <= 60
    back = client.responses.retrieve(r.id)  # stored with its items
    assert back.output[1].output == call.output


def test_tool_errors_are_results(client):
    "A tool that raises and one that hangs past --tool-call-timeout are failed mcp_call items in a 200."
    b = client.responses.create(**forced('boom'))
    assert (b.output[1].name, b.output[1].status, b.output[1].error.type) == (
        'boom',
        'failed',
        'mcp_tool_execution_error',
    )
    t0 = time.monotonic()
    h = client.responses.create(**forced('hang'))
    assert time.monotonic() - t0 < 30  # the 2 s timeout and two short steps, not the tool's hour
    e = h.output[1].error
    assert (h.output[1].status, e.type, e.code) == ('failed', 'mcp_protocol_error', REQUEST_TIMEOUT)


def test_allowed_tools(client):
    "Only the allowed tools are listed and offered: a tool_choice naming another is a 400."
    r = client.responses.create(**forced('add', tools=[CALC | {'allowed_tools': ['add', 'echo']}]))
    assert sorted(t.name for t in r.output[0].tools) == ['add', 'echo']
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**forced('add', tool_choice={'type': 'mcp', 'server_label': 'calc', 'name': 'boom'}))
    assert 'does not offer' in str(e.value)


def test_refusals(server):
    "A server_label the operator did not start, an approval flow, a server of the client's own: 400s in OpenAI's shape."
    for tool, says in (
        (CALC | {'server_label': 'web'}, "'web' is not a tool server"),
        (CALC | {'require_approval': 'always'}, 'approvals are not supported'),
        (CALC | {'server_url': 'https://example.com/mcp'}, '--tool-server'),
    ):
        r = httpx.post(server.url + '/v1/responses', json={'input': 'x', 'tools': [tool]}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()['error']
        assert sorted(err) == ['code', 'message', 'param', 'type'] and err['param'] == 'tools'
        assert says in err['message'], err


def test_stream_events(client):
    "Streamed: the MCP items' events in order, numbered from 0; the SDK accumulates the plain answer's items."
    plain = client.responses.create(**forced('add', input='What is 2 + 3? Use the add tool.'))
    with client.responses.stream(**forced('add', input='What is 2 + 3? Use the add tool.')) as s:
        evs = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    kinds = [e.type.removeprefix('response.') for e in evs]
    k0, k1 = kinds.index('mcp_call.in_progress'), kinds.index('mcp_call_arguments.done')
    assert kinds[: k0 + 1] == [
        'created',
        'in_progress',
        'output_item.added',
        'mcp_list_tools.in_progress',
        'mcp_list_tools.completed',
        'output_item.done',
        'output_item.added',
        'mcp_call.in_progress',
    ]
    assert set(kinds[k0 + 1 : k1]) == {'mcp_call_arguments.delta'}
    assert kinds[k1 : k1 + 3] == ['mcp_call_arguments.done', 'mcp_call.completed', 'output_item.done']
    assert kinds[-1] == 'completed'
    assert [(i.type, getattr(i, 'output', None)) for i in final.output] == [
        (i.type, getattr(i, 'output', None)) for i in plain.output
    ]
    assert final.output_text == plain.output_text


def test_shutdown_stops_the_tool_server(server):
    "Stopping the server (Ctrl-C) ends the MCP session: its child process is gone (this test stops the module's server)."
    kids = mcp_children(server.proc.pid)
    assert len(kids) == 1
    server.stop()
    assert server.proc.returncode is not None
    gone, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, alive


@pytest.mark.own_server
def test_a_tool_server_that_fails_fails_the_start():
    "A tool server that cannot start stops cvllm-serve at start-up (no server half-up without its tools)."
    bad = shlex.join([sys.executable, '-c', 'import sys; sys.exit(3)'])
    with pytest.raises(RuntimeError) as e:
        ServerProcess(
            '--max-model-len', '512', '--mem', '64', '--tool-server', bad, '--tool-server-connect-timeout', '20'
        )
    assert 'failed to start' in str(e.value), str(e.value)[-2000:]
