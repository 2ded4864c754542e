"""Sustained bf16 GEMM rate at the Llama-3-8B prefill shapes (M = 8192: qkv, o, gate_up, down), per BLAS backend
(`torch.backends.cuda.preferred_blas_library`: cuBLASLt, cuBLAS) and weight layout (`[N, K]` through `F.linear`, `[K, N]`
through `@`), interleaved over two rounds, with nvidia-smi's power and SM clock after each. `python benchmarks/gemm_power.py`
on a GPU machine."""

import torch
import time
import subprocess
import statistics

dev = 'cuda'
M = 8192
shapes = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}
W = {k: torch.empty(N, K, device=dev, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3) for k, (N, K) in shapes.items()}
WT = {k: w.t().contiguous() for k, w in W.items()}
X = {k: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for k, (N, K) in shapes.items()}
fl = sum(2 * M * N * K for N, K in shapes.values())


def layer(lay):
    for k in shapes:
        if lay == 'NK':
            torch.nn.functional.linear(X[k], W[k])
        else:
            X[k] @ WT[k]


def sustained(lay, secs=6.0):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rates = []
    while time.perf_counter() - t0 < secs:
        t = time.perf_counter()
        for _ in range(32):
            layer(lay)
        torch.cuda.synchronize()
        rates.append(32 * fl / (time.perf_counter() - t) / 1e12)
    return statistics.median(rates[len(rates) // 2 :]), rates[0]


def smi():
    return subprocess.run(
        ['nvidia-smi', '--query-gpu=power.draw,clocks.sm,temperature.gpu', '--format=csv,noheader'],
        capture_output=True,
        text=True,
    ).stdout.strip()


for lib in ('cublaslt', 'cublas'):
    torch.backends.cuda.preferred_blas_library(lib)
    layer('NK')
    layer('KN')
for r in range(2):
    for lib in ('cublaslt', 'cublas'):
        torch.backends.cuda.preferred_blas_library(lib)
        for lay in ('NK', 'KN'):
            time.sleep(3)
            med, first = sustained(lay)
            print(
                f'round {r} {lib:8s} {lay}: sustained {med:6.1f} TF/s (first 32-layer batch {first:6.1f})  smi after: {smi()}',
                flush=True,
            )
