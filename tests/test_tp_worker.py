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
import sys
import time
import zlib

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.engine.kv_cache_manager import KVCacheManager
from cvllm_lab.engine.request import Request
from cvllm_lab.engine.scheduler import Scheduler
from cvllm_lab.engine.worker import (DriverExecutor, MultiprocExecutor, Worker, WorkerError, runner_view,
                                     worker_busy_loop)
from cvllm_lab.sampling_params import SamplingParams
from cvllm_lab.utils import parallel_state as ps

WORLD = 2


def fingerprint(view) -> int:
    "A token id from one request's runner view (process-independent: crc32, not hash())."
    return zlib.crc32(repr(view).encode()) % 1000


class FakeRunner:
    "A model runner stand-in: per request, its fingerprint, summed over the ranks (so divided back by the size)."
    def __init__(self, worker, fail=None):
        self.rank, self.fail, self.steps = worker.rank, fail, 0
        self.num_blocks = 9                                     # what the executor reports as the KV pool

    def execute_model(self, so):
        self.steps += 1
        if self.fail and self.rank == self.fail[1] and self.steps == self.fail[2]:
            kind = self.fail[0]
            if kind == 'raise': raise ValueError(f'boom at step {self.steps}')
            if kind == 'exit': os._exit(7)
            if kind == 'hang': time.sleep(3600)
        views = runner_view(so)
        t = torch.tensor([fingerprint(v) for v in views] + [self.rank], dtype=torch.long)
        ps.tensor_model_parallel_all_reduce(t)
        n = ps.get_tensor_model_parallel_world_size()
        assert int(t[-1]) == n * (n - 1) // 2                 # every rank took part
        return {v[0]: int(x) // n for v, x in zip(views, t[:-1].tolist())}

    def ping(self, x): return (self.rank, x)


def drive(execute, n_reqs=6, seed=0):
    "Run a real scheduler through `execute(so)`; check each answer against the engine-side fingerprints."
    g = torch.Generator().manual_seed(seed)
    sched = Scheduler(KVCacheManager(9, 4, True), max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8)
    shared = torch.randint(0, 100, (8,), generator=g).tolist()
    for i in range(n_reqs):
        prompt = shared + torch.randint(0, 100, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=int(torch.randint(3, 10, (), generator=g)), seed=i),
                                  (), 4))
    steps = 0
    while True:
        so = sched.schedule()
        if so.is_empty: break
        expected = {v[0]: fingerprint(v) for v in runner_view(so)}
        assert execute(so) == expected
        sched.update_computed(so)
        sched.update_from_output(so, {r.request_id: expected[r.request_id] for r in so.scheduled
                                      if r.num_computed_tokens == r.num_tokens})
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
    with pytest.raises(WorkerError, match='shut down'): ex.collective_rpc('ping', 1)


@pytest.mark.parametrize('kind, match', [('raise', r'worker 1 failed during a step:(.|\n)*boom at step 3'),
                                         ('exit', r'worker 1 \(pid \d+\) died with exit code 7 during a step'),
                                         ('hang', r'no reply from worker\(s\) \[0\] within 4 s during a step')])
def test_executor_failures_are_errors_not_hangs(kind, match):
    ex = MultiprocExecutor(WORLD, functools.partial(FakeRunner, fail=(kind, 1, 3)), 'cpu', block_size=4, step_timeout_s=4)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=match): drive(ex.execute_model)
    assert time.monotonic() - t0 < 30
    assert not any(p.is_alive() for p in ex.procs)               # every worker stopped
    with pytest.raises(WorkerError, match=match): ex.execute_model(None)   # and the executor stays failed
    ex.shutdown()


def _torchrun_rank(rank, port, q):
    "What torchrun's processes do: rank 0 drives (engine + worker 0), rank 1 serves steps."
    try:
        w = Worker(ps.DistInit(rank, WORLD, rank, '127.0.0.1', port), 'cpu', block_size=4, timeout_s=30)
        w.init_device(); w.load_model(FakeRunner)
        if rank == 0:
            ex = DriverExecutor(w)
            steps = drive(ex.execute_model)
            ex.shutdown()
            q.put(('ok', steps))
        else: worker_busy_loop(w)
    except BaseException as e:
        q.put(('error', repr(e))); raise
    finally: ps.destroy_distributed()


def test_torchrun_driver_broadcasts_steps():
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_torchrun_rank, args=(ps.free_port(), q), nprocs=WORLD, join=True)
    kind, steps = q.get()
    assert kind == 'ok' and steps > 10
