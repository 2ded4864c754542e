"""The first wave of a concurrency-64 burst (64 fresh prompts at once, 8192-token steps), and what bounds its last
first token: the number the c=64 TTFT p99 of `serve_load` is made of.

    python -m benchmarks.first_wave [model] [--csv OUT.csv] [--trace OUT.json.gz]   (default llama3_8b; `tiny` on a CPU)
    python -m benchmarks.first_wave --plot OUT.csv                                   (redraw OUT.png)
    python -m benchmarks.first_wave --steps OUT.json.gz        (GPU time per step of a trace, idle gaps, long host ops)

After the GPU has idled for a few seconds (as before a burst), each run prefills 64 prompts of 1024 random tokens:

- `engine`: `LLMEngine.step()` as the engine core calls it (schedule -> launch -> wait -> update; the requests decode
  once prefilled, as in the server), timing each request's first token from the first step's start;
- `ahead`: the same prefill steps, all scheduled and launched before any result is read, so the host never makes the
  GPU wait between steps: the kernels' own floor for the wave;
- a bf16 8192^3 matmul, cold then after 2 s of back-to-back calls (the reference ran it at 764 TFLOP/s).

`--keep-rows on off` measures each wave with the runner's `keep_rows` on and off in turn (the last layer's MLP for
the sampled rows only, or for every row); `--mixed-ahead on off` likewise the engine's `mixed_ahead` (prefill steps
of the burst launched before the last one's tokens are read), `--decodes-apart on off` the runner's `decodes_apart`
(a step's leading decodes in a paged-attention call of their own when a longer chunk follows them).

`--csv` appends one row per measured wave (commit, GPU, budget, kind, last first token); `--plot` draws them against
the c=64 TTFT p99 target. Then one engine run under torch.profiler: GPU busy time and the idle gaps between kernels
(per step, and the largest ones with the host call running at the time), and each step's GPU time by kernel, written
as a Chrome trace with `--trace`; one profiled wave per `--decodes-apart` setting.
"""

from __future__ import annotations
import argparse
import collections
import gzip
import json
import os
import subprocess
import time
from pathlib import Path
import torch
import yaml
from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir, append_row
from cvllm_lab.sampling_params import SamplingParams
from benchmarks.profile_serving_steps import TINY

C, P = 64, 1024
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def smi() -> str:
    q = 'power.draw,clocks.sm,temperature.gpu,clocks_throttle_reasons.active'
    try:
        return subprocess.run(
            ['nvidia-smi', f'--query-gpu={q}', '--format=csv,noheader'], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception as e:
        return f'nvidia-smi: {e}'


def matmul_rates(seconds: float = 2.0) -> tuple[float, float]:
    "TFLOP/s of a bf16 8192^3 matmul: cold (10 calls after 3) and over the last second of `seconds` of calls."
    a, b = (torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16) for _ in range(2))
    fl = 2 * 8192**3
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    cold = 10 * fl / (time.perf_counter() - t) / 1e12
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds - 1:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
    t = time.perf_counter()
    while time.perf_counter() - t < 1:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        n += 20
    return cold, n * fl / (time.perf_counter() - t) / 1e12


def prompts(g, vocab: int):
    return [{'prompt_token_ids': torch.randint(100, min(vocab, 30000), (P,), generator=g).tolist()} for _ in range(C)]


def run_engine(eng, batch, max_tokens: int = 8) -> dict:
    "Step the engine as the core does; each request's first-token time from the first step's start, and step times."
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ids = [eng.add_request(None, p, sp) for p in batch]
    first, steps, eng.final_only = {}, [], False  # every step's outputs, as the engine core reads them
    sync()
    t0 = time.perf_counter()
    while len(first) < C:
        t = time.perf_counter()
        for o in eng.step():
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = time.perf_counter() - t0
        steps.append(time.perf_counter() - t)
    eng.abort_request(ids)
    ft = sorted(first.values())
    return dict(last=ft[-1], p50_ms=round(1e3 * ft[len(ft) // 2], 1), steps=steps)


def run_ahead(eng, batch) -> dict:
    "Schedule and launch every prefill step before reading any result (requests of one token each)."
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    ids = [eng.add_request(None, p, sp) for p in batch]
    sched, runner, launched, host = eng.scheduler, eng.runner, [], []
    sync()
    t0 = time.perf_counter()
    while True:
        so = sched.schedule()
        if so.is_empty:
            break
        t = time.perf_counter()
        launched.append((so, runner.launch(so)))
        host.append(time.perf_counter() - t)
        sched.update_computed(so)
    for so, h in launched:
        sched.update_from_output(so, h.result().sampled)
    wall = time.perf_counter() - t0
    eng.abort_request(ids)
    return dict(last=wall, steps=len(launched), launch_ms=[round(1e3 * x, 1) for x in host])


def gaps(prof, nsteps: int) -> dict:
    "GPU busy time, idle time between kernels, and the largest idle gaps with the host op running then."
    ev = prof.events()
    k = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in ev
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
    out, end, busy = [], k[0][0], 0.0
    for s, e, name in k:
        if s > end + 20:
            out.append((s - end, end, name))
        busy += max(0, e - max(s, end))
        end = max(end, e)
    span = end - k[0][0]
    top = sorted(out, reverse=True)[:12]
    return dict(
        span_ms=span / 1e3,
        busy_ms=busy / 1e3,
        idle_ms=sum(g for g, _, _ in out) / 1e3,
        idle_gaps=len(out),
        per_step_idle_ms=sum(g for g, _, _ in out) / 1e3 / nsteps,
        largest=[(round(g / 1e3, 2), name[:50], host_at(cpu, t + g / 2)[:60]) for g, t, name in top],
    )


def host_at(cpu: list[tuple[float, float, str]], t: float) -> str:
    "The innermost host op of `cpu` (`(start, end, name)`) running at time `t`, or '-'."
    live = [c for c in cpu if c[0] <= t <= c[1]]
    return min(live, key=lambda c: c[1] - c[0])[2] if live else '-'


GEMM_NAMES = ('gemm', 'nvjet', 'cutlass', 'xmma', 'cublas')
ATTENTION_NAMES = ('paged_attention', 'merge_splits', 'flash_fwd', 'cudnn', 'fmha')


def step_table(kernels: list[tuple[float, float, str]], top: int = 6) -> str:
    """GPU time per engine step of a profiled wave from its `(start us, end us, name)` kernels and copies: a step starts
    at the first host-to-device copy after 50 or more kernels (each eager step uploads its inputs before its first
    kernel). Span, busy time, the GEMMs, attention as wall time (the union of its kernels' intervals: with PDL a
    kernel starts before the one it waits for ends, so summed durations count the overlap twice), and the `top` other
    kernels by summed time (ms)."""
    if not kernels:
        return 'no GPU events'
    steps, cur, n = [], [], 0
    for s, e, name in sorted(kernels):
        if 'HtoD' in name and n >= 50:
            steps.append(cur)
            cur, n = [], 0
        cur.append((s, e, name))
        n += 'Memcpy' not in name
    steps.append(cur)
    lines = []
    for i, st in enumerate(steps, 1):
        by, att, end = collections.Counter(), 0.0, float('-inf')
        for s, e, name in st:
            by['GEMMs' if any(g in name.lower() for g in GEMM_NAMES) else name[:34]] += (e - s) / 1e3
            if any(a in name for a in ATTENTION_NAMES) and e > end:
                att += (e - max(s, end)) / 1e3
                end = e
        span, busy, gemm = (st[-1][1] - st[0][0]) / 1e3, sum(by.values()), by.pop('GEMMs', 0.0)
        rest = ', '.join(f'{n} {t:.1f}' for n, t in by.most_common(top))
        lines.append(f'step {i}: span {span:6.1f} busy {busy:6.1f} GEMMs {gemm:6.1f} attention {att:5.1f} | {rest}')
    return '\n'.join(lines)


def idle_report(
    kernels: list[tuple[float, float, str]], cpu: list[tuple[float, float, str]], min_ms: float = 2.0, top: int = 15
) -> str:
    """The GPU's idle time in a trace (its `(start us, end us, name)` kernels and host ops): by gap size, the gaps of
    0.3 ms or more by the host op running at their middle, each gap of at least `min_ms` (with the op's input shapes
    if recorded), and the `top` longest host ops: where the host held the GPU up."""
    if not kernels:
        return 'no GPU events'
    k = sorted(kernels)
    t0, end, idle = k[0][0], k[0][1], []
    for s, e, _ in k:
        if s > end:
            idle.append((end, s))
        end = max(end, e)
    sizes, by_op = collections.Counter(), collections.Counter()
    for a, b in idle:
        sizes[next(c for c in (50, 300, 1000, 3000, float('inf')) if b - a < c)] += b - a
        if b - a >= 300:
            by_op[host_at(cpu, (a + b) / 2).split(' [')[0]] += b - a
    gaps = [(a, b) for a, b in idle if b - a >= 1e3 * min_ms]
    lines = [
        f'GPU idle {sum(b - a for a, b in idle) / 1e3:.1f} ms over {(end - t0) / 1e3:.1f} ms; by gap size (us): '
        + ', '.join(f'< {c}: {v / 1e3:.1f} ms' for c, v in sorted(sizes.items())),
        'gaps >= 0.3 ms by the host op: ' + ', '.join(f'{n[:40]} {v / 1e3:.1f} ms' for n, v in by_op.most_common(8)),
        f'GPU idle gaps >= {min_ms} ms: {len(gaps)}, {sum(b - a for a, b in gaps) / 1e3:.1f} ms in all',
    ]
    lines += [
        f'  at {(a - t0) / 1e3:9.1f} ms: {(b - a) / 1e3:7.1f} ms idle, host in {host_at(cpu, (a + b) / 2)[:110]}'
        for a, b in gaps
    ]
    lines.append('longest CPU ops:')
    lines += [
        f'  at {(s - t0) / 1e3:9.1f} ms: {(e - s) / 1e3:7.1f} ms {n[:80]}'
        for s, e, n in sorted(cpu, key=lambda c: c[0] - c[1])[:top]
    ]
    return '\n'.join(lines)


def profiled_kernels(prof) -> list[tuple[float, float, str]]:
    "The GPU kernels and copies of a torch.profiler run."
    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]


def trace_events(path: str) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """The GPU kernels and copies, and the host ops (named with their input shapes if recorded), of a gzipped Chrome
    trace from torch.profiler (`--trace`, or the engine core's from `/stop_profile`)."""
    ev = [e for e in json.load(gzip.open(path))['traceEvents'] if e.get('ph') == 'X' and e.get('dur', 0) > 0]
    dims = lambda e: f' {e["args"]["Input Dims"]}' if 'Input Dims' in e.get('args', {}) else ''
    return (
        [
            (e['ts'], e['ts'] + e['dur'], e['name'])
            for e in ev
            if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset')
        ],
        [
            (e['ts'], e['ts'] + e['dur'], e['name'] + dims(e))
            for e in ev
            if e.get('cat') in ('cpu_op', 'user_annotation', 'python_function')
        ],
    )


def plot(csv: str, last: int = 5):
    """Last first token of each measured wave, per commit and setting, against the c=64 TTFT p99 target (1.4 s): the
    `last` commits measured (median bars, min-max whiskers)."""
    import pandas as pd
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    df = pd.read_csv(csv)
    for col in ('keep_rows', 'mixed_ahead', 'decodes_apart'):
        if col not in df:
            df[col] = 'off'
    df = df.fillna({'decodes_apart': 'off'})
    df = df[df.commit.isin(list(dict.fromkeys(df.commit))[-last:])]  # the last commits measured
    g = df.groupby(
        ['commit', 'budget', 'kind', 'keep_rows', 'mixed_ahead', 'decodes_apart'], sort=False
    ).last_first_token_ms
    med, lo, hi = g.median(), g.min(), g.max()
    labels = [
        f'{c}\n{k}, {b}\nkeep_rows {kr}' + (f'\nmixed ahead {m}\ndecodes apart {d}' if k == 'engine' else '')
        for c, b, k, kr, m, d in med.index
    ]
    fig, ax = plt.subplots(figsize=(1.6 * len(med) + 2, 4.2))
    bars = ax.bar(
        range(len(med)),
        med.values,
        yerr=[med.values - lo.values, hi.values - med.values],
        capsize=4,
        color=['tab:blue' if k == 'engine' else 'tab:gray' for _, _, k, *_ in med.index],
    )
    ax.bar_label(bars, fmt='%.0f', fontsize=8)
    ax.axhline(1400, color='tab:red', ls='--', label='c=64 TTFT p99 target (1,400 ms)')
    ax.set_xticks(range(len(med)), labels, fontsize=8)
    ax.set_ylabel('ms from the first step to the last first token')
    ax.set_title(
        f'First wave of a c=64 burst, in-process (64 x {P} tokens, {df.gpu.iloc[0]}): engine steps vs '
        'all steps launched ahead',
        fontsize=9,
    )
    ax.legend(loc='lower right', fontsize=8)
    fig.tight_layout()
    fig.savefig(csv.rsplit('.', 1)[0] + '.png', dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('model', nargs='?', default='llama3_8b')
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--idle', type=float, default=4.0, help='seconds of idle GPU before each measured wave')
    ap.add_argument(
        '--budgets',
        type=int,
        nargs='+',
        default=[8192],
        help="max_num_batched_tokens values to measure (the scheduler's, set between runs)",
    )
    ap.add_argument(
        '--keep-rows',
        nargs='+',
        default=['on'],
        choices=['on', 'off'],
        help="the runner's keep_rows settings to measure, in turn",
    )
    ap.add_argument(
        '--mixed-ahead',
        nargs='+',
        default=['on'],
        choices=['on', 'off'],
        help="the engine's mixed_ahead settings to measure, in turn",
    )
    ap.add_argument(
        '--decodes-apart',
        nargs='+',
        default=['on'],
        choices=['on', 'off'],
        help="the runner's decodes_apart settings to measure, in turn (engine waves)",
    )
    ap.add_argument('--trace')
    ap.add_argument('--csv', help='append a row per measured wave')
    ap.add_argument('--plot', help='redraw the plot of this CSV and exit')
    ap.add_argument('--steps', help='print the per-step table of a trace written with --trace and exit')
    a = ap.parse_args()
    if a.plot:
        return plot(a.plot)
    if a.steps:
        kernels, cpu = trace_events(a.steps)
        return print(step_table(kernels) + '\n' + idle_report(kernels, cpu))
    cuda = torch.cuda.is_available()
    if cuda:
        print(torch.cuda.get_device_name(), '|', smi(), flush=True)
        cold, hot = matmul_rates()
        print(f'bf16 8192^3 matmul: {cold:.0f} TFLOP/s cold, {hot:.0f} after 2 s  | {smi()}', flush=True)
    commit = (
        os.environ.get('CVLLM_LAB_COMMIT')
        or subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()
    )
    spec = TINY if a.model == 'tiny' else yaml.safe_load(open(f'conf/model/{a.model}.yaml'))
    llm = LLM(
        str(model_dir(spec)),
        load_format='dummy',
        skip_tokenizer_init=True,
        progress=False,
        max_model_len=8192,
        usage_context='server',
        **(dict(gpu_memory_utilization=0.85) if cuda else dict(kv_cache_memory=512 << 20)),
    )
    eng, g = llm.engine, torch.Generator().manual_seed(0)
    print(f'budget {eng.cfg.max_num_batched_tokens}, async scheduling {eng.cfg.async_scheduling}', flush=True)
    for budget in a.budgets:  # warm-up: kernels and cuDNN plans of every step shape
        eng.scheduler.max_num_batched_tokens = budget
        run_engine(eng, prompts(g, eng.vocab_size))
        run_ahead(eng, prompts(g, eng.vocab_size))
    runs = [
        (r, b, k, m, d, f)
        for r in range(a.rounds)
        for b in a.budgets
        for f in (('engine', run_engine), ('ahead', run_ahead))
        for k in a.keep_rows
        for m in (a.mixed_ahead if f[0] == 'engine' else ['-'])
        for d in (a.decodes_apart if f[0] == 'engine' else ['-'])
    ]
    for r, budget, keep, mixed, apart, (name, fn) in runs:
        eng.scheduler.max_num_batched_tokens = budget
        eng.runner.keep_rows, eng.scheduler.mixed_ahead = keep == 'on', mixed != 'off'
        eng.runner.decodes_apart = apart != 'off'
        time.sleep(a.idle)
        before = smi()
        res = fn(eng, prompts(g, eng.vocab_size))
        steps = res.pop('steps')
        extra = (
            f'steps {len(steps)}: ' + ' '.join(f'{1e3 * s:.0f}' for s in steps[:12]) + ' ms'
            if isinstance(steps, list)
            else f'steps {steps}'
        )
        last = 1e3 * res.pop('last')
        if a.csv:
            append_row(
                Path(a.csv),
                dict(
                    commit=commit,
                    gpu=torch.cuda.get_device_name() if cuda else 'cpu',
                    model=a.model,
                    budget=budget,
                    kind=name,
                    round=r,
                    keep_rows=keep,
                    mixed_ahead=mixed,
                    decodes_apart=apart,
                    last_first_token_ms=round(last, 1),
                ),
            )
        print(
            f'round {r} budget {budget} keep_rows {keep:3s} mixed_ahead {mixed:3s} decodes_apart {apart:3s} {name:6s}: last first token {last:7.1f} ms  {res}  {extra}  '
            f'| before {before} | after {smi()}',
            flush=True,
        )
    eng.scheduler.max_num_batched_tokens, eng.runner.keep_rows = a.budgets[0], a.keep_rows[0] == 'on'
    for apart in a.decodes_apart:
        eng.runner.decodes_apart = apart == 'on'
        time.sleep(a.idle)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            res = run_engine(eng, prompts(g, eng.vocab_size))  # as the measured waves (8 tokens: mixed steps ahead)
            sync()
        print(
            f'profiled engine wave, decodes_apart {apart}: last first token {1e3 * res["last"]:.1f} ms, '
            f'{len(res["steps"])} steps'
        )
        if not cuda:
            continue
        gp = gaps(prof, len(res['steps']))
        largest = gp.pop('largest')
        print('GPU timeline:', {k: round(v, 2) if isinstance(v, float) else v for k, v in gp.items()})
        for row in largest:
            print('  idle %6.2f ms before %-50s host: %s' % row)
        print(step_table(profiled_kernels(prof)), flush=True)
        if a.trace:
            prof.export_chrome_trace('/tmp/trace.json')
            out = a.trace if len(a.decodes_apart) == 1 else a.trace.replace('.json', f'_apart_{apart}.json')
            with open('/tmp/trace.json', 'rb') as f, gzip.open(out, 'wb') as o:
                o.write(f.read())


if __name__ == '__main__':
    main()
