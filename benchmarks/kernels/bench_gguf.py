"""Time the GGUF raw-byte kernels (`cvllm_lab.kernels.gguf_matmul`) on a GPU.

    python -m benchmarks.kernels.bench_gguf [--types q4k,q6k,...] [--sweep q4k,q6k,q4_0,q8_0]

The GEMV at M = 1 for 4096 x 14336 and 14336 x 4096 weights of every type (time, GB/s of quantized bytes read and %
of the peak), with a small sweep of rows per program and warps for the `--sweep` types (a winner goes to
`kernels/configs/gguf_gemv/`), next to the bf16 cuBLAS GEMV; then the batched paths (M = 16, 64, 512) for a few types.
Weights rotate over 8 copies so that every call reads from HBM; each timing is a CUDA-graph replay (`common`).
"""

from benchmarks.kernels import common as C

import torch

from cvllm_lab.kernels.gguf_layout import dequantize, parse_qtype
from cvllm_lab.kernels.gguf_matmul import KERNEL_TYPES, gguf_gemv, gguf_matmul, gguf_matmul_ref
from cvllm_lab.quant.gguf import random_blocks


def main():
    types = [parse_qtype(t) for t in C.arg('--types', ','.join(t.name for t in KERNEL_TYPES)).split(',')]
    sweep = {parse_qtype(t) for t in C.arg('--sweep', 'q4k,q6k,q4_0,q8_0').split(',')}
    dev, peak = 'cuda', C.PEAK
    print(f'device: {C.device_name()}, peak read bandwidth assumed {peak / 1e12:.1f} TB/s')
    print(f'{"type":6} {"N x K":>12} {"MB":>7} {"us":>8} {"GB/s":>7} {"%peak":>6}  config')
    copies = 8  # rotate over 8 weight copies (> L2) so every call reads from HBM
    for N, K in ((4096, 14336), (14336, 4096)):
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        wd = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        tt = C.graph_time(lambda i: x @ wd[i % 4].T, 16)
        print(
            f'{"bf16":6} {f"{N}x{K}":>12} {N * K * 2 / 1e6:7.1f} {tt * 1e6:8.1f} {N * K * 2 / tt / 1e9:7.0f} '
            f'{N * K * 2 / tt / peak * 100:5.0f}%  torch x @ W.T (cuBLAS)'
        )
        del wd
        for t in types:
            q0 = random_blocks(t, N, K, generator=torch.Generator().manual_seed(0)).to(dev)
            qs = [q0] + [q0.roll(i, 0).contiguous() for i in range(1, copies)]
            nbytes = q0.numel()
            ref = gguf_matmul_ref(x, q0, t, N, K).float()
            cfgs = [dict()]
            if t in sweep:
                cfgs += [dict(bn=bn, num_warps=nw) for bn, nw in ((8, 4), (16, 8), (32, 4), (32, 8))] + [
                    dict(split_k=1)
                ]
            best = None
            for cfg in cfgs:
                try:
                    err = C.rel_err(gguf_gemv(x, q0, t, N, K, **cfg), ref)
                    assert err < 1e-2, err
                    tt = C.graph_time(lambda i: gguf_gemv(x, qs[i % copies], t, N, K, **cfg), 16)
                except Exception as e:  # report and go on: one call has to cover everything
                    print(f'{t.name:6} {f"{N}x{K}":>12} FAILED {cfg}: {str(e)[:300]}')
                    continue
                print(
                    f'{t.name:6} {f"{N}x{K}":>12} {nbytes / 1e6:7.1f} {tt * 1e6:8.1f} {nbytes / tt / 1e9:7.0f} '
                    f'{nbytes / tt / peak * 100:5.0f}%  {cfg or "default"}',
                    flush=True,
                )
                best = min(best or (tt, cfg), (tt, cfg), key=lambda v: v[0])
            if len(cfgs) > 1 and best:
                print(f'{"":6} best: {best[1] or "default"}')
            qs.clear()  # free the copies before the next type
    for t, M in (('q4k', 16), ('q6k', 16), ('q4k', 64), ('q4k', 512)):  # batched paths, one type each
        t = parse_qtype(t)
        N, K = 14336, 4096
        q = random_blocks(t, N, K, generator=torch.Generator().manual_seed(1)).to(dev)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        wd = dequantize(q, t, dtype=torch.bfloat16)
        try:
            assert C.rel_err(gguf_matmul(x, q, t, N, K), x.float() @ wd.float().T) < 2e-2
            tt = C.graph_time(lambda i: gguf_matmul(x, q, t, N, K), 8)
            td = C.graph_time(lambda i: x @ wd.T, 8)
            print(f'{t.name:6} M={M:<4} {N}x{K}: gguf_matmul {tt * 1e6:8.1f} us, bf16 cuBLAS {td * 1e6:8.1f} us')
        except Exception as e:
            print(f'{t.name} M={M} FAILED: {str(e)[:300]}')


if __name__ == '__main__':
    main()
