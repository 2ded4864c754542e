"""vLLM 0.26 on a random-weight MoE checkpoint folder (`benchmarks/random_checkpoint.py`), with the distinct experts
its routers pick per decode step (issue 50: both engines on the same weights).

On a GPU machine after `../shared/vllm_peer`'s wheelhouse is installed in /tmp/site (its README):

    PYTHONPATH=/tmp/site:/tmp/wh python3 benchmarks/vllm_moe_peer.py DIR SHAPE OUT.csv [--sweep moe|mla]

SHAPE names `conf/model/<SHAPE>.yaml` (the rows' label; the weights and shape come from DIR); the points are those of
`conf/sweep/<sweep>.yaml` (default: `moe` for qwen3_30b_a3b, `mla` for deepseek_v2_lite). Two passes:

1. counting, in a child process (`--count JSON`): `LLM(enforce_eager=True)` so the routers run in Python every step;
   `llm.apply_model` installs a capture function on every MoE layer's router (vLLM 0.26: `FusedMoE(...)` is a factory
   that returns an `MoERunner` module whose `.router`, a `BaseRouter`, calls `capture_fn(topk_ids)` with the logical
   top-k ids of each forward before EPLB mapping; where a router has no `set_capture_fn` its `select_experts` is
   wrapped instead). A forward of exactly B tokens is a decode step of the batch: its distinct ids are counted per
   layer. The counts stay in the worker (the engine core's process) and come back through `apply_model` too, which
   needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to ship a function (set here).
2. timing, here, with CUDA graphs and no hooks, as `vllm_hybrid_peer.py` times vLLM: a generate of 1 token (prefill)
   and of 129 (prefill + 128 decode steps) on the same fresh random prompts, decode tok/s = batch x 128 / the
   difference. One CSV row per point, with the counting pass's distinct experts per layer per decode step (mean over
   layers and steps, min, max) beside the uniform-routing expectation E (1 - (1 - k/E)^B).

The prompts are `prompts(B, P, V, seed)` below, token ids uniform in [10, V), as our `bench_offline` draws them; our
counter (`benchmarks/moe_same_ckpt.py`) uses the same function, so both engines route the same prompts.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = {'qwen3_30b_a3b': 'moe', 'deepseek_v2_lite': 'mla'}


def sweep_points(shape: str, sweep: str | None = None) -> list[dict]:
    """The points of `conf/sweep/<sweep>.yaml` that name `shape` (all of them when none names a model); `sweep` may
    instead list points as `B:P:O,...` (batch, prompt length, output length: a quick check)."""
    import yaml

    if sweep and ':' in sweep:
        return [dict(zip(('batch_size', 'prompt_len', 'output_len'), map(int, p.split(':')))) for p in sweep.split(',')]
    pts = yaml.safe_load((ROOT / f'conf/sweep/{sweep or SWEEP[shape]}.yaml').read_text())['points']
    return [p for p in pts if p.get('model', shape) == shape]


def prompts(B: int, P: int, V: int, seed: int = 0) -> list[list[int]]:
    "B prompts of P token ids uniform in [10, V): the same on both engines for the same arguments."
    rng = random.Random(f'{seed}-{B}-{P}')
    return [[rng.randrange(10, V) for _ in range(P)] for _ in range(B)]


def uniform_expected(E: int, k: int, B: int) -> float:
    "Distinct experts that B tokens picking k of E uniformly at random route to, on average."
    return E * (1 - (1 - k / E) ** B)


def decode_counts(calls: list[tuple[int, int]], B: int) -> list[int]:
    """Of the router calls `(tokens, distinct ids)` of a generate of B prompts, in order, the decode steps' distinct
    counts: the calls of B tokens, less one that directly follows a call of another size (a prefill step's last
    layer where an engine computes only each prompt's last position there, as ours does)."""
    return [c for i, (T, c) in enumerate(calls) if T == B and (i == 0 or calls[i - 1][0] == B)]


def summarize(counts: list[int], E: int, k: int, B: int) -> dict:
    "The counting columns of a point: distinct experts per layer per decode step (mean, min, max, how many)."
    if not counts:
        return dict(distinct_experts=float('nan'), uniform_expected=round(uniform_expected(E, k, B), 2), n_counted=0)
    return dict(
        distinct_experts=round(sum(counts) / len(counts), 2),
        distinct_min=min(counts),
        distinct_max=max(counts),
        uniform_expected=round(uniform_expected(E, k, B), 2),
        num_experts=E,
        top_k=k,
        n_counted=len(counts),
    )


def moe_shape(cfg: dict) -> tuple[int, int]:
    "(routed experts, top-k) of an HF config dict."
    E = cfg.get('num_experts') or cfg.get('n_routed_experts') or cfg.get('num_local_experts')
    return int(E), int(cfg['num_experts_per_tok'])


# --- run inside vLLM's worker through `llm.apply_model` (shipped there with cloudpickle) ---------------------------
def install_counters(model) -> int:
    """Count the distinct top-k ids of every forward of every MoE layer's router into `model._moe_counts`
    (`[(layer, tokens, distinct)]`); returns how many routers got a counter."""
    import torch

    counts = model._moe_counts = []
    n = 0
    for name, m in model.named_modules():
        router = getattr(m, 'router', None)
        if router is None or not hasattr(router, 'select_experts'):
            continue

        def capture(ids, layer=n):
            counts.append((layer, int(ids.shape[0]), int(torch.unique(ids).numel())))

        if hasattr(router, 'set_capture_fn'):
            router.set_capture_fn(capture)
        else:
            select = router.select_experts

            def wrapped(*a, _select=select, _capture=capture, **kw):
                w, ids = _select(*a, **kw)
                _capture(ids)
                return w, ids

            router.select_experts = wrapped
        n += 1
    return n


def take_counts(model) -> list:
    "The counts since the last call, and a fresh list for the next."
    out = list(model._moe_counts)
    model._moe_counts.clear()
    return out


# --------------------------------------------------------------------------------------------------------------------
def make_llm(d: str, eager: bool):
    from vllm import LLM

    return LLM(
        model=d,
        dtype='bfloat16',
        max_model_len=8192,
        max_num_seqs=256,
        gpu_memory_utilization=0.85,
        enforce_eager=eager,
        seed=0,
    )


def count_pass(d: str, shape: str, sweep: str | None, out_json: str, steps: int = 8):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads((Path(d) / 'config.json').read_text())
    E, k, V = *moe_shape(cfg), cfg['vocab_size']
    t0 = time.time()
    llm = make_llm(d, eager=True)
    n = llm.apply_model(install_counters)
    print(f'counting pass: LLM up in {time.time() - t0:.0f} s, counters on {n} MoE routers', flush=True)
    res = {}
    for p in sweep_points(shape, sweep):
        B, P = p['batch_size'], p['prompt_len']
        if B in res:
            continue
        sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True, detokenize=False)
        llm.apply_model(take_counts)  # whatever ran before this point
        llm.generate([TokensPrompt(prompt_token_ids=t) for t in prompts(B, P, V)], sp, use_tqdm=False)
        got = llm.apply_model(take_counts)[0]
        res[B] = summarize(decode_counts([(T, c) for _, T, c in got], B), E, k, B)
        if not res[B]['n_counted']:  # no forward of B tokens: padded? say what sizes the routers saw
            seen = sorted({T for _, T, _ in got})  # none at all: a monolithic kernel routes inside (is_monolithic)
            print(f'vllm B={B}: no decode step counted; token counts the routers saw: {seen or "no router call"}')
        print(f'vllm B={B}: {res[B]}', flush=True)
    Path(out_json).write_text(json.dumps(res))


def main(d: str, shape: str, out: str, sweep: str | None = None):
    os.environ.setdefault('VLLM_USE_FLASHINFER_SAMPLER', '0')  # no FlashInfer on the GPU machines
    cj = str(Path(out).with_suffix('.counts.json'))
    t = time.time()
    cmd = [sys.executable, __file__, d, shape, out, '--count', cj] + (['--sweep', sweep] if sweep else [])
    rc = subprocess.call(cmd)
    counts = json.loads(Path(cj).read_text()) if rc == 0 and Path(cj).exists() else {}
    print(f'counting pass: rc {rc} in {time.time() - t:.0f} s', flush=True)

    from vllm import SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    cfg = json.loads((Path(d) / 'config.json').read_text())
    t0 = time.time()
    llm = make_llm(d, eager=False)
    init_s = time.time() - t0
    print(f'timing pass: LLM up in {init_s:.0f} s', flush=True)
    seed = iter(range(1, 1000))

    def timed(bs: int, n: int, out_len: int) -> float:
        ps = [TokensPrompt(prompt_token_ids=t) for t in prompts(bs, n, cfg['vocab_size'], next(seed))]
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(4, 64, 16)  # warm-up
    rows = []
    for p in sweep_points(shape, sweep):
        bs, n = p['batch_size'], p['prompt_len']
        row = dict(engine=f'vllm {__version__}', model=shape, ckpt=d, layers=cfg['num_hidden_layers'])
        row |= dict(batch_size=bs, prompt_len=n, init_s=round(init_s, 1))
        try:
            t1 = timed(bs, n, 1)  # fresh prompts each time: no prefix-cache hit
            t2 = timed(bs, n, 129)
            row |= dict(
                prefill_tok_s=round(bs * n / t1, 1),
                decode_tok_s=round(bs * 128 / max(t2 - t1, 1e-9), 1),
                decode_ms_step=round((t2 - t1) / 128 * 1e3, 3),
            )
        except Exception as e:  # a point that does not fit is a row that says so
            row['error'] = repr(e)[:300]
        row |= counts.get(str(bs), {})
        print(row, flush=True)
        rows.append(row)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f'{len(rows)} rows -> {out}', flush=True)


if __name__ == '__main__':
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument('dir')
    ap.add_argument('shape')
    ap.add_argument('out')
    ap.add_argument('--sweep', default=None, help='conf/sweep/<name>.yaml, or points B:P:O,...')
    ap.add_argument('--count', default=None, help='(internal) the counting pass, its results to this JSON')
    a = ap.parse_args()
    os.environ.setdefault('VLLM_USE_FLASHINFER_SAMPLER', '0')
    os.environ.setdefault('VLLM_ALLOW_INSECURE_SERIALIZATION', '1')  # apply_model ships functions to the worker
    if a.count:
        count_pass(a.dir, a.shape, a.sweep, a.count)
    else:
        main(a.dir, a.shape, a.out, a.sweep)
