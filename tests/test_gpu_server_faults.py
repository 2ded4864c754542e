"""On a GPU (issue 49): killing the API process, with SIGTERM or SIGKILL, while its engine core is busy leaves no core
behind holding GPU memory: the core is gone and the memory it held is free again within seconds.

On a GPU machine without the embedded model's package, `CVLLM_LAB_GPU_TEST_MODEL=DIR` serves a model folder (its
config and tokenizer) with dummy weights instead."""

from __future__ import annotations
import os
import signal
import time
import httpx
import pytest
import torch
from _serverproc import ServerProcess
from test_server_faults import alive, core_pid, open_stream

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
GiB = 1 << 30
# a GPU machine without the embedded model's package: a model folder (config and tokenizer) served with dummy weights
MODEL = (
    ('--model', os.environ['CVLLM_LAB_GPU_TEST_MODEL'], '--load-format', 'dummy', '--served-model-name', 'smol')
    if os.environ.get('CVLLM_LAB_GPU_TEST_MODEL')
    else ()
)


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL])
def test_api_process_death_frees_the_gpu(sig):
    "The core holds a large KV cache; kill its API process mid-stream: core gone and memory back within 10 s."
    torch.cuda.init()
    before = free_bytes()
    with ServerProcess(
        *MODEL, '--gpu-memory-utilization', '0.5', '--shutdown-timeout', '1', '--max-model-len', '2048'
    ) as s:
        pid = core_pid(s.output())
        held = before - free_bytes()
        assert held > 4 * GiB, f'the core holds only {held / GiB:.1f} GiB'
        cm, lines = open_stream(s.url, max_tokens=1500)
        try:
            t0 = time.time()
            s.proc.send_signal(sig)
            while (alive(pid) or free_bytes() < before - GiB) and time.time() - t0 < 10:
                time.sleep(0.1)
            took = time.time() - t0
        finally:
            try:
                cm.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        assert not alive(pid), f'the core outlived its API process by {took:.1f} s'
        assert free_bytes() >= before - GiB, f'{(before - free_bytes()) / GiB:.1f} GiB still held after {took:.1f} s'
        print(f'{signal.Signals(sig).name}: core gone and memory free {took:.2f} s after the signal')
