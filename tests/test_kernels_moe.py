"""Fused MoE (cvllm_lab.kernels.fused_moe): router, alignment by expert, and the two grouped-GEMM launches.

`fused_moe` against the loop-over-experts reference `fused_moe_ref`, the reference and the router against
`transformers`' Qwen2-MoE / Qwen3-MoE / Mixtral blocks, and the invariants of `moe_align_block_size`. CPU runs the
kernel under TRITON_INTERPRET=1 at small sizes; `-m cuda` runs the Qwen3-30B-A3B expert shape in bf16.
"""
import pytest
import torch

from cvllm_lab.kernels import fused_moe as fm
from cvllm_lab.kernels import tuned

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
# max |fused - ref| / max |ref|: fp32 differs only by summation order; fp16/bf16 round the two intermediates
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
cuda = pytest.mark.cuda


def rel_err(a, b):
    "max |a - b| / max |b| (the tolerances above are in this measure)."
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def problem(T, E, k, H, I, dtype, seed=0, renormalize=True):
    "Random inputs scaled so that each layer's output is O(1), routed by `select_experts` on random logits."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    tw, ids = fm.select_experts(torch.randn(T, E, generator=g) * 2, k, renormalize)
    return x.to(DEV, dtype), w13.to(DEV, dtype), w2.to(DEV, dtype), tw.to(DEV), ids.to(DEV)


# ------------------------------------------------------------------------------------------------ fused vs reference

CASES = [(1, 8, 2), (3, 8, 2), (17, 8, 2), (1, 16, 4), (17, 16, 4)]


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('T,E,k', CASES)
def test_fused_moe_matches_ref(T, E, k, dtype):
    x, w13, w2, tw, ids = problem(T, E, k, 64, 32, dtype, seed=T * 100 + E)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    out = fm.fused_moe(x, w13, w2, tw, ids)
    assert out.shape == (T, 64) and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f'max rel error {err:.2e}'
    # the comparison can fail: one token sent to another expert, or the router weights dropped, moves the
    # reference far beyond the tolerance
    bad = ids.clone()
    bad[T // 2, 0] = next(e for e in range(E) if e not in ids[T // 2].tolist())
    assert rel_err(fm.fused_moe_ref(x, w13, w2, tw, bad), ref) > 30 * TOL[dtype]
    assert rel_err(fm.fused_moe_ref(x, w13, w2, torch.ones_like(tw), ids), ref) > 30 * TOL[dtype]


@pytest.mark.parametrize('config', [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1),
                                    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, GROUP_M=4)])
def test_fused_moe_ragged_shapes_and_configs(config):
    "H and I not multiples of the blocks (masked N and K tails), raw top-k weights renormalized inside."
    x, w13, w2, tw, ids = problem(9, 8, 2, 80, 24, torch.float32, seed=5, renormalize=False)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids, renormalize=True)
    assert rel_err(ref, fm.fused_moe_ref(x, w13, w2, tw, ids)) > 1e-2   # renormalize changes something
    out = fm.fused_moe(x, w13, w2, tw, ids, config=config, renormalize=True)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_fused_moe_empty_and_configs_by_bucket(monkeypatch, tmp_path):
    x, w13, w2, tw, ids = problem(0, 8, 2, 64, 32, torch.float32)
    assert fm.fused_moe(x, w13, w2, tw, ids).shape == (0, 64)
    assert [fm.m_bucket(t) for t in (1, 3, 16, 17, 300, 4096, 9000)] == [1, 4, 16, 32, 512, 4096, 4096]
    tables = tuned.load_configs('fused_moe')
    assert set(tables['default']) == set(fm.M_BUCKETS)
    monkeypatch.setattr(fm, '_INTERPRET', False)
    assert fm.get_config(1, 128, 2048, 768, 8) == tables['default'][1]         # decode
    assert fm.get_config(3000, 128, 2048, 768, 8) == tables['default'][4096]   # prefill
    # a shape row wins over the bucket default
    d = tmp_path / 'fused_moe'
    d.mkdir()
    row = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=2, num_stages=2)
    (d / 'default.json').write_text(tuned.dump_configs({**tables, 'shapes': {(128, 2048, 768, 8, 64): row}}))
    monkeypatch.setattr(tuned, 'CONFIG_DIR', tmp_path)
    tuned.load_configs.cache_clear()
    try:
        assert fm.get_config(50, 128, 2048, 768, 8) == row
        assert fm.get_config(50, 64, 2048, 768, 8) == tables['default'][64]
    finally:
        tuned.load_configs.cache_clear()


def test_fused_moe_fp8_experts():
    "Block-FP8 experts (per-expert 128 x 128 scales) through the kernel = the reference on the dequantized weights."
    from cvllm_lab.quant.fp8 import quantize_fp8_block
    x, w13, w2, tw, ids = problem(7, 4, 2, 160, 136, torch.float32, seed=3)   # ragged: N, K not multiples of 128
    (q13, s13), (q2, s2) = [map(torch.stack, zip(*[quantize_fp8_block(w[e].cpu()) for e in range(4)])) for w in (w13, w2)]
    q13, s13, q2, s2 = (t.to(DEV) for t in (q13, s13, q2, s2))
    assert s13.shape == (4, 3, 2) and s2.shape == (4, 2, 2)
    ref = fm.fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2)
    assert 1e-3 < rel_err(ref, fm.fused_moe_ref(x, w13, w2, tw, ids)) < 0.1      # FP8 rounding, nothing worse
    out = fm.fused_moe(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2, config=dict(BLOCK_K=32, BLOCK_N=32))
    assert rel_err(out, ref) < TOL[torch.float32]
    s13_bad = s13.clone()
    s13_bad[:, 1] *= 2                                    # one row block of scales wrong: the test notices
    assert rel_err(fm.fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13_bad, w2_scale=s2), ref) > 1e-2


# ------------------------------------------------------------------------------------------------ alignment

@pytest.mark.parametrize('impl', ['triton', 'torch'])
@pytest.mark.parametrize('T,E,k,block_m', [(1, 8, 2, 16), (17, 8, 2, 16), (50, 16, 4, 16), (33, 8, 2, 4),
                                           (1, 128, 8, 16), (300, 128, 8, 64), (40, 200, 6, 16)])
def test_moe_align_block_size_invariants(T, E, k, block_m, impl, monkeypatch):
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randn(T, E, generator=g).topk(k, dim=-1).indices.to(torch.int32).to(DEV)
    monkeypatch.setattr(fm, 'ALIGN_ONE_PROGRAM_MAX', 1 << 30 if impl == 'triton' else 0)
    sorted_ids, expert_ids, ntpp = fm.moe_align_block_size(ids, block_m, E)
    if impl == 'triton':   # the one-program kernel gives exactly the device-wide ops' result
        for a, b in zip((sorted_ids, expert_ids, ntpp), fm.moe_align_block_size_ref(ids.long(), block_m, E)):
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
    sorted_ids, expert_ids, ntpp, ids = sorted_ids.cpu(), expert_ids.cpu(), ntpp.cpu(), ids.cpu()
    n, flat = T * k, ids.flatten().long()
    total = int(ntpp.item())
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum()) <= sorted_ids.numel()
    real = sorted_ids[sorted_ids != n]
    assert torch.equal(real.sort().values.long(), torch.arange(n))                 # every assignment exactly once
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // block_m:] == -1).all()
    assert int((sorted_ids[:total] == n).sum()) == total - n                        # the padding
    blocks = sorted_ids[:total].view(-1, block_m).long()
    for b, e in zip(blocks, expert_ids[:total // block_m].tolist()):
        own = b[b != n]
        assert own.numel() > 0 and (flat[own] == e).all()                           # the block's expert owns it
    # only experts with assignments get blocks, each in one run (decode touches only the selected experts)
    used = expert_ids[:total // block_m]
    assert set(used.tolist()) == set(flat.tolist())
    assert torch.equal(used, torch.unique_consecutive(used).repeat_interleave(
        ((counts[counts > 0] + block_m - 1) // block_m)))


# ------------------------------------------------------------------------------------------------ transformers

def _hf_block(arch, norm, E=8, k=2, H=64, I=32):
    "A `transformers` sparse MoE block with a tiny config and random weights."
    if arch == 'mixtral':
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    elif arch == 'qwen2_moe':
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                             num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                             norm_topk_prob=norm)
    torch.manual_seed(0)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters(): p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize('arch,norm', [('mixtral', True), ('qwen2_moe', False), ('qwen2_moe', True),
                                       ('qwen3_moe', True), ('qwen3_moe', False)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_select_experts_matches_transformers(arch, norm, dtype):
    pytest.importorskip('transformers')
    block = _hf_block(arch, norm).to(dtype)
    h = torch.randn(23, 64).to(dtype)
    with torch.no_grad():
        logits, hf_w, hf_ids = block.gate(h)
    tw, ids = fm.select_experts(logits, 2, renormalize=norm)
    assert ids.dtype == torch.int32 and tw.dtype == torch.float32
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(tw, hf_w.float(), rtol=0, atol=1e-6 if hf_w.dtype == torch.float32 else 4e-3)
    if not norm:   # the raw top-k probabilities do not sum to 1: the flag matters
        assert (tw.sum(-1) < 0.999).any()


@pytest.mark.parametrize('arch', ['mixtral', 'qwen3_moe'])
def test_experts_match_transformers(arch):
    "transformers' experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) = our w13 / w2 layout."
    pytest.importorskip('transformers')
    block = _hf_block(arch, True)
    h = torch.randn(11, 64)
    with torch.no_grad():
        _, hf_w, hf_ids = block.gate(h)
        hf_out = block.experts(h, hf_ids, hf_w)
    tw, ids = fm.select_experts(h @ block.gate.weight.T, 2, renormalize=True)
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    ref = fm.fused_moe_ref(h, w13, w2, tw, ids)
    assert rel_err(ref, hf_out) < 1e-5
    out = fm.fused_moe(h.to(DEV), w13.to(DEV), w2.to(DEV), tw.to(DEV), ids.to(DEV)).cpu()
    assert rel_err(out, hf_out) < 1e-5


# ------------------------------------------------------------------------------------------------ GPU, real size

@cuda
@pytest.mark.parametrize('T', [1, 64, 512])
def test_fused_moe_qwen3_30b_a3b_shape(T):
    "Qwen3-30B-A3B's experts: 128 of them, top-8, hidden 2048, moe_intermediate 768, bf16."
    x, w13, w2, tw, ids = problem(T, 128, 8, 2048, 768, torch.bfloat16, seed=T)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    err = rel_err(fm.fused_moe(x, w13, w2, tw, ids), ref)
    assert err < TOL[torch.bfloat16], f'max rel error {err:.2e}'
    for cfg in (tuned.load_configs('fused_moe')['default'][b] for b in (1, 4096)):   # decode and prefill configs
        assert rel_err(fm.fused_moe(x, w13, w2, tw, ids, config=cfg), ref) < TOL[torch.bfloat16]
