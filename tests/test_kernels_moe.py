"""Fused MoE (cvllm_lab.kernels.fused_moe*): router, alignment by expert, the grouped-GEMM launches (with and
without SiLU-and-mul in the first GEMM's epilogue, weight tile on either MMA side) and the two-GEMV decode path.

`fused_moe` and `fused_moe_decode` against the loop-over-experts reference `fused_moe_ref`, `fused_topk` against the
PyTorch router, the reference and the router against `transformers`' Qwen2-MoE / Qwen3-MoE / Mixtral blocks, and
the invariants of `moe_align_block_size`. CPU runs the kernels under TRITON_INTERPRET=1 at small sizes;
`-m cuda` runs the Qwen3-30B-A3B expert shape in bf16 through every path.
"""

import pytest
import torch

from cvllm_lab.kernels import fused_moe as fm
from cvllm_lab.kernels import tuned
from cvllm_lab.kernels.fused_moe_decode import fused_moe_decode
from cvllm_lab.kernels.fused_moe_router import fused_topk

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
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
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


@pytest.mark.parametrize(
    'config', [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, GROUP_M=4)]
)
def test_fused_moe_ragged_shapes_and_configs(config):
    "H and I not multiples of the blocks (masked N and K tails), raw top-k weights renormalized inside."
    x, w13, w2, tw, ids = problem(9, 8, 2, 80, 24, torch.float32, seed=5, renormalize=False)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids, renormalize=True)
    assert rel_err(ref, fm.fused_moe_ref(x, w13, w2, tw, ids)) > 1e-2  # renormalize changes something
    out = fm.fused_moe(x, w13, w2, tw, ids, config=config, renormalize=True)
    assert rel_err(out, ref) < TOL[torch.float32]


GROUPED = [
    dict(ACT=1),
    dict(SWAP=1),
    dict(ACT=1, SWAP=1, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1),
    dict(SORTED=1),
    dict(XSORT=1),
    dict(ACT=1, SORTED=1, XSORT=1, GROUP_M=2),
    dict(SORTED=1, SWAP=1, down=dict(BLOCK_N=16, BLOCK_K=64, GROUP_M=2, num_warps=2, SWAP=0)),
    dict(ACT=1, down=dict(BLOCK_N=64, BLOCK_K=16, SWAP=1)),
    dict(ATOMIC=1, SORTED=1),
    dict(ATOMIC=1, down=dict(SWAP=1, BLOCK_N=32)),
    dict(PERSISTENT=1, GROUP_M=2),
    dict(PERSISTENT=2, ACT=1, SORTED=1, down=dict(PERSISTENT=1, CTAS_PER_SM=2)),
]


@pytest.mark.parametrize('variant', GROUPED)
@pytest.mark.parametrize('T,E,k,H,I', [(3, 8, 2, 64, 32), (17, 16, 4, 80, 24)])
def test_fused_moe_grouped_variants(T, E, k, H, I, variant):
    """SiLU-and-mul in the first GEMM's epilogue (`ACT`), the weight tile as the MMA's M side (`SWAP`), the
    intermediate in sorted order (`SORTED`), x permuted into expert order (`XSORT`), the down GEMM's own tile
    (`down`), the top-k sum by fp32 atomics (`ATOMIC`), a persistent grid striding over the tiles (`PERSISTENT`);
    ragged too."""
    x, w13, w2, tw, ids = problem(T, E, k, H, I, torch.float32, seed=T + H)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    out = fm.fused_moe(x, w13, w2, tw, ids, config={**variant, 'decode': None})
    assert rel_err(out, ref) < TOL[torch.float32]


GPT_OSS = [
    {},
    dict(SWAP=1),
    dict(SORTED=1, ACT=1),
    dict(XSORT=1, down=dict(SWAP=1)),
    dict(ATOMIC=1),
    dict(PERSISTENT=1),
]


@pytest.mark.parametrize('variant', GPT_OSS)
def test_fused_moe_bias_swigluoai(variant):
    """gpt-oss's experts: biases in both GEMMs' epilogues (before the router weight) and the clamped SwiGLU between
    them, on the grouped path whatever the config asks (`ACT` and a decode entry are passed over), ragged sizes."""
    x, w13, w2, tw, ids = problem(5, 8, 3, 80, 24, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    b13, b2 = (torch.randn(*s, generator=g).to(DEV) for s in ((8, 48), (8, 80)))
    x = x * 4  # sums past the clamp (7)
    kw = dict(w13_bias=b13, w2_bias=b2, activation='swigluoai')
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids, **kw)
    assert (x @ w13[ids[0, 0]].T + b13[ids[0, 0]])[:, :24].max() > 7
    out = fm.fused_moe(x, w13, w2, tw, ids, config={**variant, 'decode': dict(BN1=16, BK1=32, BN2=16, BK2=32)}, **kw)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(ref, fm.fused_moe_ref(x, w13, w2, tw, ids)) > 0.1  # the biases and the activation matter


def test_moe_permute_rows():
    "x gathered into expert order: each real position holds its assignment's token row, exactly."
    x, _, _, _, ids = problem(13, 8, 2, 80, 24, torch.float32, seed=2)
    sorted_ids, _, ntpp = fm.moe_align_block_size(ids, 16, 8)
    xs = fm.moe_permute(x, sorted_ids, ntpp, 2)
    real = (sorted_ids < ids.numel()).nonzero()[:, 0]
    assert xs.shape == (sorted_ids.numel(), 80) and real.numel() == ids.numel()
    assert torch.equal(xs[real], x[(sorted_ids[real] // 2).long()])


DECODE = [
    dict(BN1=16, BK1=32, BN2=16, BK2=32, SPLIT2=1),
    dict(BN1=8, BK1=64, BN2=32, BK2=16, SPLIT2=2),
    dict(BN1=32, BK1=16, BN2=8, BK2=64, SPLIT2=4, W1=2, W2=2),
]


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('cfg', DECODE)
@pytest.mark.parametrize('T,E,k,H,I', [(1, 8, 2, 64, 32), (3, 16, 4, 80, 24), (2, 16, 4, 64, 48)])
def test_fused_moe_decode_matches_ref(T, E, k, H, I, cfg, dtype):
    """The two-GEMV decode path: each (token, expert) pair its own row group, SiLU-and-mul and the weighted top-k
    sum in the epilogues, the experts of a token split over programs (`SPLIT2`, summed in the workspace);
    ragged H and I (masked K tails), a split that does not divide k (falls back to one)."""
    x, w13, w2, tw, ids = problem(T, E, k, H, I, dtype, seed=T * 7 + I)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    out = fused_moe_decode(x, w13, w2, tw, ids, cfg)
    assert out.shape == (T, H) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    # through fused_moe: a `decode` entry in the config takes this path, with raw weights renormalized first
    _, _, _, raw, ids2 = problem(T, E, k, H, I, dtype, seed=T * 7 + I, renormalize=False)
    assert rel_err(fm.fused_moe(x, w13, w2, raw, ids2, config={'decode': cfg}, renormalize=True), ref) < TOL[dtype]
    # the workspace is left at zero (the next call, or a replayed CUDA graph, starts clean)
    from cvllm_lab.kernels.split_k import workspaces

    assert all(int(ws.count_nonzero()) == 0 and int(cnt.count_nonzero()) == 0 for ws, cnt in workspaces())


@pytest.mark.parametrize('T,E,k', [(1, 8, 2), (5, 60, 4), (33, 128, 8), (3, 200, 6), (2, 8, 8)])
@pytest.mark.parametrize('renormalize', [True, False])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_fused_topk_matches_select_experts(T, E, k, renormalize, dtype):
    "One-launch softmax + top-k + renormalization = the PyTorch router (ids exactly, weights to fp32 rounding)."
    g = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 3).to(DEV, dtype)
    ref_w, ref_ids = fm.select_experts(logits, k, renormalize, use_kernel=False)
    w, ids = fused_topk(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (T, k)
    torch.testing.assert_close(w.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()), rtol=0, atol=0)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), ref_ids.cpu())  # (bf16 logits tie; fp32 don't)
    if renormalize:
        torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(T), rtol=0, atol=1e-5)
    assert torch.equal(fm.select_experts(logits, k, renormalize, use_kernel=True)[1], ids)
    # a row's result does not depend on its neighbours (rows per program)
    w1, ids1 = fused_topk(logits, k, renormalize, rows=1)
    assert torch.equal(ids1, ids) and torch.equal(w1, w)


def test_fused_moe_empty_and_configs_by_bucket(monkeypatch, tmp_path):
    x, w13, w2, tw, ids = problem(0, 8, 2, 64, 32, torch.float32)
    assert fm.fused_moe(x, w13, w2, tw, ids).shape == (0, 64)
    assert [fm.m_bucket(t) for t in (1, 3, 16, 17, 300, 4096, 5000, 9000)] == [1, 4, 16, 32, 512, 4096, 8192, 8192]
    tables = tuned.load_configs('fused_moe')
    assert set(tables['default']) == set(fm.M_BUCKETS)
    monkeypatch.setattr(fm, '_INTERPRET', False)
    assert fm.get_config(1, 128, 2048, 768, 8) == tables['default'][1]  # decode
    assert fm.get_config(3000, 128, 2048, 768, 8) == tables['default'][4096]  # prefill
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

    x, w13, w2, tw, ids = problem(7, 4, 2, 160, 136, torch.float32, seed=3)  # ragged: N, K not multiples of 128
    (q13, s13), (q2, s2) = [
        map(torch.stack, zip(*[quantize_fp8_block(w[e].cpu()) for e in range(4)])) for w in (w13, w2)
    ]
    q13, s13, q2, s2 = (t.to(DEV) for t in (q13, s13, q2, s2))
    assert s13.shape == (4, 3, 2) and s2.shape == (4, 2, 2)
    ref = fm.fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2)
    assert 1e-3 < rel_err(ref, fm.fused_moe_ref(x, w13, w2, tw, ids)) < 0.1  # FP8 rounding, nothing worse
    for extra in (
        {},
        dict(ACT=1),
        dict(SWAP=1),
        dict(ACT=1, SWAP=1),
        dict(ACT=1, SORTED=1, XSORT=1),
        dict(SORTED=1, ATOMIC=1, down=dict(BLOCK_N=64, BLOCK_K=64)),
    ):  # (FP8 experts never take the decode path)
        out = fm.fused_moe(
            x,
            q13,
            q2,
            tw,
            ids,
            w13_scale=s13,
            w2_scale=s2,
            config=dict(BLOCK_K=32, BLOCK_N=32, decode=DECODE[0], **extra),
        )
        assert rel_err(out, ref) < TOL[torch.float32], extra
    s13_bad = s13.clone()
    s13_bad[:, 1] *= 2  # one row block of scales wrong: the test notices
    assert rel_err(fm.fused_moe_ref(x, q13, q2, tw, ids, w13_scale=s13_bad, w2_scale=s2), ref) > 1e-2


# ------------------------------------------------------------------------------------------------ alignment


@pytest.mark.parametrize('impl', ['one_program', 'grid', 'torch'])
@pytest.mark.parametrize(
    'T,E,k,block_m',
    [
        (1, 8, 2, 16),
        (17, 8, 2, 16),
        (50, 16, 4, 16),
        (33, 8, 2, 4),
        (1, 128, 8, 16),
        (300, 128, 8, 64),
        (40, 200, 6, 16),
        (700, 16, 4, 32),
        (4100, 8, 4, 16),
        (20, 256, 8, 64),
    ],
)  # last: each chunk fills > 1024 sentinels
def test_moe_align_block_size_invariants(T, E, k, block_m, impl, monkeypatch):
    "One program (decode sizes), three launches over chunks (many assignments) and the PyTorch ops agree exactly."
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randn(T, E, generator=g).topk(k, dim=-1).indices.to(torch.int32).to(DEV)
    monkeypatch.setattr(fm, 'ALIGN_ONE_PROGRAM_MAX', 1 << 30 if impl == 'one_program' else 0)
    align = fm.moe_align_block_size_ref if impl == 'torch' else fm.moe_align_block_size
    sorted_ids, expert_ids, ntpp = align(ids, block_m, E)
    if impl != 'torch':  # the kernels give exactly the device-wide ops' result
        for a, b in zip((sorted_ids, expert_ids, ntpp), fm.moe_align_block_size_ref(ids.long(), block_m, E)):
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
    sorted_ids, expert_ids, ntpp, ids = sorted_ids.cpu(), expert_ids.cpu(), ntpp.cpu(), ids.cpu()
    n, flat = T * k, ids.flatten().long()
    total = int(ntpp.item())
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum()) <= sorted_ids.numel()
    real = sorted_ids[sorted_ids != n]
    assert torch.equal(real.sort().values.long(), torch.arange(n))  # every assignment exactly once
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // block_m :] == -1).all()
    assert int((sorted_ids[:total] == n).sum()) == total - n  # the padding
    blocks = sorted_ids[:total].view(-1, block_m).long()
    for b, e in zip(blocks, expert_ids[: total // block_m].tolist()):
        own = b[b != n]
        assert own.numel() > 0 and (flat[own] == e).all()  # the block's expert owns it
    # only experts with assignments get blocks, each in one run (decode touches only the selected experts)
    used = expert_ids[: total // block_m]
    assert set(used.tolist()) == set(flat.tolist())
    assert torch.equal(
        used, torch.unique_consecutive(used).repeat_interleave(((counts[counts > 0] + block_m - 1) // block_m))
    )


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

        cfg = Qwen2MoeConfig(
            hidden_size=H,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=k,
            norm_topk_prob=norm,
        )
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm
        )
    torch.manual_seed(0)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize(
    'arch,norm',
    [('mixtral', True), ('qwen2_moe', False), ('qwen2_moe', True), ('qwen3_moe', True), ('qwen3_moe', False)],
)
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
    if not norm:  # the raw top-k probabilities do not sum to 1: the flag matters
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

REAL = (128, 8, 2048, 768)  # Qwen3-30B-A3B's experts: E, top-k, hidden, moe_intermediate


@cuda
@pytest.mark.parametrize('T', [1, 4, 64, 512, 8192])
def test_fused_moe_qwen3_30b_a3b_shape(T):
    "Qwen3-30B-A3B's experts in bf16 through every path: the tuned row, the decode GEMVs, ACT and SWAP, fresh configs."
    E, k, H, I = REAL
    x, w13, w2, tw, ids = problem(T, E, k, H, I, torch.bfloat16, seed=T)
    ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    err = rel_err(fm.fused_moe(x, w13, w2, tw, ids), ref)
    assert err < TOL[torch.bfloat16], f'max rel error {err:.2e}'
    rows = tuned.load_configs('fused_moe')['default']
    cfgs = [{**rows[b], 'decode': None} for b in (1, 256, 4096)]
    cfgs += [{**rows[b], 'decode': None, 'ACT': 1, 'SWAP': s} for b in (1, 256) for s in (0, 1)]
    cfgs += [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, ACT=1, decode=None)]
    big = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, decode=None)
    cfgs += [
        {**big, **v}
        for v in (
            dict(SORTED=1),
            dict(XSORT=1, ACT=1),
            dict(SORTED=1, XSORT=1, ACT=1, down=dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=3)),
            dict(ATOMIC=1, SORTED=1),
            dict(PERSISTENT=1),
            dict(PERSISTENT=2, ACT=1, SORTED=1),
        )
    ]
    if T <= 64:
        cfgs += [{'decode': d} for d in ({}, dict(BN1=8, BK1=512, BN2=8, BK2=256, SPLIT2=1, W1=8, W2=4))]
    for cfg in cfgs:
        assert rel_err(fm.fused_moe(x, w13, w2, tw, ids, config=cfg), ref) < TOL[torch.bfloat16], cfg


@cuda
@pytest.mark.parametrize('T', [1, 8192])
def test_fused_topk_qwen3_30b_a3b_shape(T):
    "The one-launch router on fp32 and bf16 logits of 128 experts, top-8 renormalized, against the PyTorch ops."
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(T, 128, device='cuda') * 2).to(dtype)
        ref_w, ref_ids = fm.select_experts(logits, 8, True, use_kernel=False)
        w, ids = fm.select_experts(logits, 8, True)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        probs = torch.softmax(logits.float(), -1)  # bf16 logits tie; the picks' probabilities must agree
        torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()), rtol=0, atol=0)
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids)


@cuda
def test_fused_moe_decode_in_cuda_graph():
    "The decode path (router kernel, two GEMVs, split workspace) replays in a CUDA graph on new inputs."
    E, k, H, I = REAL
    x, w13, w2, _, _ = problem(1, E, k, H, I, torch.bfloat16, seed=1)
    logits = torch.randn(1, E, device='cuda')
    cfg = {'decode': dict(SPLIT2=2)}

    def step():
        tw, ids = fm.select_experts(logits, k, True)
        return fm.fused_moe(x, w13, w2, tw, ids, config=cfg)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits) * 2)
        g.replay()
        torch.cuda.synchronize()
        tw, ids = fm.select_experts(logits, k, True, use_kernel=False)
        assert rel_err(out, fm.fused_moe_ref(x, w13, w2, tw, ids)) < TOL[torch.bfloat16]


@cuda
@pytest.mark.parametrize(
    'T,E,k,block_m,skew',
    [
        (256, 128, 8, 32, False),
        (8192, 128, 8, 64, False),
        (8192, 128, 8, 128, False),
        (8192, 128, 8, 128, True),
        (8192, 64, 6, 64, False),
        (8192, 64, 6, 128, True),
        (16384, 128, 8, 128, False),
        (16384, 256, 8, 64, False),
        (3000, 8, 2, 64, True),
    ],
)
def test_moe_align_grid_real_sizes(T, E, k, block_m, skew):
    """The three-launch alignment at a batch-256 decode step and prefill chunks (Qwen3-30B-A3B's 128 experts top-8,
    DeepSeek-V2-Lite's 64 top-6, Mixtral's 8 top-2; 2048 chunks of 64 at 256 experts: the offsets scan loops)
    equals the PyTorch ops exactly; `skew`: every token routed among 2k experts, the others left empty."""
    logits = torch.randn(T, E, device='cuda')
    if skew:
        logits[:, E // 4 : E // 4 + 2 * k] += 100
    ids = logits.topk(k, dim=-1).indices.to(torch.int32)
    for a, b in zip(fm.moe_align_block_size(ids, block_m, E), fm.moe_align_block_size_ref(ids, block_m, E)):
        assert torch.equal(a, b)


@cuda
@pytest.mark.parametrize(
    'T,k,H,dtype',
    [
        (8192, 8, 2048, torch.bfloat16),
        (8191, 8, 2000, torch.bfloat16),
        (4096, 6, 2048, torch.float16),
        (1000, 2, 4096, torch.float32),
        (1, 8, 2048, torch.bfloat16),
    ],
)
def test_moe_sum_real_size(T, k, H, dtype):
    "The top-k sum at one prefill chunk of Qwen3-30B-A3B (and ragged T, H): fp32 accumulation, rounded once."
    from cvllm_lab.kernels.moe_sum import moe_sum

    x = torch.randn(T, k, H, device='cuda').to(dtype)
    out, ref = moe_sum(x), x.float().sum(1).to(dtype)
    assert out.shape == (T, H) and out.dtype == dtype
    torch.testing.assert_close(
        out.float(),
        ref.float(),
        rtol={torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype],
        atol=1e-5,
    )
    same = (out == ref).float().mean().item()  # only the fp32 summation order may differ
    assert same > 0.999, same


@cuda
def test_prefill_bookkeeping_time(capsys):
    """Device time (CUDA graph replays) of the alignment and the top-k sum at one 8192-token chunk of
    Qwen3-30B-A3B, printed (`-s`) with the other launch shapes; `moe_sum` must beat torch's sum over the middle
    axis, and the three alignment launches stay under 60 us."""
    from triton.testing import do_bench_cudagraph
    from cvllm_lab.kernels.fused_moe_align import moe_align_block_size_grid
    from cvllm_lab.kernels.moe_sum import moe_sum

    T, (E, k, H, _) = 8192, REAL
    ids = torch.randn(T, E, device='cuda').topk(k, dim=-1).indices.to(torch.int32)
    us = lambda f: do_bench_cudagraph(f, rep=50) * 1e3
    t_align = us(lambda: fm.moe_align_block_size(ids, 128, E))
    em = fm.moe_align_block_size_ref(ids, 128, E)[0].numel()
    t_align8 = us(lambda: moe_align_block_size_grid(ids.flatten(), em, 128, E, num_warps=8))
    x = torch.randn(T, k, H, device='cuda', dtype=torch.bfloat16)
    gbs = lambda t: (x.numel() + T * H) * 2 / t / 1e3
    t_torch, t_sum = us(lambda: x.sum(1)), us(lambda: moe_sum(x))
    with capsys.disabled():
        print(f'\nalign T={T} E={E} k={k} BLOCK_M=128: {t_align:.1f} us (count and scatter at 8 warps: {t_align8:.1f})')
        print(
            f'top-k sum [{T}, {k}, {H}] bf16: torch {t_torch:.1f} us ({gbs(t_torch):.0f} GB/s), '
            f'moe_sum {t_sum:.1f} us ({gbs(t_sum):.0f} GB/s)'
        )
        for bt, bh, w in [(1, 1024, 4), (1, 2048, 8), (2, 2048, 8), (4, 1024, 8), (4, 512, 4), (8, 256, 4)]:
            t = us(lambda: moe_sum(x, block_t=bt, block_h=bh, num_warps=w))
            print(f'  moe_sum block_t={bt} block_h={bh} num_warps={w}: {t:.1f} us ({gbs(t):.0f} GB/s)')
    assert t_sum < t_torch and t_align < 60, (t_sum, t_torch, t_align)


@cuda
def test_moe_align_time_by_size(monkeypatch, capsys):
    """Device times of the one-program alignment and the three-launch grid at decode batches (Qwen3-30B-A3B, the
    BLOCK_M of each bucket's tuned row), printed (`-s`) to place `ALIGN_ONE_PROGRAM_MAX`; both equal the PyTorch ops."""
    from triton.testing import do_bench_cudagraph

    E, k = REAL[:2]
    with capsys.disabled():
        print()
    for T, bm in [(8, 16), (32, 16), (64, 16), (128, 16), (256, 32), (512, 64), (1024, 64)]:
        ids = torch.randn(T, E, device='cuda').topk(k, dim=-1).indices.to(torch.int32)
        ref, times = fm.moe_align_block_size_ref(ids, bm, E), {}
        for impl, limit in (('one program', 1 << 30), ('grid', 0)):
            monkeypatch.setattr(fm, 'ALIGN_ONE_PROGRAM_MAX', limit)
            assert all(torch.equal(a, b) for a, b in zip(fm.moe_align_block_size(ids, bm, E), ref)), impl
            times[impl] = do_bench_cudagraph(lambda: fm.moe_align_block_size(ids, bm, E), rep=30) * 1e3
        with capsys.disabled():
            print(f'align T={T} (n={T * k}) BLOCK_M={bm}: ' + ', '.join(f'{i} {t:.1f} us' for i, t in times.items()))
