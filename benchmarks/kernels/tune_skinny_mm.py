"""Tune the few-row dense matmul (`kernels/skinny_mm.py`) against cuBLAS per shape and row bucket, and write the
shapes where it wins as data.

    python -m benchmarks.kernels.tune_skinny_mm [--shapes qkv,o,gate_up,down] [--buckets 16,32,64,128]
                                                [--margin 0.03] [--workers N] [--out DIR] [--write] [--dry]

Shapes: the Llama-3-8B linears (`common.L3_8B`), bf16. Per (shape, bucket), timed at M = the bucket in a CUDA graph
over rotating weight copies (`common.time_fn`, every call reads its weight from HBM): cuBLAS and cuBLASLt through
`F.linear`, and every kernel config of the grid (`bn` x `bk` x `num_warps` x `num_stages` within 200 KB of
shared memory, x `split` in 1, 2, 4, 8), each first checked against `F.linear` in fp32 (relative error < 1e-2).
Every binary is compiled first by `--workers` processes into Triton's disk cache. A shape and bucket enters the
`shapes` table when its best config beats the faster BLAS by more than `--margin`; the rest stay on cuBLAS.
Written to `--out` (default `.`) after every point: `tune_skinny_mm.csv` (every timing) and `<device>.json`; `--write` also writes
it into `kernels/configs/skinny_mm/`. `--dry`: a small shape and two configs under the Triton interpreter.
"""
from benchmarks.kernels import common as C   # first: `--dry` sets TRITON_INTERPRET before the kernels load

import contextlib
import csv
import itertools
import os
import sys

import torch
import torch.nn.functional as F

from cvllm_lab.kernels import tuned
from cvllm_lab.kernels.skinny_mm import skinny_mm

KERNEL = 'skinny_mm'


def grid():
    if C.DRY: return [dict(bn=32, bk=32, num_warps=4, num_stages=1, split=1), dict(bn=32, bk=32, num_warps=4, num_stages=1, split=2)]
    out = []
    for bn, bk, w, s, sp in itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5, 6), (1, 2, 4, 8)):
        if s * (bn * bk + bk * 128) * 2 <= 200 * 1024 and not (bn == 256 and w == 4):
            out.append(dict(bn=bn, bk=bk, num_warps=w, num_stages=s, split=sp))
    return out


def _compile_worker(jobs):
    "Run each (bucket, cfg) once at a small shape: the binaries depend on the block sizes, not on N or K."
    for M, cfg in jobs:
        try:
            x = torch.randn(M, 4096, device=C.DEVICE, dtype=C.XDT)
            skinny_mm(x, torch.randn(512, 4096, device=C.DEVICE, dtype=C.XDT), **cfg)
        except Exception as e:
            print('compile failed', M, cfg, repr(e)[:200], flush=True)
    torch.cuda.synchronize()


@contextlib.contextmanager
def _blas(name):
    "Matmuls in this block, and graphs captured in it, use BLAS library `name`."
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try: yield
    finally: torch.backends.cuda.preferred_blas_library(prev)


def main():
    names = C.arg('--shapes', 'o' if C.DRY else ','.join(C.L3_8B)).split(',')
    buckets = [int(b) for b in C.arg('--buckets', '16' if C.DRY else '16,32,64,128').split(',')]
    margin = float(C.arg('--margin', 0.03))
    out_dir = C.arg('--out', '.')
    os.makedirs(out_dir, exist_ok=True)
    dev = tuned.device_key(C.device_name())
    cands = grid()
    if not C.DRY:
        C.precompile(_compile_worker, [(M, c) for M in buckets for c in cands],
                     int(C.arg('--workers', min(15, (os.cpu_count() or 2) - 1))))
    table, rows = {}, []
    print(f'{C.device_name()}: {len(cands)} configs per shape and bucket', flush=True)
    for name in names:
        N, K = C.L3_8B[name]
        nb = N * K * 2
        for M in buckets:
            make = lambda i: (torch.randn(M, K, device=C.DEVICE, dtype=C.XDT), torch.randn(N, K, device=C.DEVICE, dtype=C.XDT) / 64)
            x, w = make(0)
            ref = F.linear(x.float(), w.float())
            t = {}
            for lib in ('cublas', 'cublaslt'):
                if C.DRY: break
                with _blas(lib): t[lib] = C.time_fn(make, F.linear, nb)   # the library is read when the graph captures
            best, best_us = None, float('inf')
            for cfg in cands:
                try:
                    err = C.rel_err(skinny_mm(x, w, **cfg), ref)
                    us = C.time_fn(make, lambda a, b: skinny_mm(a, b, **cfg), nb) if err < 1e-2 else None
                except Exception as e:
                    err, us = float('nan'), None
                rows.append(dict(device=C.device_name(), shape=name, N=N, K=K, M=M, **cfg, err=err, us=us,
                                 cublas_us=t.get('cublas'), cublaslt_us=t.get('cublaslt')))
                if us is not None and us < best_us: best, best_us = cfg, us
            ref_us = min(t.values()) if t else float('inf')
            win = best is not None and best_us < (1 - margin) * ref_us
            if win or C.DRY: table[N, K, M] = best
            print(f'{name} M={M}: cuBLAS {t.get("cublas", float("nan")):.1f} cuBLASLt {t.get("cublaslt", float("nan")):.1f} '
                  f'kernel {best_us:.1f} us ({nb / best_us / 1e6:.2f} TB/s) {best} -> {"kernel" if win else "BLAS"}', flush=True)
            with open(os.path.join(out_dir, 'tune_skinny_mm.csv'), 'w', newline='') as f:
                wr = csv.DictWriter(f, fieldnames=list(rows[0])); wr.writeheader(); wr.writerows(rows)
            text = tuned.dump_configs({'shapes': dict(sorted(table.items()))})   # after every point: a cut-off run keeps its part
            with open(os.path.join(out_dir, f'{dev}.json'), 'w') as f: f.write(text)
            if '--write' in sys.argv and not C.DRY: (tuned.CONFIG_DIR / KERNEL / f'{dev}.json').write_text(text)
    print(text)


if __name__ == '__main__':
    main()
