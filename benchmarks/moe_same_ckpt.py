"""Our engine on a random-weight MoE checkpoint folder (`benchmarks/random_checkpoint.py`), with the distinct experts
its routers pick per decode step: our half of issue 50's same-checkpoint comparison (`vllm_moe_peer.py` is vLLM's).

    python -m benchmarks.moe_same_ckpt DIR SHAPE OUT.csv [--sweep moe|mla] [--runs 3] [--steps 8]

The points are `conf/sweep/<sweep>.yaml`'s (default `moe` for qwen3_30b_a3b, `mla` for deepseek_v2_lite), the model
`conf/model/<SHAPE>.yaml` with `path: DIR` (real weights, `load_format='auto'`, the folder's tokenizer). Two passes:

1. counting, in a child process (`--count JSON`): `LLM(DIR, enforce_eager=True)` with `select_experts` wrapped where
   the MoE layers call it (`cvllm_lab.layers.fused_moe`, and DeepSeek's router in `cvllm_lab.models.deepseek_v2`, as
   `moe_routing_probe.py` does for dummy weights); the calls of exactly B tokens are the decode steps of the batch
   (`decode_counts`: less a prefill's last layer, which runs only the prompts' last tokens), whose distinct expert
   ids are counted per layer. `steps` decode steps per point on `vllm_moe_peer.prompts`, the prompts
   the peer's counter routes too.
2. timing, here: the sweep harness's own `run_sweep` (CUDA graphs, `bench_offline`: prefill, decode and steady decode
   tok/s, the active-expert roofline), one CSV row per point with the counting columns beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.vllm_moe_peer import SWEEP, decode_counts, moe_shape, prompts, summarize, sweep_points

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def counting_experts():
    """While inside, every `select_experts` call of the MoE layers appends `(tokens, distinct expert ids)` to the
    yielded list."""
    import torch

    import cvllm_lab.layers.fused_moe as fm
    import cvllm_lab.models.deepseek_v2 as dsv2

    counts, select = [], fm.select_experts
    saved = fm.select_experts, dsv2.select_experts

    def counting(logits, top_k, renorm, *a, **k):
        w, ids = select(logits, top_k, renorm, *a, **k)
        counts.append((int(ids.shape[0]), int(torch.unique(ids).numel())))
        return w, ids

    fm.select_experts = dsv2.select_experts = counting  # the names the MoE layer and DeepSeek's router call
    try:
        yield counts
    finally:
        fm.select_experts, dsv2.select_experts = saved


def count_distinct_experts(llm, cfg: dict, B: int, P: int, steps: int = 8, seed: int = 0) -> dict:
    """Distinct experts per MoE layer per decode step of `B` prompts of `P` tokens (`steps` steps; the engine eager,
    so that the routers run in Python each step) of the model of HF config `cfg`: `summarize`'s columns."""
    from cvllm_lab.sampling_params import SamplingParams

    E, k = moe_shape(cfg)
    sp = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, detokenize=False)
    with counting_experts() as counts:
        llm.generate([{'prompt_token_ids': t} for t in prompts(B, P, cfg['vocab_size'], seed)], sp, use_tqdm=False)
    return summarize(decode_counts(counts, B), E, k, B)


def count_pass(d: str, shape: str, sweep: str | None, out_json: str, steps: int):
    from cvllm_lab import LLM

    t0 = time.time()
    llm = LLM(d, enforce_eager=True, max_model_len=4096, max_num_seqs=256, gpu_memory_utilization=0.85, progress=False)
    print(f'counting pass: LLM up in {time.time() - t0:.0f} s', flush=True)
    cfg, res = json.loads((Path(d) / 'config.json').read_text()), {}
    for p in sweep_points(shape, sweep):
        B = p['batch_size']
        if B not in res:
            res[B] = count_distinct_experts(llm, cfg, B, p['prompt_len'], steps)
            print(f'ours B={B}: {res[B]}', flush=True)
    Path(out_json).write_text(json.dumps(res))


def time_pass(d: str, shape: str, sweep: str | None, runs: int):
    "`run_sweep` on the folder at the sweep's points (the model's yaml with `path: DIR`); its rows as a DataFrame."
    from cvllm_lab.bench.__main__ import CONF_DIR
    from cvllm_lab.bench.sweep import run_sweep

    conf = yaml.safe_load((CONF_DIR / 'config.yaml').read_text())
    load = lambda g, n: yaml.safe_load((CONF_DIR / g / f'{n}.yaml').read_text())  # noqa: E731
    model = load('model', shape) | {'path': d}
    model['hf_config'] = json.loads((Path(d) / 'config.json').read_text())
    pts = [{k: v for k, v in p.items() if k != 'model'} for p in sweep_points(shape, sweep)]
    cfg = {k: v for k, v in conf.items() if k not in ('defaults', 'hydra')} | dict(
        model=model,
        engine=load('engine', 'default'),
        quant=load('quant', 'none'),
        attention=load('attention', 'auto'),
        sweep={'name': f'{SWEEP[shape] if not sweep or ":" in sweep else sweep}_same_ckpt', 'points': pts},
        runs=runs,
    )
    return run_sweep(cfg, CONF_DIR, out=None, progress=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('dir')
    ap.add_argument('shape')
    ap.add_argument('out')
    ap.add_argument('--sweep', default=None, help='conf/sweep/<name>.yaml, or points B:P:O,...')
    ap.add_argument('--runs', type=int, default=3)
    ap.add_argument('--steps', type=int, default=8, help='decode steps counted per point')
    ap.add_argument('--count', default=None, help='(internal) the counting pass, its results to this JSON')
    a = ap.parse_args(argv)
    if a.count:
        return count_pass(a.dir, a.shape, a.sweep, a.count, a.steps)
    cj = str(Path(a.out).with_suffix('.counts.json'))
    t = time.time()
    cmd = [sys.executable, '-m', 'benchmarks.moe_same_ckpt', a.dir, a.shape, a.out, '--count', cj]
    rc = subprocess.call(cmd + ['--steps', str(a.steps)] + (['--sweep', a.sweep] if a.sweep else []))
    counts = json.loads(Path(cj).read_text()) if rc == 0 and Path(cj).exists() else {}
    print(f'counting pass: rc {rc} in {time.time() - t:.0f} s', flush=True)
    t = time.time()
    df = time_pass(a.dir, a.shape, a.sweep, a.runs)
    print(f'timing pass: {time.time() - t:.0f} s', flush=True)
    df.insert(0, 'engine', 'cvllm_lab')
    df.insert(2, 'ckpt', a.dir)
    df.insert(3, 'layers', json.loads((Path(a.dir) / 'config.json').read_text())['num_hidden_layers'])
    for col in ('distinct_experts', 'distinct_min', 'distinct_max', 'uniform_expected', 'num_experts', 'top_k'):
        df[col] = [counts.get(str(b), {}).get(col) for b in df.batch_size]
    df['n_counted'] = [counts.get(str(b), {}).get('n_counted') for b in df.batch_size]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out, index=False)
    cols = [
        c
        for c in ('batch_size', 'prompt_len', 'prefill_tok_s', 'decode_tok_s', 'decode_steady_tok_s', 'ms_per_step')
        + ('roofline_tok_s', 'distinct_experts', 'uniform_expected', 'error')
        if c in df
    ]
    print(df[cols].to_string(index=False))
    print(f'{len(df)} rows -> {a.out}', flush=True)


if __name__ == '__main__':
    main()
