"""Shared pytest setup.

On a machine without CUDA, Triton kernels run under the interpreter. The variable is read when a `@triton.jit`
function is defined, so it must be set before any kernel module is imported: here, before the test modules load.

Markers: `cuda` tests need a CUDA GPU (select them with `-m cuda`) and are skipped without one; `interp` tests run
the Triton kernels under the interpreter (the CPU path) and are skipped where it is off, i.e. on a GPU machine.
"""

import os

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


def pytest_collection_modifyitems(config, items):
    interp = os.environ.get('TRITON_INTERPRET') == '1'
    for item in items:
        if item.get_closest_marker('cuda') and not _cuda:
            item.add_marker(pytest.mark.skip(reason='needs a CUDA GPU'))
        if item.get_closest_marker('interp') and not interp:
            item.add_marker(pytest.mark.skip(reason='CPU tests run the Triton interpreter'))
