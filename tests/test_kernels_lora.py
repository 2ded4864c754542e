"""Multi-LoRA shrink/expand kernels (cvllm_lab.kernels.lora) against their references.

The references (grouped by slot) are checked against a per-token gather formulation (`lora_delta_ref`); the kernels
against the references on batches mixing adapters, tokens without adapter, empty slots and fused slices of different
widths (qkv-like). CPU runs them under TRITON_INTERPRET=1 at small sizes; `-m cuda` runs Llama-8B sizes.
"""

import pytest
import torch

from cvllm_lab.kernels.lora import (
    lora_delta_ref,
    lora_expand,
    lora_expand_ref,
    lora_mapping,
    lora_shrink,
    lora_shrink_ref,
)

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make(T, K, slices, R, slots, dtype, seed=0, dev=DEV):
    "A batch `x`, a pool (A, B), slice offsets, and per-token slots covering -1, every slot but one, and repeats."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dev, dtype)
    A = (torch.randn(slots, len(slices) * R, K, generator=g) / K**0.5).to(dev, dtype)
    B = (torch.randn(slots, sum(slices), R, generator=g) / R**0.5).to(dev, dtype)
    offsets = torch.tensor([0, *torch.tensor(slices).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    idx = torch.randint(-1, slots - 1, (T,), generator=g).to(dev)  # slot `slots-1` stays empty
    return x, A, B, offsets, idx


def test_mapping():
    idx = torch.tensor([2, -1, 0, 2, -1, 0, 0])
    order, start, n = lora_mapping(idx, 4)
    assert order.tolist() == [1, 4, 2, 5, 6, 0, 3]  # none first, then slot 0, 1 (empty), 2, 3 (empty); stable
    assert start.tolist() == [2, 5, 5, 7] and n.tolist() == [3, 0, 2, 0]
    bufs = (
        torch.full((7,), 9, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
    )
    assert lora_mapping(idx, 4, out=bufs) is bufs and bufs[0].tolist() == order.tolist()


def test_refs_agree_with_gather():
    x, A, B, offsets, idx = make(11, 40, [24, 8, 8], 4, 3, torch.float32, dev='cpu')
    out = torch.randn(11, 40)
    base = out.clone()
    lora_expand_ref(lora_shrink_ref(x, A, idx), B, idx, offsets.tolist(), out)
    torch.testing.assert_close(out - base, lora_delta_ref(x, A, B, idx, offsets.tolist()), rtol=1e-5, atol=1e-5)
    assert (out[idx < 0] == base[idx < 0]).all() and (out[idx >= 0] != base[idx >= 0]).any()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    'T,K,slices,R,slots',
    [(1, 32, [48], 8, 2), (7, 48, [32, 16, 16], 4, 3), (37, 64, [40, 40], 16, 4), (20, 24, [24], 32, 1)],
)
def test_shrink_expand(dtype, T, K, slices, R, slots):
    x, A, B, offsets, idx = make(T, K, slices, R, slots, dtype, seed=T)
    if slots == 1:
        idx = torch.zeros_like(idx)  # every token on the one slot
    m = lora_mapping(idx, slots)
    y = lora_shrink(x, A, m)
    yr = lora_shrink_ref(x, A, idx)
    torch.testing.assert_close(y, yr, **TOL[dtype])
    out = torch.randn(T, sum(slices), device=DEV).to(dtype)
    ref = lora_expand_ref(yr, B, idx, offsets.tolist(), out.clone())
    lora_expand(y, B, m, offsets, out, max(slices))
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_no_adapter_leaves_output():
    x, A, B, offsets, idx = make(9, 32, [32], 8, 2, torch.float32)
    idx = torch.full_like(idx, -1)
    m = lora_mapping(idx, 2)
    y = lora_shrink(x, A, m)
    out = torch.randn(9, 32, device=DEV)
    assert torch.equal(lora_expand(y, B, m, offsets, out.clone()), out) and (y == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('T', [1, 16, 64, 512])
def test_llama8b_qkv_cuda(T):
    "Llama-3-8B's fused qkv (4096 -> 4096 + 1024 + 1024), rank 16, 8 slots, bf16."
    x, A, B, offsets, idx = make(T, 4096, [4096, 1024, 1024], 16, 8, torch.bfloat16, seed=T)
    m = lora_mapping(idx, 8)
    y = lora_shrink(x, A, m)
    torch.testing.assert_close(y, lora_shrink_ref(x, A, idx), rtol=2e-2, atol=5e-2)
    out = torch.zeros(T, 6144, device=DEV, dtype=torch.bfloat16)
    lora_expand(y, B, m, offsets, out, 4096)
    ref = lora_delta_ref(x, A, B, idx, offsets.tolist())
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=5e-2)
