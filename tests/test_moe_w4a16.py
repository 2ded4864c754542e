"""Fused MoE over W4A16 experts (`cvllm_lab.kernels.fused_moe_w4a16`) at the Qwen3-30B-A3B expert shape on a GPU.

The small cases (Triton interpreter) live in notebook 41. Here (`-m cuda`): E=128 experts, H=2048, I=768, top-8,
bf16 activations, M = 1 / 4 / 64 / 512 tokens through the decode GEMVs and the grouped GEMMs against the
plain-PyTorch reference (each used expert dequantized, fp32 loop), the same call replayed from a CUDA graph, and a
tiny Qwen3-MoE through `LLM(..., quantization='w4a16')` on CUDA against `transformers` with the dequantized weights.

`python tests/test_moe_w4a16.py` (on a GPU) times the kernel against the bf16 `fused_moe` at the same shape for
each M and a few launch configs: the numbers to put into `CONFIGS` of `fused_moe_w4a16`.
"""

import pytest
import torch

from cvllm_lab.kernels.fused_moe import fused_moe, select_experts
from cvllm_lab.kernels.fused_moe_w4a16 import DECODE_MAX_T, fused_moe_w4a16, fused_moe_w4a16_ref
from cvllm_lab.kernels.w4a16_layout import padded_k
from cvllm_lab.quant.w4a16 import pack_weights

from helpers import tiny_qwen3_moe

E, H, I, TOP_K, GROUP = 128, 2048, 768, 8, 128
TOL = 3e-2  # max |out - ref| / max |ref| with bf16 x, bf16-rounded weights and intermediates (fused_moe's bf16 bound)


def packed_experts(N, K, g, device='cuda'):
    "Random 4-bit experts `[E, N, K]` in the packed layout: levels, fp16 scales ~ 1/(8 sqrt(K)), symmetric offsets."
    q = torch.randint(0, 16, (E, N, K), generator=g, dtype=torch.uint8).to(device)
    qw = torch.stack([pack_weights(q[e], 4) for e in range(E)])
    s = (torch.rand(E, padded_k(K) // GROUP, N, generator=g) * 0.5 + 0.75).div(8 * K**0.5).half().to(device)
    return qw, s, (-8 * s.float()).half()


@pytest.fixture(scope='module')
def experts():
    g = torch.Generator().manual_seed(0)
    w13, w2 = packed_experts(2 * I, H, g), packed_experts(H, I, g)
    return [w13[0], w2[0], w13[1], w2[1], w13[2], w2[2]]


def routed(M, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).cuda().bfloat16()
    tw, ids = select_experts(torch.randn(M, E, generator=g).cuda() * 2, TOP_K, True)
    return x, tw, ids


def rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.cuda
@pytest.mark.parametrize('M', [1, 4, 64, 512])
def test_w4a16_moe_real_shape(experts, M):
    x, tw, ids = routed(M, M)
    ref = fused_moe_w4a16_ref(x, *experts, tw, ids)
    assert ref.float().abs().max() > 0.05, 'the problem is scaled so that the output is not vanishing (about 0.06 std)'
    paths = [None, dict(decode=None)] if M <= DECODE_MAX_T else [None]
    for cfg in paths:
        out = fused_moe_w4a16(x, *experts, tw, ids, config=cfg)
        assert out.shape == (M, H) and out.dtype == torch.bfloat16
        err = rel_max(out, ref)
        print(f'M={M} {"grouped" if cfg else "default"}: max rel error {err:.2e}')
        assert err < TOL, (M, cfg, err)
    assert rel_max(fused_moe_w4a16_ref(x, *experts, torch.ones_like(tw), ids), ref) > 3 * TOL  # the check can fail


@pytest.mark.cuda
@pytest.mark.parametrize('M', [1, 64])
def test_w4a16_moe_cuda_graph(experts, M):
    "No host sync: the call captures into a CUDA graph, and a replay on new inputs equals the eager call."
    x, tw, ids = routed(M, 7)
    fused_moe_w4a16(x, *experts, tw, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_w4a16(x, *experts, tw, ids)
    x2, tw2, ids2 = routed(M, 8)
    x.copy_(x2)
    tw.copy_(tw2)
    ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, fused_moe_w4a16(x, *experts, tw, ids), atol=0, rtol=0)


@pytest.mark.cuda
def test_qwen3_moe_w4a16_through_engine_cuda():
    """A tiny Qwen3-MoE with `quantization='w4a16'` in bf16 on CUDA (CUDA graphs, the kernels) against `transformers`
    in fp32 holding the dequantized weights: our top token within 0.1 nats of the best, mean |log-prob error| < 0.05."""
    import copy
    from cvllm_lab import LLM, SamplingParams

    cfg, hf, d = tiny_qwen3_moe(hidden=256, head_dim=64)
    llm = LLM(
        str(d),
        device='cuda',
        dtype='bfloat16',
        quantization='w4a16',
        skip_tokenizer_init=True,
        progress=False,
        block_size=16,
        max_num_seqs=8,
        kv_cache_memory=64 << 20,
    )
    model = llm.engine.runner.model
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
        for ours, theirs in zip(model.model.layers, ref.model.layers):
            a, b = ours.self_attn, theirs.self_attn
            q, k, v = a.qkv_proj.dequantize().float().cpu().split([a.H * a.D, a.Hkv * a.D, a.Hkv * a.D])
            for lin, w in (
                (b.q_proj, q),
                (b.k_proj, k),
                (b.v_proj, v),
                (b.o_proj, a.o_proj.dequantize().float().cpu()),
            ):
                lin.weight.copy_(w)
            e = ours.mlp.experts
            assert type(e.quant_method).__name__ == 'W4A16MoEMethod'
            w13, w2 = e.quant_method.dequantize(e)
            theirs.mlp.experts.gate_up_proj.copy_(w13.cpu())
            theirs.mlp.experts.down_proj.copy_(w2.cpu())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 41, 23)]
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True),
        use_tqdm=False,
    )
    with torch.no_grad():
        for p, o in zip(prompts[1:], outs[1:]):
            want = torch.log_softmax(ref(torch.tensor([p])).logits[0].float(), -1)[:-1]
            got = torch.tensor([[lp[t].logprob for t in range(256)] for lp in o.prompt_logprobs[1:]])
            gap = want.max(-1).values - want.gather(-1, got.argmax(-1, keepdim=True))[:, 0]
            assert gap.max() < 0.1, gap.max()
            assert (got - want).abs().mean() < 0.05, (got - want).abs().mean()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def _time(fn, iters=50):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main():
    "Time the W4A16 experts against bf16 `fused_moe` at the Qwen3-30B-A3B expert shape (microseconds per call)."
    g = torch.Generator().manual_seed(0)
    w13, w2 = packed_experts(2 * I, H, g), packed_experts(H, I, g)
    ex = [w13[0], w2[0], w13[1], w2[1], w13[2], w2[2]]
    bf13 = torch.randn(E, 2 * I, H, device='cuda', dtype=torch.bfloat16) / H**0.5
    bf2 = torch.randn(E, H, I, device='cuda', dtype=torch.bfloat16) / I**0.5
    grouped = [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, decode=None)
        for bm in (16, 32, 64)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]
    decode = [
        dict(decode=dict(BN1=b1, W1=w, BN2=b2, W2=w, SPLIT2=sp))
        for b1 in (16, 32, 64)
        for b2 in (16, 32, 64)
        for w in (2, 4)
        for sp in (1, 2, 4)
    ]
    for M in (1, 4, 16, 64, 256, 512, 2048):
        x, tw, ids = routed(M, M)
        t_bf16 = _time(lambda: fused_moe(x, bf13, bf2, tw, ids))
        t_def = _time(lambda: fused_moe_w4a16(x, *ex, tw, ids))
        best = min(
            (
                (_time(lambda: fused_moe_w4a16(x, *ex, tw, ids, config=c)), c)
                for c in (decode + grouped if M <= DECODE_MAX_T else grouped)
            ),
            key=lambda r: r[0],
        )
        print(
            f'M={M:5d}  bf16 fused_moe {t_bf16:8.1f} us  w4a16 default {t_def:8.1f} us  best {best[0]:8.1f} us {best[1]}'
        )


if __name__ == '__main__':
    main()
