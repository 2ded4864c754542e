"""Gemma 4's experts on the fused MoE kernels: `activation='gelu_tanh'` (GeGLU, `gelu(gate, approximate='tanh') * up`)
through the grouped GEMMs (the activation a pass of its own between them) against the loop-over-experts reference,
and the reference against the plain formula. CPU runs the kernels under TRITON_INTERPRET=1 at small sizes."""

import pytest
import torch
import torch.nn.functional as F

from cvllm_lab.kernels import fused_moe as fm

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def problem(T, E, k, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 2
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    tw, ids = fm.select_experts(torch.randn(T, E, generator=g) * 2, k, True)
    return x.to(DEV), w13.to(DEV), w2.to(DEV), tw.to(DEV), ids.to(DEV)


def test_geglu_reference_is_the_formula():
    x, w13, w2, tw, ids = problem(6, 4, 2, 32, 16, seed=1)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids, activation='gelu_tanh')
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += tw[t, j] * (w2[e] @ (F.gelu(gate, approximate='tanh') * up))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    assert (ref - fm.fused_moe_ref(x, w13, w2, tw, ids)).abs().max() > 1e-2  # not SwiGLU


@pytest.mark.parametrize('variant', [{}, dict(SORTED=1, ACT=1), dict(ATOMIC=1)])
def test_fused_moe_geglu(variant):
    "The grouped path whatever the config asks (`ACT` and a decode entry are SwiGLU's only), ragged sizes, fp32."
    x, w13, w2, tw, ids = problem(5, 8, 3, 80, 24, seed=7)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids, activation='gelu_tanh')
    cfg = {**variant, 'decode': dict(BN1=16, BK1=32, BN2=16, BK2=32)}
    out = fm.fused_moe(x, w13, w2, tw, ids, config=cfg, activation='gelu_tanh')
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
