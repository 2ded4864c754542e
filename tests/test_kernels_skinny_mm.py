"""The few-row dense matmul (cvllm_lab.kernels.skinny_mm) against `F.linear`: under the Triton interpreter at small
sizes (ragged N and K, split-K, bias, every row bucket), and on a GPU at the Llama-3-8B decode shapes, including
its dispatch `dense_linear` and CUDA-graph replay (the split-K workspace must be left at zero)."""
import pytest
import torch

from cvllm_lab.kernels.skinny_mm import dense_linear, skinny_config, skinny_mm, skinny_mm_ref
from cvllm_lab.kernels.split_k import workspaces


def check(y, x, w, b=None):
    ref = skinny_mm_ref(x.float(), w.float(), None if b is None else b.float())
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert y.dtype == x.dtype and y.shape == ref.shape and err < 1e-2, err


@pytest.mark.interp
@pytest.mark.parametrize('M,N,K,split,bias', [(1, 40, 96, 1, False), (5, 64, 64, 2, True), (16, 72, 160, 1, True),
                                               (33, 32, 128, 4, False), (100, 48, 64, 2, True)])
def test_skinny_mm_interpreter(M, N, K, split, bias):
    torch.manual_seed(M)
    x, w = torch.randn(M, K, dtype=torch.float16), torch.randn(N, K, dtype=torch.float16) / 8
    b = torch.randn(N, dtype=torch.float16) if bias else None
    check(skinny_mm(x, w, b, bn=32, bk=32, num_warps=4, num_stages=1, split=split), x, w, b)
    assert all(ws.abs().max() == 0 and cnt.abs().max() == 0 for ws, cnt in workspaces())   # left at zero


@pytest.mark.interp
def test_skinny_mm_rejects_and_cpu_dispatch():
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    with pytest.raises(ValueError): skinny_mm(torch.randn(129, 64), w)
    with pytest.raises(ValueError): skinny_mm(x, w, bk=32, split=3)          # 2 K-tiles do not split in 3
    with pytest.raises(ValueError): skinny_mm(x, torch.randn(64, 32).T)      # not nn.Linear's contiguous layout
    assert skinny_config(3, 32, 64, torch.bfloat16, torch.device('cpu')) is None
    torch.testing.assert_close(dense_linear(x, w), torch.nn.functional.linear(x, w))


SHAPES = {'qkv': (6144, 4096), 'o': (4096, 4096), 'gate_up': (28672, 4096), 'down': (4096, 14336)}


@pytest.mark.cuda
@pytest.mark.parametrize('M', [1, 16, 37, 64, 128])
def test_cuda_skinny_mm_8b_shapes(M):
    "Every config of the kernel's sweep space at one shape, and the tuned dispatch at all four, against cuBLAS."
    torch.manual_seed(M)
    dev = torch.device('cuda')
    for name, (N, K) in SHAPES.items():
        x, w = torch.randn(M, K, device=dev, dtype=torch.bfloat16), torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
        check(dense_linear(x, w), x, w)
        if name == 'o':
            b = torch.randn(N, device=dev, dtype=torch.bfloat16)
            for bn, bk, split in ((64, 128, 1), (128, 64, 4), (256, 128, 2)):
                check(skinny_mm(x, w, b, bn=bn, bk=bk, split=split), x, w, b)
    assert all(ws.abs().max() == 0 and cnt.abs().max() == 0 for ws, cnt in workspaces())


@pytest.mark.cuda
def test_cuda_skinny_mm_graph_replay():
    "Split-K under CUDA-graph replay: fresh inputs each replay, the same answer as cuBLAS."
    dev = torch.device('cuda')
    x = torch.zeros(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16) / 64
    f = lambda: skinny_mm(x, w, bn=64, bk=128, split=4)
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): y = f()
    for i in range(3):
        x.copy_(torch.randn(64, 4096, device=dev, dtype=torch.bfloat16))
        g.replay(); torch.cuda.synchronize()
        check(y, x, w)
