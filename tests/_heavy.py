"""One group of heavy processes at a time across the suite's pytest processes.

`scripts/test.sh` runs two pytest processes side by side (the modules that start servers, and the rest). A server
(an API process and an engine core) beside a tensor-parallel test (the pytest process as rank 0 and its worker
ranks) made the suite's peak: about 8 GB summed. Both take this lock while their processes live: a server from its
start to its stop, a `test_tp_*` module from its first test to its last. The lock is a `flock` on the file named by
`CVLLM_TEST_HEAVY_LOCK`. Unset (the default of `scripts/test.sh`) it does nothing: the servers then wait out the
tensor-parallel modules, so the run is longer for a lower peak; set it on a machine with less memory. It is re-entrant
within one process (a tensor-parallel module that also starts a server takes it once)."""

from __future__ import annotations

import fcntl
import os

_held = {'depth': 0, 'file': None}


def acquire() -> None:
    "Take the suite's heavy-process lock (blocks while the other pytest process holds it)."
    path = os.environ.get('CVLLM_TEST_HEAVY_LOCK')
    if not path:
        return
    if _held['depth'] == 0:
        f = open(path, 'a')
        fcntl.flock(f, fcntl.LOCK_EX)
        _held['file'] = f
    _held['depth'] += 1


def release() -> None:
    "Give back one `acquire`; the lock is released when the last one is given back."
    if not os.environ.get('CVLLM_TEST_HEAVY_LOCK') or _held['depth'] == 0:
        return
    _held['depth'] -= 1
    if _held['depth'] == 0:
        fcntl.flock(_held['file'], fcntl.LOCK_UN)
        _held['file'].close()
        _held['file'] = None
