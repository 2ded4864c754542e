"""The server on CPU against llama-cpp-python's server: same GGUF (the embedded SmolLM2 Q4_1), same threads, our load
generator (`cvllm_lab.bench.loadgen`: TTFT, TPOT and output tok/s as vLLM's benchmark_serving defines them) at
concurrency 1 and 16. Both servers stay up and the runs alternate (ours, llama.cpp, ours, ...) `--repeats` times, so
a busy machine slows both alike; each run records the load average beside it. Writes one row per run to `--csv`
and a plot of the medians to the same name with `.png`. `scripts/bench_cpu_serve.sh` is the entry point."""

import argparse
import os
import signal
import subprocess
import sys
import time
import httpx
import pandas as pd
from cvllm_lab.bench.loadgen import run_load
from cvllm_lab.config import default_model_path


def cpu_model() -> str:
    for line in open('/proc/cpuinfo'):
        if line.startswith('model name'):
            return line.split(':', 1)[1].strip()
    return 'unknown CPU'


def wait_up(url: str, proc, secs: int = 600):
    for _ in range(secs):
        if proc.poll() is not None:
            raise RuntimeError(f'server for {url} exited ({proc.returncode})')
        try:
            if httpx.get(f'{url}/models', timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        '--llama-py', default=os.environ.get('LLAMA_PY', sys.executable), help='python with llama_cpp.server'
    )
    ap.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument('--concurrency', type=int, nargs='+', default=[1, 16])
    ap.add_argument('--requests', type=int, nargs='+', default=[4, 16], help='requests per run, one per concurrency')
    ap.add_argument('--input-len', type=int, default=128)
    ap.add_argument('--output-len', type=int, default=128)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--csv', default='results/cpu_serve_vs_llamacpp.csv')
    ap.add_argument('--plot-only', action='store_true', help='redraw the plot from --csv')
    a = ap.parse_args()
    if a.plot_only:
        return plot(pd.read_csv(a.csv), a.csv.removesuffix('.csv') + '.png')
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers too
    gguf, env = str(default_model_path()), dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    servers = {
        'cvllm_lab': (
            [
                sys.executable,
                '-m',
                'cvllm_lab.entrypoints.serve',
                '--port',
                '8010',
                '--threads',
                str(a.threads),
                '--max-model-len',
                '4096',
            ],
            'http://127.0.0.1:8010/v1',
            {},
        ),
        # llama.cpp's server has no ignore_eos: its end-of-text tokens are banned instead, so both write output_len tokens
        'llama.cpp': (
            [
                a.llama_py,
                '-m',
                'llama_cpp.server',
                '--model',
                gguf,
                '--n_threads',
                str(a.threads),
                '--n_threads_batch',
                str(a.threads),
                '--n_ctx',
                '4096',
                '--port',
                '8011',
                '--interrupt_requests',
                'False',
            ],  # queue concurrent requests (its default cuts the running one)
            'http://127.0.0.1:8011/v1',
            {'logit_bias': {'0': -100, '1': -100, '2': -100}},
        ),
    }
    procs = {}
    try:
        for name, (cmd, url, _) in servers.items():
            procs[name] = subprocess.Popen(
                cmd, env=env, stdout=open(f'/tmp/{name}_serve.log', 'w'), stderr=subprocess.STDOUT
            )
            wait_up(url, procs[name])
        rows = []
        for name, (_, url, extra) in servers.items():  # warm-up: first requests pay one-time costs
            run_load(
                url,
                endpoint='completions',
                concurrency=2,
                num_requests=2,
                max_tokens=8,
                progress=False,
                extra_body=extra,
            )
        for rep in range(a.repeats):
            for c, n in zip(a.concurrency, a.requests):
                for name, (_, url, extra) in servers.items():
                    load = os.getloadavg()[0]
                    r = run_load(
                        url,
                        endpoint='completions',
                        concurrency=c,
                        num_requests=n,
                        prompt_tokens=a.input_len,
                        max_tokens=a.output_len,
                        temperature=0.0,
                        progress=False,
                        seed=rep,
                        extra_body=extra,
                    )
                    rows.append(
                        dict(
                            server=name,
                            concurrency=c,
                            repeat=rep,
                            output_tok_s=r['output_throughput'],
                            ttft_ms_p50=r['ttft_ms_p50'],
                            tpot_ms_p50=r['tpot_ms_p50'],
                            e2e_ms_p50=r['e2e_ms_p50'],
                            completed=r['completed'],
                            failed=r['failed'],
                            output_tokens=r['total_output_tokens'],
                            load_avg_1m=load,
                            threads=a.threads,
                            cpu=cpu_model(),
                            model=os.path.basename(gguf),
                        )
                    )
                    if r['failed'] or r['total_output_tokens'] != n * a.output_len:
                        raise RuntimeError(
                            f'{name} at concurrency {c}: {r["failed"]} failed, {r["total_output_tokens"]} of {n * a.output_len} tokens'
                        )
                    print(rows[-1], flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
    df = pd.DataFrame(rows)
    df.to_csv(a.csv, index=False)
    plot(df, a.csv.removesuffix('.csv') + '.png')


def plot(df: pd.DataFrame, path: str):
    "Median output tok/s and TTFT of each server per concurrency, with the CPU and load average in the title."
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    med = df.groupby(['concurrency', 'server'])[['output_tok_s', 'ttft_ms_p50']].median().unstack('server')
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, col, label in zip(
        axes, ['output_tok_s', 'ttft_ms_p50'], ['output tok/s (median of runs)', 'TTFT p50, ms (median of runs)']
    ):
        med[col].plot.bar(ax=ax, rot=0, logy=col.startswith('ttft'))
        ax.set_ylabel(label)
        ax.set_xlabel('concurrency')
    r = df.iloc[0]
    fig.suptitle(
        f'{r.model} server on CPU: {r.cpu}, {r.threads} threads; load avg {df.load_avg_1m.min():.1f}-{df.load_avg_1m.max():.1f}',
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == '__main__':
    main()
