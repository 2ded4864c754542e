"""The suite's heavy-process lock (`tests/_heavy.py`): re-entrant in one process, exclusive across processes."""

import subprocess
import sys
from pathlib import Path

import _heavy

HERE = Path(__file__).parent
TRY = 'import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)'


def _other_process_gets_it(path) -> bool:
    return subprocess.run([sys.executable, '-c', TRY, str(path)], capture_output=True).returncode == 0


def test_heavy_lock_is_exclusive_and_reentrant(tmp_path, monkeypatch):
    path = tmp_path / 'heavy.lock'
    monkeypatch.setenv('CVLLM_TEST_HEAVY_LOCK', str(path))
    _heavy.acquire()
    _heavy.acquire()  # a TP module that starts a server: taken once, no self-deadlock
    assert not _other_process_gets_it(path)
    _heavy.release()
    assert not _other_process_gets_it(path)  # still held by the outer acquire
    _heavy.release()
    assert _other_process_gets_it(path)
    _heavy.release()  # one too many is harmless
    assert _other_process_gets_it(path)
