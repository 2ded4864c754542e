"""The tensor-parallel executor at the message level, with real processes (2 gloo ranks) and a fake model runner.

The fake runner answers every scheduled request with a token computed from everything a model runner reads
(tokens, computed and scheduled counts, block table, seeds) and all-reduced across the ranks, so a token comes
back right only if every rank rebuilt the engine's `SchedulerOutput` exactly and the group works. The engine side
is a real `Scheduler` with a small pool (preemption) and prefix caching. Then the failures: a worker that raises,
one that dies, one that hangs, each a `WorkerError` naming the worker, never a hang. And the torchrun path
(`DriverExecutor` on rank 0, `worker_busy_loop` on rank 1).
"""

import functools
import os
import subprocess
import sys
import time
import zlib

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.engine.kv_cache_manager import KVCacheManager
from cvllm_lab.engine.request import Request
from cvllm_lab.engine.scheduler import Scheduler
from cvllm_lab.engine.worker import (
    DriverExecutor,
    MultiprocExecutor,
    Worker,
    WorkerError,
    worker_busy_loop,
)
from cvllm_lab.engine.step_message import runner_view
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.utils import parallel_state as ps

WORLD = 2


def fingerprint(view) -> int:
    "A token id from one request's runner view (process-independent: crc32, not hash())."
    return zlib.crc32(repr(view).encode()) % 1000


class FakeRunner:
    "A model runner stand-in: per request, its fingerprint, summed over the ranks (so divided back by the size)."

    def __init__(self, worker, fail=None):
        self.rank, self.fail, self.steps, self.device = worker.rank, fail, 0, worker.device
        self.num_blocks = 9  # what the executor reports as the KV pool

    def execute_model(self, so):
        self.steps += 1
        if self.fail and self.rank == self.fail[1] and self.steps == self.fail[2]:
            kind = self.fail[0]
            if kind == 'raise':
                raise ValueError(f'boom at step {self.steps}')
            if kind == 'exit':
                os._exit(7)
            if kind == 'hang':
                time.sleep(3600)
        views = runner_view(so)
        t = torch.tensor([fingerprint(v) for v in views] + [self.rank], dtype=torch.long, device=self.device)
        ps.tensor_model_parallel_all_reduce(t)
        n = ps.get_tensor_model_parallel_world_size()
        assert int(t[-1]) == n * (n - 1) // 2  # every rank took part
        return {v[0]: int(x) // n for v, x in zip(views, t[:-1].tolist())}

    def ping(self, x):
        return (self.rank, x)

    def env(self):
        return {
            k: os.environ.get(k)
            for k in (
                'NCCL_NVLS_ENABLE',
                'TORCH_SYMM_MEM_DISABLE_MULTICAST',
                'NVSHMEM_DISABLE_NVLS',
                'CUDA_VISIBLE_DEVICES',
            )
        }


def drive(execute, n_reqs=6, seed=0):
    "Run a real scheduler through `execute(so)`; check each answer against the engine-side fingerprints."
    g = torch.Generator().manual_seed(seed)
    sched = Scheduler(KVCacheManager(9, 4, True), max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8)
    shared = torch.randint(0, 100, (8,), generator=g).tolist()
    for i in range(n_reqs):
        prompt = shared + torch.randint(0, 100, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        sched.add_request(
            Request(
                str(i), prompt, SamplingParams(max_tokens=int(torch.randint(3, 10, (), generator=g)), seed=i), (), 4
            )
        )
    steps = 0
    while True:
        so = sched.schedule()
        if so.is_empty:
            break
        expected = {v[0]: fingerprint(v) for v in runner_view(so)}
        assert execute(so) == expected
        sched.update_computed(so)
        sched.update_from_output(
            so, {r.request_id: expected[r.request_id] for r in so.scheduled if r.num_computed_tokens == r.num_tokens}
        )
        steps += 1
    assert sched.num_preemptions > 0 and sched.num_unfinished == 0
    return steps


def test_executor_runs_scheduled_steps_on_two_ranks():
    with MultiprocExecutor(WORLD, FakeRunner, 'cpu', block_size=4, step_timeout_s=60) as ex:
        assert [i['rank'] for i in ex.infos] == [0, 1] and all(i['world_size'] == WORLD for i in ex.infos)
        assert ex.collective_rpc('ping', 5) == [(0, 5), (1, 5)]
        assert ex.num_blocks == 9 and ex.collective_rpc('num_blocks') == [9, 9]
        assert drive(ex.execute_model) > 10
    assert not any(p.is_alive() for p in ex.procs)
    with pytest.raises(WorkerError, match='shut down'):
        ex.collective_rpc('ping', 1)


@pytest.mark.parametrize(
    'kind, match',
    [
        ('raise', r'worker 1 failed during a step:(.|\n)*boom at step 3'),
        ('exit', r'worker 1 \(pid \d+\) died with exit code 7 during a step'),
        ('hang', r'no reply from worker\(s\) \[0\] within 4 s during a step'),
    ],
)
def test_executor_failures_are_errors_not_hangs(kind, match):
    ex = MultiprocExecutor(
        WORLD, functools.partial(FakeRunner, fail=(kind, 1, 3)), 'cpu', block_size=4, step_timeout_s=4
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=match):
        drive(ex.execute_model)
    assert time.monotonic() - t0 < 30
    assert not any(p.is_alive() for p in ex.procs)  # every worker stopped
    with pytest.raises(WorkerError, match=match):
        ex.execute_model(None)  # and the executor stays failed
    ex.shutdown()


CORE = """
import functools, sys
from test_tp_worker import FakeRunner, drive
from cvllm_lab.engine.worker import MultiprocExecutor

if __name__ == '__main__':
    ex = MultiprocExecutor(2, functools.partial(FakeRunner, fail=('hang', 1, 1)), 'cpu', block_size=4, step_timeout_s=600)
    print(*[p.pid for p in ex.procs], flush=True)
    drive(ex.execute_model)  # rank 1 hangs in its first step; rank 0 waits for it inside the all-reduce
"""


def test_workers_die_with_their_core(tmp_path):
    "A core killed (SIGKILL) while rank 0 is blocked in a collective and rank 1 hangs: both workers gone in seconds."
    (tmp_path / 'core.py').write_text(CORE)
    env = os.environ | {'PYTHONPATH': os.pathsep.join([os.path.dirname(__file__), os.environ.get('PYTHONPATH', '')])}
    core = subprocess.Popen([sys.executable, str(tmp_path / 'core.py')], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in core.stdout.readline().split()]
        assert len(pids) == WORLD, pids
        time.sleep(1.0)  # the step is under way: rank 0 inside the all-reduce
        assert all(alive(p) for p in pids)
    finally:
        core.kill()
        core.wait()
    t0 = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), f'workers outlived their core: {[p for p in pids if alive(p)]}'


def alive(pid: int) -> bool:
    "The process exists and is not a zombie."
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.cuda
def test_executor_on_gpus_with_nccl():
    "Two GPU workers (NCCL), chosen by device ids as candle-vllm's --d: steps, NVLink multicast off in the workers."
    if torch.cuda.device_count() < 2:
        pytest.skip('needs 2 GPUs')
    ids = [torch.cuda.device_count() - 1, 0]  # a non-trivial --d order
    with MultiprocExecutor(WORLD, FakeRunner, 'cuda', device_ids=ids, block_size=4, step_timeout_s=120) as ex:
        assert [i['device'] for i in ex.infos] == ['cuda:0', 'cuda:1']
        for e in ex.collective_rpc('env'):
            assert e == {
                'NCCL_NVLS_ENABLE': '0',
                'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1',
                'NVSHMEM_DISABLE_NVLS': '1',
                'CUDA_VISIBLE_DEVICES': ','.join(map(str, ids)),
            }
        assert drive(ex.execute_model) > 10


def _torchrun_rank(rank, port, q):
    "What torchrun's processes do: rank 0 drives (engine + worker 0), rank 1 serves steps."
    try:
        w = Worker(ps.DistInit(rank, WORLD, rank, '127.0.0.1', port), 'cpu', block_size=4, timeout_s=30)
        w.init_device()
        w.load_model(FakeRunner)
        if rank == 0:
            ex = DriverExecutor(w)
            steps = drive(ex.execute_model)
            ex.shutdown()
            q.put(('ok', steps))
        else:
            worker_busy_loop(w)
    except BaseException as e:
        q.put(('error', repr(e)))
        raise
    finally:
        ps.destroy_distributed()


def test_torchrun_driver_broadcasts_steps():
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_torchrun_rank, args=(ps.free_port(), q), nprocs=WORLD, join=True)
    kind, steps = q.get()
    assert kind == 'ok' and steps > 10


def _torchrun_main():
    "Run by `torchrun` (below): the process's place comes from torchrun's environment, as on a real cluster."
    init = ps.DistInit.from_env()
    w = Worker(init, 'cpu', block_size=4, timeout_s=30)
    w.init_device()
    w.load_model(FakeRunner)
    try:
        if init.rank == 0:
            ex = DriverExecutor(w)
            print(f'steps={drive(ex.execute_model)} world={ex.world_size}', flush=True)
            ex.shutdown()
        else:
            worker_busy_loop(w)
    finally:
        ps.destroy_distributed()


def test_two_nodes_on_one_host_with_torchrun(tmp_path):
    "`torchrun --nnodes 2 --node-rank R` twice on the loopback, one process per 'node': the multi-node launch."
    port = ps.free_port()
    env = {
        **os.environ,
        'OMP_NUM_THREADS': '1',
        'PYTHONPATH': os.path.dirname(__file__) + os.pathsep + os.environ.get('PYTHONPATH', ''),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                '-m',
                'torch.distributed.run',
                '--nnodes',
                '2',
                '--nproc-per-node',
                '1',
                '--node-rank',
                str(r),
                '--master-addr',
                '127.0.0.1',
                '--master-port',
                str(port),
                __file__,
                '--torchrun',
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert 'world=2' in outs[0] and int(outs[0].split('steps=')[1].split()[0]) > 10, outs[0]


if __name__ == '__main__' and '--torchrun' in sys.argv:
    _torchrun_main()
