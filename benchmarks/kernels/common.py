"""Shared helpers of the kernel benchmarks: shapes, operands, and timing by CUDA-graph replay.

Import this module before any kernel module: with `--dry` on the command line it sets `TRITON_INTERPRET=1` (read when
a `@triton.jit` function is defined), so that a script runs on the CPU under the Triton interpreter at shapes divided
by 32, as a check of the script rather than a measurement.

Timing (`graph_time`, `time_fn`): the calls are captured in one CUDA graph, so launch overhead is not timed, and
they rotate over enough copies of the weights (>= 256 MB in all) that every call reads its weight from HBM, not
from L2. Reported: the median over `reps` replays of the time per call.
"""

import concurrent.futures as cf
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

DRY = '--dry' in sys.argv
if DRY:
    os.environ['TRITON_INTERPRET'] = '1'

PEAK = 4.2e12  # H200 measured copy bandwidth (bytes/s): `pct_peak` columns are against it
L3_8B = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}
LM_HEAD = (128256, 4096)
XDT = torch.bfloat16  # activations; the interpreter's tl.dot has no bf16, so the dry run uses fp16
if DRY:
    XDT = torch.float16
    L3_8B = {k: (n // 32, max(256, k_ // 32 // 256 * 256)) for k, (n, k_) in L3_8B.items()}  # k-quants: K % 256 == 0
    LM_HEAD = (LM_HEAD[0] // 64, LM_HEAD[1] // 32)
DEVICE = torch.device('cpu' if DRY else 'cuda')


def arg(name, default):
    "The value after `name` on the command line, else `default`."
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def device_name() -> str:
    return 'dry' if DRY else torch.cuda.get_device_name()


def num_sms() -> int:
    return 132 if DRY else torch.cuda.get_device_properties(0).multi_processor_count


def rel_err(y, ref) -> float:
    "`||y - ref|| / ||ref||` in fp32."
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def packed_w4a16(N, K, group=128, sym=True, bits=4, device=None):
    "Random weights `[N, K]` (std 0.02) quantized to the W4A16 layout: `(qweight, scales, offsets, bits, group)`."
    from cvllm_lab.quant.w4a16 import W4A16Linear

    m = W4A16Linear.from_float(torch.randn(N, K, device=device or DEVICE) * 0.02, group, bits, sym=sym)
    return (m.qweight, m.scales, m.offsets, bits, m.group)


def gemv_case(name, N, K, group=128, sym=True, device=None):
    """One M = 1 W4A16 case of the GEMV scripts: packed random weights `p = (qweight, scales, offsets)`, an x of
    `XDT` and its fp32 reference output, the packed bytes, an argument maker for `time_fn` (fresh x, weight copies)
    and the activation fused into gate_up."""
    from cvllm_lab.kernels.w4a16 import dequantize_packed_ref

    device = device or DEVICE
    p = packed_w4a16(N, K, group, sym, device=device)[:3]
    x = torch.randn(1, K, device=device, dtype=XDT)
    r = x.float() @ dequantize_packed_ref(*p, 4, group, N, K).T
    nb = sum(t.numel() * t.element_size() for t in p)
    args = lambda i: (torch.randn(1, K, device=device, dtype=XDT),) + tuple(t.clone() for t in p)
    return p, x, r, nb, args, 'silu_and_mul' if name == 'gate_up' else None


def copies_for(nbytes) -> int:
    "Weight copies per timing so that the copies together are >= 256 MB (2 .. 16)."
    return max(2, min(16, math.ceil(256e6 / nbytes)))


def graph_time(fn, n_inner, reps=10):
    """Median seconds per call of `fn(i)`, i in range(n_inner), over `reps` replays of one CUDA graph holding all
    `n_inner` calls (after a warm-up outside the graph and three untimed replays)."""
    for i in range(min(2, n_inner)):
        fn(i)  # compile / warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_inner):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(n_inner):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / n_inner)
    return statistics.median(ts)


def time_fn(make_args, fn, nbytes, reps=10):
    """Median microseconds per call of `fn(*make_args(i))` over `copies_for(nbytes)` argument sets (fresh weight
    copies) in a CUDA graph. Dry run: one eager call, timed on the CPU (a check, not a measurement)."""
    if DRY:
        a = make_args(0)
        t = time.time()
        fn(*a)
        return (time.time() - t) * 1e6
    argsets = [make_args(i) for i in range(copies_for(nbytes))]
    return graph_time(lambda i: fn(*argsets[i]), len(argsets), reps) * 1e6


def event_time_us(f, reps):
    "Median microseconds of `f()` between two CUDA events, launched eagerly (launch overhead included)."
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def precompile(worker, jobs, workers, timeout=None):
    """Run `worker(chunk)` on `workers` spawned processes, the jobs dealt round-robin, so that every config is
    compiled into Triton's disk cache in parallel before the timing runs; returns the workers' results."""
    chunks = [jobs[i::workers] for i in range(workers)]
    t = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context('spawn')) as ex:
        futs = [ex.submit(worker, c) for c in chunks if c]
        done, pending = cf.wait(futs, timeout=timeout)
        for f in pending:
            f.cancel()
        out = [f.result() for f in done]
    print(
        f'precompiled {len(jobs)} configs with {workers} workers in {time.time() - t:.0f} s'
        + (f' ({len(pending)} chunks unfinished)' if pending else ''),
        flush=True,
    )
    return out


def time_checked(run, n_inner, ref, what, tol=2e-2):
    """Microseconds per call of `run(i)` (`graph_time` over `i` in range(n_inner); the dry run: one eager call),
    None when `run(0)` is off `ref` by more than `tol` (relative) or fails (out of resources and the like)."""
    try:
        err = rel_err(run(0), ref)
        if err > tol:
            print(f'wrong: {what} rel err {err:.3g}')
            return None
        if DRY:
            t = time.time()
            run(0)
            return (time.time() - t) * 1e6
        return graph_time(run, n_inner) * 1e6
    except Exception as e:
        print(f'failed: {what}: {type(e).__name__}: {str(e)[:120]}')
        return None


def write_tuning(out_dir, kernel, dev, rows, tables, write):
    """A tuner's results so far: every timing to `<out_dir>/tune_<kernel>.csv`, the tables as `<out_dir>/<dev>.json`
    (`tuned.dump_configs`) and, with `write`, into `kernels/configs/<kernel>/<dev>.json`."""
    import csv
    from cvllm_lab.kernels import tuned

    with open(os.path.join(out_dir, f'tune_{kernel}.csv'), 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    text = tuned.dump_configs(tables)
    with open(os.path.join(out_dir, f'{dev}.json'), 'w') as f:
        f.write(text)
    if write and not DRY:
        (tuned.CONFIG_DIR / kernel / f'{dev}.json').write_text(text)


def tune_two_stage(cur, tiles, policies, measure, deadline):
    """The decode-attention tuners' search: time the current config, then every tile (`{**cur, **tile}`) at the
    current split policy, then every policy with the best tile (`{**best, **policy}`); `measure(cfg, stage)` returns
    microseconds or None (failed or wrong). Stops early at `time.time() > deadline`. Returns
    `(best, best_us, current_us)`."""
    us_cur = measure(cur, 'current')
    best, best_us = cur, us_cur if us_cur is not None else float('inf')
    for stage, cands in (('tile', tiles), ('splits', policies)):  # the policies start from the best tile
        base = cur if stage == 'tile' else best
        for c in cands:
            if time.time() > deadline:
                break
            cfg = {**base, **c}
            us = measure(cfg, stage)
            if us is not None and us < best_us:
                best, best_us = cfg, us
    return best, best_us, us_cur
