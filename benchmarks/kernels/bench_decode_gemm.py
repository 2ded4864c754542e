"""bf16 decode GEMMs at the Llama-3-8B shapes (qkv, o, gate_up, down) for batches of M rows, per BLAS backend
(`torch.backends.cuda.preferred_blas_library`: cuBLAS, cuBLASLt): microseconds per call from CUDA-graph replay over
weight copies that do not fit in L2, and the weight bytes read per second.

    python -m benchmarks.kernels.bench_decode_gemm [--ms 16,32,64,128] [--reps 20] [--dry]
"""

from benchmarks.kernels import common as C

import torch
import torch.nn.functional as F

SHAPES = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}


def main():
    ms = [int(m) for m in C.arg('--ms', '16,32,64,128').split(',')]
    reps = int(C.arg('--reps', 20))
    print(f'{"M":>4} {"shape":>8} {"backend":>9} {"us":>8} {"TB/s":>6}')
    for M in ms:
        total = {}
        for lib in ('cublas', 'cublaslt'):
            if not C.DRY:
                torch.backends.cuda.preferred_blas_library(lib)
            for name, (N, K) in SHAPES.items():
                nbytes = N * K * 2
                mk = lambda i, N=N, K=K, M=M: (
                    torch.randn(M, K, device=C.DEVICE, dtype=torch.bfloat16),
                    torch.empty(N, K, device=C.DEVICE, dtype=torch.bfloat16).uniform_(-1e-3, 1e-3),
                )
                us = C.time_fn(mk, F.linear, nbytes, reps)
                total[lib] = total.get(lib, 0) + us
                print(f'{M:>4} {name:>8} {lib:>9} {us:8.1f} {nbytes / us / 1e6:6.2f}', flush=True)
        print(f'{M:>4} {"layer":>8} ' + '  '.join(f'{k} {v:.1f} us' for k, v in total.items()), flush=True)


if __name__ == '__main__':
    main()
