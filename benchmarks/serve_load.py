"""The OpenAI server under load, measured as vLLM's `vllm bench serve --dataset-name random --ignore-eos` does.

Starts `cvllm_lab.entrypoints.serve` on a model shape from `conf/model/` with dummy weights, runs
`cvllm_lab.bench.loadgen` with exact-length random token-id prompts against `/v1/completions` at each concurrency,
writes one row per concurrency in the columns of `results/reference/vllm_serve_h200.csv`, and plots ours beside
vLLM's reference rows of the same GPU kind.

    python -m benchmarks.serve_load --model llama3_8b --concurrency 1 64 --out results/h200_serve.csv

A dummy-weight model has no tokenizer: a word-level tokenizer over the model's vocabulary (`t0 ... tN`) is written
beside the config, so detokenization and SSE framing cost what they cost for any one-token-one-word vocabulary.
"""

from __future__ import annotations
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
import httpx
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_dummy_model(model: str, dst: Path) -> dict:
    "config.json of `conf/model/<model>.yaml` plus a word-level tokenizer over its vocabulary, in `dst`."
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    spec = yaml.safe_load((ROOT / 'conf/model' / f'{model}.yaml').read_text())
    cfg = dict(spec['hf_config'])
    dst.mkdir(parents=True, exist_ok=True)
    (dst / 'config.json').write_text(json.dumps(cfg))
    vocab = {f't{i}': i for i in range(cfg['vocab_size'])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token='t0'))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.WhitespaceSplit(), decoders.Metaspace()  # decode joins words
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token='t0', eos_token='t1', bos_token='t2').save_pretrained(dst)
    return spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    "The server as a subprocess; returns once /health answers 200 (or raises with the log's tail)."
    cmd = [
        sys.executable,
        '-m',
        'cvllm_lab.entrypoints.serve',
        '--model',
        str(model_dir),
        '--load-format',
        'dummy',
        '--port',
        str(port),
        '--disable-uvicorn-access-log',
        *extra,
    ]
    print(' '.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open('w'), stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f'server exited {proc.returncode}:\n{log.read_text()[-3000:]}')
        try:
            if httpx.get(f'http://127.0.0.1:{port}/health', timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.kill()
    raise TimeoutError(f'server not healthy after 900 s:\n{log.read_text()[-3000:]}')


def measure(
    base: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int
) -> dict:
    from cvllm_lab.bench.loadgen import run_load_async

    return asyncio.run(
        run_load_async(
            base,
            None,
            'completions',
            concurrency,
            num_prompts,
            progress=False,
            prompt_tokens=input_len,
            max_tokens=output_len,
            ignore_eos=True,
            dataset='random',
            vocab_size=vocab,
            seed=seed,
            keep_requests=True,
        )
    )


def server_latency(base: str) -> dict:
    "The server's own latency histograms (`/metrics`): sum and count of TTFT and e2e seconds, measured in the API process."
    import httpx

    text = httpx.get(base.removesuffix('/v1') + '/metrics', timeout=30).text
    out = {}
    for line in text.splitlines():
        for m in ('time_to_first_token_seconds', 'e2e_request_latency_seconds'):
            for part in ('sum', 'count'):
                if line.startswith(f'cvllm:{m}_{part}{{'):
                    out[f'{m}_{part}'] = float(line.rsplit(' ', 1)[1])
    return out


def row(rep: dict, gpu: str, shape: str, commit: str, input_len: int, output_len: int) -> dict:
    "One row in the reference file's columns."
    return dict(
        engine='cvllm_lab',
        version=commit,
        gpu=gpu,
        shape=shape,
        precision='bf16',
        concurrency=rep['concurrency'],
        num_prompts=rep['num_requests'],
        input_len=input_len,
        output_len=output_len,
        req_s=rep['request_throughput'],
        out_tok_s=rep['output_throughput'],
        ttft_p50_ms=rep['ttft_ms_p50'],
        ttft_p99_ms=rep['ttft_ms_p99'],
        tpot_p50_ms=rep['tpot_ms_p50'],
        itl_p50_ms=rep['itl_ms_p50'],
        itl_p99_ms=rep['itl_ms_p99'],
        e2el_p50_ms=rep['e2e_ms_p50'],
        notes=f'failed {rep["failed"]}; {rep["first_error"] or ""}'.strip('; '),
    )


def plot(df: pd.DataFrame, ref: pd.DataFrame, png: Path, title: str, last: int = 6):
    """Ours beside vLLM per concurrency: TTFT p50/p99, TPOT p50, ITL p50/p99 (ms, log scale) and output tok/s; our
    last `last` runs at each concurrency, each bar named by its commit, one colour per name in every panel."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    df = df.groupby('concurrency', group_keys=False).tail(last)
    again = df.groupby(['concurrency', 'version']).cumcount()  # a commit measured again: its own bars
    ours = df.assign(who=[f'cvllm_lab {v}' + (f' #{i + 1}' if i else '') for v, i in zip(df.version, again)])
    both = pd.concat([ref.assign(who='vLLM ' + ref.version.astype(str)), ours])
    names = list(dict.fromkeys(both.who))
    colour = {w: plt.cm.tab20(i % 20) for i, w in enumerate(names)}
    conc = sorted(both.concurrency.unique())
    fig, axes = plt.subplots(1, len(conc) + 1, figsize=(5 * (len(conc) + 1), 4.8))
    lat = ['ttft_p50_ms', 'ttft_p99_ms', 'tpot_p50_ms', 'itl_p50_ms', 'itl_p99_ms']
    for ax, c in zip(axes, conc):
        sub = both[both.concurrency == c].set_index('who')[lat].T
        sub.plot.bar(ax=ax, logy=True, rot=30, legend=False, color=[colour[w] for w in sub.columns])
        ax.set_title(f'concurrency {c}: latency (ms)')
    tok = both.pivot_table(index='concurrency', columns='who', values='out_tok_s').reindex(columns=names)
    tok.plot.bar(ax=axes[-1], rot=0, legend=False, color=[colour[w] for w in tok.columns])
    axes[-1].set_title('output tok/s')
    fig.legend(
        [plt.Rectangle((0, 0), 1, 1, color=colour[w]) for w in names],
        names,
        loc='lower center',
        ncol=min(len(names), 6),
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(png, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', default='llama3_8b', help='a conf/model/ shape')
    ap.add_argument('--concurrency', type=int, nargs='+', default=[1, 64])
    ap.add_argument('--num-prompts', type=int, nargs='+', default=[16, 256], help='one per concurrency')
    ap.add_argument('--input-len', type=int, default=1024)
    ap.add_argument('--output-len', type=int, default=256)
    ap.add_argument(
        '--warmup-prompts',
        type=int,
        default=None,
        help='warm-up requests before each level (16 tokens out; default: as many as the concurrency; '
        "1 is vLLM's client, `vllm bench serve`, which sends one test prompt first)",
    )
    ap.add_argument('--out', default='results/serve.csv')
    ap.add_argument('--workdir', default='/tmp/cvllm_serve_load')
    ap.add_argument('--reference', default=str(ROOT / 'results/reference/vllm_serve_h200.csv'))
    ap.add_argument('--plot-only', action='store_true', help='redraw the plot of --out from its CSV')
    ap.add_argument(
        '--profile',
        metavar='DIR',
        help="trace each measured run in the engine core (the server's "
        'CVLLM_TORCH_PROFILER_DIR, /start_profile and /stop_profile, as `vllm bench serve --profile`)',
    )
    ap.add_argument('server_args', nargs='*', help='extra server flags after --, e.g. -- --max-model-len 8192')
    a = ap.parse_args(argv)
    if a.plot_only:
        return replot(Path(a.out), a.reference, a.model)
    work = Path(a.workdir)
    spec = write_dummy_model(a.model, work / a.model)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
    commit = (
        os.environ.get('CVLLM_LAB_COMMIT')
        or subprocess.run(
            ['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    port = free_port()
    base = f'http://127.0.0.1:{port}/v1'
    if a.profile:
        os.environ['CVLLM_TORCH_PROFILER_DIR'] = str(Path(a.profile).resolve())
    proc = start_server(work / a.model, port, a.server_args, work / 'server.log')
    rows = []
    try:
        for i, (c, n) in enumerate(zip(a.concurrency, a.num_prompts)):
            again = sum(c2 == c for c2 in a.concurrency[:i])  # a level measured again: fresh prompts (no cache hits)
            # warm-up at this concurrency: Triton compiles a kernel once per specialization (argument values of 1,
            # multiples of 16) on first use, and a cold cache puts seconds of compiling into the measured TTFTs
            # (other prompts than the measured ones: the same would be prefix-cache hits in the measured run; not -c,
            # which `random.Random` seeds as c)
            w = c if a.warmup_prompts is None else a.warmup_prompts
            if w:
                measure(
                    base,
                    min(c, w),
                    w,
                    a.input_len,
                    16,
                    spec['hf_config']['vocab_size'],
                    seed=10_000 + c + 1_000 * again,
                )
            before = server_latency(base)
            if a.profile:
                httpx.post(f'http://127.0.0.1:{port}/start_profile', timeout=60).raise_for_status()
            rep = measure(
                base, c, n, a.input_len, a.output_len, spec['hf_config']['vocab_size'], seed=c + 1_000 * again
            )
            if a.profile:
                trace = httpx.post(f'http://127.0.0.1:{port}/stop_profile', timeout=900).json()['trace']
                print(f'concurrency {c}: engine-core trace {trace}', flush=True)
            after = server_latency(base)
            d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
            rows.append(row(rep, gpu, spec['name'], commit, a.input_len, a.output_len))
            rows[-1]['notes'] = '; '.join(
                x for x in (rows[-1]['notes'], f'warm-up {w} requests', 'profiled' if a.profile else '') if x
            )
            # per request: send time, TTFT, e2e (s), to see which requests make the percentiles
            pd.DataFrame(rep['requests']).to_csv(
                work / f'requests_c{c}{"_" + str(again) if again else ""}.csv', index=False
            )
            # client and server means side by side: their gap is what the HTTP/SSE path and the client add
            rows[-1] |= dict(
                ttft_mean_ms=rep['ttft_ms_mean'],
                e2el_mean_ms=rep['e2e_ms_mean'],
                server_ttft_mean_ms=1e3
                * d('time_to_first_token_seconds_sum')
                / max(1, d('time_to_first_token_seconds_count')),
                server_e2el_mean_ms=1e3
                * d('e2e_request_latency_seconds_sum')
                / max(1, d('e2e_request_latency_seconds_count')),
            )
            print(json.dumps(rows[-1], default=float), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    df = pd.DataFrame(rows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    replot(out, a.reference, a.model)


def replot(out: Path, reference: str, model: str):
    "Plot the rows of `out` beside the reference rows of the same shape and GPU kind."
    df = pd.read_csv(out, dtype={'version': str})  # a short commit id of digits and one 'e' would parse as a float
    spec = yaml.safe_load((ROOT / 'conf/model' / f'{model}.yaml').read_text())
    gpu, n_in, n_out = df.gpu[0], df.input_len[0], df.output_len[0]
    commit = ', '.join(dict.fromkeys(df.groupby('concurrency', group_keys=False).tail(6).version))  # the plotted runs
    ref = pd.read_csv(reference) if Path(reference).exists() else pd.DataFrame(columns=df.columns)
    ref = ref[(ref['shape'] == spec['name']) & ref['gpu'].apply(lambda g: str(g) in gpu)]
    plot(
        df,
        ref,
        out.with_suffix('.png'),
        f'{spec["name"]} bf16 (dummy), {n_in} in / {n_out} out, random ids, ignore_eos; {gpu}; cvllm_lab {commit}',
    )
    print(pd.concat([ref, df]).drop(columns=['notes']).to_string(index=False))


if __name__ == '__main__':
    main()
