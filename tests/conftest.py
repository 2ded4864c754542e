"""Shared pytest setup.

On a machine without CUDA, Triton kernels run under the interpreter. The variable is read when a `@triton.jit`
function is defined, so it must be set before any kernel module is imported: here, before the test modules load.

Markers: `cuda` tests need a CUDA GPU (select them with `-m cuda`) and are skipped without one; `interp` tests run
the Triton kernels under the interpreter (the CPU path) and are skipped where it is off, i.e. on a GPU machine;
`own_server` tests start a server of their own and run first in their module, before the module's shared server
fixture starts, so that two servers (an API process and an engine core each) are never alive at once: the suite's
peak memory would be theirs together. `server` marks every test of a module that starts servers (one that imports
`_serverproc.ServerProcess`): `scripts/test.sh` runs those in one pytest process and the rest in another, side by
side (with `CVLLM_TEST_HEAVY_LOCK` set, a server and a `test_tp_*` module's ranks never live at once:
`tests/_heavy.py`); `timing` tests (they compare times measured on a quiet machine) run after them, alone.

Shared servers (`_serverproc.shared_server`): a module that sets `SERVER_ARGS` gets its `server` from the one shared
server of those flags. Modules of equal `SERVER_ARGS` run one after another, their `own_server` tests first, so the
shared server starts once for all of them; a module of other flags (or none) stops it before its first test.
"""

import os
import sys

import pytest

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:
    _cuda = False
if not _cuda:
    os.environ.setdefault('TRITON_INTERPRET', '1')


def pytest_configure(config):
    config.addinivalue_line('markers', 'interp: runs Triton kernels under the interpreter (skipped on a GPU machine)')
    config.addinivalue_line('markers', "own_server: starts its own server (runs before its module's shared one)")
    config.addinivalue_line('markers', 'server: in a module that starts servers (set here, from its imports)')
    config.addinivalue_line('markers', 'timing: asserts on wall-clock times (run alone, not beside other tests)')


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: it reads the `server` marks set here
def pytest_collection_modifyitems(config, items):
    interp = os.environ.get('TRITON_INTERPRET') == '1'
    for item in items:
        if item.get_closest_marker('cuda') and not _cuda:
            item.add_marker(pytest.mark.skip(reason='needs a CUDA GPU'))
        if item.get_closest_marker('interp') and not interp:
            item.add_marker(pytest.mark.skip(reason='CPU tests run the Triton interpreter'))
        if getattr(item.module, 'ServerProcess', None) is not None:
            item.add_marker(pytest.mark.server)
    modules = {}  # first position of each module: files keep their order, `own_server` tests move to their front
    groups = {}  # first position of each shared server's flags: its modules run together, all their `own_server` first
    for i, item in enumerate(items):
        modules.setdefault(_module(item), i)
        groups.setdefault(_server_args(item) or _module(item), i)
    items.sort(  # tensor-parallel modules last: they wait for the other pytest process's servers (`tp_modules_alone`)
        key=lambda it: (
            _is_tp(it),
            groups[_server_args(it) or _module(it)],
            not it.get_closest_marker('own_server'),
            modules[_module(it)],
        )
    )


def _server_args(item) -> tuple | None:
    return getattr(item.module, 'SERVER_ARGS', None)


def _module(item) -> str:
    return item.module.__name__ if item.module else ''


def _is_tp(item) -> bool:
    return _module(item).rpartition('.')[2].startswith('test_tp_')


@pytest.fixture(autouse=True, scope='module')
def tp_modules_alone(request):
    """A `test_tp_*` module holds the suite's heavy-process lock (`tests/_heavy.py`) from its first test to its last,
    so its ranks are never alive beside a server of the other pytest process."""
    import _heavy

    tp = request.module.__name__.rpartition('.')[2].startswith('test_tp_')
    if tp:
        _stop_other_shared_server(None)  # no server beside this module's ranks, this process's own either
        _heavy.acquire()
    yield
    if tp:
        _heavy.release()


@pytest.fixture(autouse=True, scope='module')
def shared_server_of_module(request):
    """Before a module's first test: the shared server goes unless it has the module's `SERVER_ARGS` (the module's
    in-process engines never live beside another module's server)."""
    _stop_other_shared_server(getattr(request.module, 'SERVER_ARGS', None))
    yield


def _stop_other_shared_server(args):
    sp = sys.modules.get('_serverproc')
    if sp is not None and sp.shared_args() not in (None, args):
        sp.stop_shared()


def pytest_sessionfinish(session):
    sp = sys.modules.get('_serverproc')
    if sp is not None:
        sp.stop_shared()


def pytest_terminal_summary(terminalreporter):
    sp = sys.modules.get('_serverproc')
    if sp is not None and sp.ServerProcess.starts:
        terminalreporter.write_line(f'server starts: {sp.ServerProcess.starts}')
