"""Ours against llama.cpp on the embedded SmolLM2 Q4_1 GGUF, interleaved in one process: each round runs our batch-1
decode, our 16-sequence decode and llama.cpp's batch-1 decode back to back (and, with `--ab`, ours with the
`CPUDecoderLayer` decode path switched off, i.e. the layers' own forward), so a busy machine slows every point of a
round alike; medians over `--rounds`, the 1-minute load average beside every run.
`PYTHONPATH=<folder with llama_cpp> python -m benchmarks.cpu_vs_llamacpp [--rounds 3] [--ab] [--csv PATH]`."""

import argparse
import os
import statistics
import time
import numpy as np
import pandas as pd
import torch
from cvllm_lab import LLM
from cvllm_lab.bench.offline import bench_offline, device_name
from cvllm_lab.config import default_model_path
from cvllm_lab.quant.cpu_layer import CPUDecoderLayer


def llamacpp_decode(llm, P: int, O: int, rng) -> float:
    "llama.cpp's batch-1 greedy decode tok/s after a `P`-token prompt (one prefill, `O - 1` single-token evals)."
    llm.reset()
    llm.eval(rng.integers(10, llm.n_vocab(), P).tolist())
    t = time.perf_counter()
    for _ in range(O - 1):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return (O - 1) / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--ab', action='store_true', help='also ours with the lean decode layers off')
    ap.add_argument('--csv', default='results/cpu_vs_llamacpp_interleaved.csv')
    a = ap.parse_args()
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    ours = LLM(progress=False)
    ref = Llama(
        str(default_model_path()), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False
    )
    rng, lean_fwd = np.random.default_rng(0), CPUDecoderLayer.forward

    def own_forward(self, positions, h, residual):
        return self._fallback(self, positions, h, residual)

    variants = [('ours', lean_fwd)] + ([('ours (layers as written)', own_forward)] if a.ab else [])
    llamacpp_decode(ref, 32, 8, rng)
    rows = []
    # both engines' thread pools poll for work a while after a run (OpenMP, ggml): let them park before the next one
    settle = lambda: time.sleep(2)

    def add(engine, B, tok_s, load):
        rows.append(
            dict(
                engine=engine,
                batch_size=B,
                decode_tok_s=tok_s,
                load_avg_1m=load,
                threads=threads,
                cpu=device_name('cpu'),
                round=r,
            )
        )
        print(rows[-1], flush=True)

    for r in range(a.rounds):
        for name, fwd in variants:
            CPUDecoderLayer.forward = fwd
            settle()
            load = os.getloadavg()[0]
            add(name, 1, bench_offline(ours, 1, 32, 128, runs=1, seed=r)['decode_tok_s'], load)
        for name, fwd in variants:
            CPUDecoderLayer.forward = fwd
            settle()
            load = os.getloadavg()[0]
            add(name, 16, bench_offline(ours, 16, 128, 128, runs=1, seed=r)['decode_tok_s'], load)
        settle()
        load = os.getloadavg()[0]
        add('llama.cpp', 1, statistics.median(llamacpp_decode(ref, 32, 128, rng) for _ in range(3)), load)
    CPUDecoderLayer.forward = lean_fwd
    df = pd.DataFrame(rows)
    df.to_csv(a.csv, index=False)
    med = df.groupby(['engine', 'batch_size']).decode_tok_s.median()
    l1 = med[('llama.cpp', 1)]
    for (e, B), v in med.items():
        print(f'{e:28s} B={B:2d} {v:7.1f} tok/s  = {v / l1:.2f}x llama.cpp batch 1')
    print(f'load average during the runs: {df.load_avg_1m.min():.1f}-{df.load_avg_1m.max():.1f}')


if __name__ == '__main__':
    main()
