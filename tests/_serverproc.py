"""Start `python -m cvllm_lab.entrypoints.serve` in a subprocess on a free local port (used by the server and browser tests).

`shared_server(*args)` is the suite's one shared server: test modules that ask for the same flags get the same process
(a server start is ~15 s of a CI core), one that asks for other flags stops it first, and so does any `ServerProcess`
started meanwhile (an `own_server` test's), so at most one server lives at a time. Modules whose tests change a
server's state (stop, kill, sleep, adapters) start their own. `tests/conftest.py` runs modules of equal flags one after
another, stops the shared server when a module of other flags begins, and at the session's end."""

from __future__ import annotations
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import httpx

import _heavy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class ServerProcess:
    "A cvllm-serve subprocess; `url` once `/health` answers. Use as a context manager (always killed)."

    starts = 0  # servers started in this process (the session summary prints it)

    def __init__(self, *args: str, timeout: float = 180):
        stop_shared()  # one server at a time: the shared one goes first
        ServerProcess.starts += 1
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.log = tempfile.NamedTemporaryFile('w+', suffix='.log', prefix='cvllm-serve-')
        cmd = [
            sys.executable,
            '-m',
            'cvllm_lab.entrypoints.serve',
            '--host',
            '127.0.0.1',
            '--port',
            str(self.port),
            '--threads',
            '1',
            '--uvicorn-log-level',
            'warning',
            *args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
        _heavy.acquire()  # released in `stop`: no tensor-parallel test of the other pytest process meanwhile
        self._heavy = True
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                msg = f'cvllm-serve exited with {self.proc.returncode}:\n{self.output()}'
                self.stop()
                raise RuntimeError(msg)
            try:
                if httpx.get(self.url + '/health', timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        msg = f'cvllm-serve did not come up in {timeout} s:\n{self.output()}'
        self.stop()
        raise RuntimeError(msg)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        if self._heavy:
            self._heavy = False
            _heavy.release()

    def healthy(self) -> bool:
        try:
            return self.proc.poll() is None and httpx.get(self.url + '/health', timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


_shared: dict = {'args': None, 'server': None}


def shared_server(*args: str) -> ServerProcess:
    "The shared server started with `args`: the live one if it has these args and answers `/health`, else a new one."
    if _shared['server'] is not None and (_shared['args'] != args or not _shared['server'].healthy()):
        stop_shared()
    if _shared['server'] is None:
        _shared['server'] = ServerProcess(*args)
        _shared['args'] = args
    return _shared['server']


def shared_args() -> tuple | None:
    "The flags of the shared server alive now (None: none is)."
    return _shared['args']


def stop_shared():
    "Stop the shared server, if one is alive."
    s, _shared['server'], _shared['args'] = _shared['server'], None, None
    if s is not None:
        s.stop()


# the flags of the API modules' shared server (test_server_bad_inputs, _cheap_requests, _e2e, _stream): two served
# names (the second an alias) and the built-in chat page
API_ARGS = ('--max-model-len', '1024', '--mem', '64', '--served-model-name', 'smol', 'alias', '--ui-server')


def metric(url: str, name: str) -> float:
    "One sample of a `/metrics` series (summed over labels)."
    text = httpx.get(url + '/metrics', timeout=10).text
    vals = [
        float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith(name + '{') or l.startswith(name + ' ')
    ]
    if not vals:
        raise KeyError(name)
    return sum(vals)
