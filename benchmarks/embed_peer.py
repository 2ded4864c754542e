"""Embedding throughput of a pooling model, ours or vLLM's, on the same shape, prompts and batching limits (issue 46).

    python -m benchmarks.embed_peer --engine ours --model bert_base --out results/h100_embed.csv
    PYTHONPATH=/tmp/site:/tmp/wh python3 benchmarks/embed_peer.py --engine vllm --model bert_base --out ...

The model is `conf/model/<name>.yaml`'s config with dummy weights and a word-level tokenizer (`serve_load`'s), in
bf16; a decoder (`*ForCausalLM`) runs converted to embeddings (last-token pooling, normalized: Qwen3-Embedding's
own) with a 4,096-token context (our pooling runner does not chunk a prompt yet), an encoder with its default pooler. Prompts are exact-length random token ids (fixed seed, the same for
both engines). Both run with `max_num_batched_tokens` and `max_num_seqs` set alike. Each point: one warm-up pass
over the first 64 prompts, then `--reps` timed passes over all of them; the median gives sentences/s and tokens/s.
One CSV row per point (appended)."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
POINTS = {  # (prompts, tokens each)
    'bert_base': [(4096, 128), (2048, 510)],
    'qwen3_embedding_0_6b': [(2048, 128), (1024, 512), (256, 2048)],
}


def model_dir(name: str, d: Path) -> dict:
    "The config and a word-level tokenizer over its vocabulary (no weights: both engines load dummy ones)."
    sys.path.insert(0, str(ROOT))
    from benchmarks.serve_load import write_dummy_model

    spec = write_dummy_model(name, d)
    return spec['hf_config']


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def make_llm(engine: str, d: Path, decoder: bool, budget: int, seqs: int):
    kw = dict(dtype='bfloat16', load_format='dummy', max_num_batched_tokens=budget, max_num_seqs=seqs)
    kw |= dict(runner='pooling') | (dict(convert='embed', max_model_len=4096) if decoder else {})
    if engine == 'vllm':
        from vllm import LLM

        return LLM(model=str(d), enforce_eager=False, gpu_memory_utilization=0.85, **kw)
    from cvllm_lab import LLM

    return LLM(str(d), progress=False, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--engine', choices=['ours', 'vllm'], required=True)
    ap.add_argument('--model', choices=sorted(POINTS), required=True)
    ap.add_argument('--out', required=True)
    ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--budget', type=int, default=16384, help='max_num_batched_tokens, both engines')
    ap.add_argument('--max-num-seqs', type=int, default=256)
    a = ap.parse_args()
    os.environ.setdefault('VLLM_USE_FLASHINFER_SAMPLER', '0')
    d = Path(f'/tmp/embed_peer/{a.model}')
    cfg = model_dir(a.model, d)
    decoder = cfg['architectures'][0].endswith('ForCausalLM')
    import torch

    llm = make_llm(a.engine, d, decoder, a.budget, a.max_num_seqs)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
    try:
        commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT)
        commit = commit.stdout.strip() or 'unknown'
    except OSError:
        commit = 'unknown'
    rows = []
    for n, length in POINTS[a.model]:
        ps = [{'prompt_token_ids': p} for p in prompts(n, length, cfg['vocab_size'])]
        out = llm.embed(ps[:64], use_tqdm=False)
        dim = len(out[0].outputs.embedding)
        times = []
        for _ in range(a.reps):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0 = time.perf_counter()
            llm.embed(ps, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        row = dict(
            engine=a.engine,
            model=a.model,
            gpu=gpu,
            commit=commit,
            prompts=n,
            prompt_len=length,
            dim=dim,
            budget=a.budget,
            max_num_seqs=a.max_num_seqs,
            seconds=round(t, 4),
            sentences_per_s=round(n / t, 1),
            tokens_per_s=round(n * length / t, 0),
        )
        print(row, flush=True)
        rows.append(row)
    new = not Path(a.out).exists()
    with open(a.out, 'a', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == '__main__':
    main()
