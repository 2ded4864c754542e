"""MXFP4 experts (cvllm_lab.kernels.mxfp4): the dequantization against `transformers`' own (the layout gpt-oss's
checkpoints are read in), the quantizer's round trip, and the Triton MoE matmul and fused MoE (weights kept 4-bit,
dequantized in the tile) against their references on random inputs. CPU: the interpreter at small sizes; the same
tests on a GPU, and (`-m cuda`) the gpt-oss-20b expert shape in bf16."""

import pytest
import torch

from cvllm_lab.kernels.mxfp4 import (
    FP4_VALUES,
    dequantize_mxfp4_ref,
    fused_moe_mxfp4,
    fused_moe_mxfp4_ref,
    mxfp4_moe_matmul,
    mxfp4_moe_matmul_ref,
    quantize_mxfp4_ref,
)

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


def random_mxfp4(E, N, K, g, exp=(118, 124)):
    "Random experts: every byte value, scales 2^-9 .. 2^-4 (as a trained model's)."
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(exp[0], exp[1] + 1, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return blocks.to(DEV), scales.to(DEV)


def test_dequantize_matches_transformers():
    "Our `[E, N, K]` is `transformers`' gpt-oss parameter transposed back (its `convert_moe_packed_tensors`)."
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4(3, 8, 64, g, exp=(100, 140))
    ref = convert_moe_packed_tensors(blocks.cpu(), scales.cpu(), dtype=torch.float32)  # [E, K, N]
    torch.testing.assert_close(dequantize_mxfp4_ref(blocks, scales).cpu(), ref.transpose(1, 2), rtol=0, atol=0)
    assert list(FP4_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_quantize_round_trip():
    "Quantizing the dequantized bytes gives them back; a float weight lands within half an FP4 step of each group's scale."
    g = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4(2, 4, 96, g)
    w = dequantize_mxfp4_ref(blocks, scales)
    b2, s2 = quantize_mxfp4_ref(w)
    torch.testing.assert_close(dequantize_mxfp4_ref(b2, s2), w, rtol=0, atol=0)
    x = torch.randn(2, 4, 96, generator=g).to(DEV)
    xb, xs = quantize_mxfp4_ref(x)
    step = torch.exp2(xs.float() - 127).repeat_interleave(32, -1)  # an FP4 step is at most 2 scale units (4 -> 6)
    assert ((dequantize_mxfp4_ref(xb, xs) - x).abs() <= step + 1e-6).all()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('N,K,bias', [(48, 64, True), (40, 96, False)])
def test_mxfp4_moe_matmul(dtype, N, K, bias):
    "Rows of the top-k assignments (a_row_div = k) against dequantize + fp32 matmul; N and K off the tile sizes."
    g = torch.Generator().manual_seed(2)
    E, T, k = 5, 7, 2
    blocks, scales = random_mxfp4(E, N, K, g)
    a = torch.randn(T, K, generator=g).to(DEV, dtype)
    ids = torch.randint(0, E, (T * k,), generator=g).to(DEV)
    b = torch.randn(E, N, generator=g).to(DEV) if bias else None
    out = mxfp4_moe_matmul(a, blocks, scales, ids, b, a_row_div=k, block_n=32, block_k=64)
    ref = mxfp4_moe_matmul_ref(a, blocks, scales, ids, b, a_row_div=k)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize('activation', ['swigluoai', 'silu'])
def test_fused_moe_mxfp4(activation):
    "The two matmuls around the activation and the weighted top-k sum, against the loop over dequantized experts."
    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 4, 64, 32, 5, 2
    w13b, w13s = random_mxfp4(E, 2 * I, H, g, exp=(122, 127))
    w2b, w2s = random_mxfp4(E, H, I, g)
    x = torch.randn(T, H, generator=g).to(DEV)
    tw, ids = torch.randn(T, E, generator=g).to(DEV).softmax(-1).topk(k)
    b13, b2 = torch.randn(E, 2 * I, generator=g).to(DEV), torch.randn(E, H, generator=g).to(DEV)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=activation)
    out = fused_moe_mxfp4(x, w13b, w13s, w2b, w2s, tw, ids, **kw)
    ref = fused_moe_mxfp4_ref(x, w13b, w13s, w2b, w2s, tw, ids, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if activation == 'swigluoai':  # the clamps bite on these sums
        h = x @ dequantize_mxfp4_ref(w13b[ids[0, 0]], w13s[ids[0, 0]]).T + b13[ids[0, 0]]
        assert h[:, :I].max() > 7


@pytest.mark.cuda
@pytest.mark.parametrize('T', [1, 4, 64])
def test_fused_moe_mxfp4_gpt_oss_20b_shape(T):
    "gpt-oss-20b's experts (32, top-4, hidden 2880, intermediate 2880) in MXFP4, bf16 activations, against the loop."
    g = torch.Generator().manual_seed(4)
    E, H, I, k = 32, 2880, 2880, 4
    w13b, w13s = random_mxfp4(E, 2 * I, H, g, exp=(118, 122))
    w2b, w2s = random_mxfp4(E, H, I, g, exp=(118, 122))
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    tw, ids = torch.randn(T, E, generator=g).to(DEV).softmax(-1).topk(k)
    b13, b2 = torch.randn(E, 2 * I, generator=g).to(DEV), torch.randn(E, H, generator=g).to(DEV)
    kw = dict(w13_bias=b13, w2_bias=b2)
    out = fused_moe_mxfp4(x, w13b, w13s, w2b, w2s, tw, ids, **kw).float()
    ref = fused_moe_mxfp4_ref(x, w13b, w13s, w2b, w2s, tw, ids, **kw).float()
    assert ((out - ref).abs().max() / ref.abs().max()) < 3e-2
