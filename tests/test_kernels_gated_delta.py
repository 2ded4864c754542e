"""Gated DeltaNet kernels (cvllm_lab.kernels.gated_delta_rule, gated_delta_chunk) against their PyTorch reference.

The reference itself against transformers' `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule`
(Qwen3-Next) on one sequence. CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes (Dk, Dv of 32 / 64,
a few heads): the chunked path on varlen batches (lengths around the 64-token chunk, mixed initial states, final
states in their slots, other slots untouched), the recurrent path on decode batches, and prefill-then-decode
against a longer prefill. CUDA (`-m cuda`): Qwen3-Next sizes (16 key heads, 32 value heads, Dk = Dv = 128) and
a CUDA-graph replay of both paths.
"""

import pytest
import torch

from cvllm_lab.kernels import gated_delta_rule as gdr

gated_delta_rule, gated_delta_rule_ref = gdr.gated_delta_rule, gdr.gated_delta_rule_ref

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'

# outputs and states are O(1) (normalized q, k; |v| ~ 1): absolute and relative tolerances alike
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
STATE_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: TOL[torch.float16],
    torch.bfloat16: TOL[torch.bfloat16],
}


def make_batch(lens, Hk=2, Hv=4, Dk=32, Dv=32, dtype=torch.float32, slots=None, init=None, pool=None, device=DEV):
    """Random varlen batch: q, k, v in `dtype` (strided views of one packed projection, as the model's split gives),
    g = minus a uniform draw times a per-head rate in [1e-3, 1], beta in (0, 1) (bf16 as the model's sigmoid gives it), a random state pool of
    `pool` slots with sequence b in slot `slots[b]` (default: distinct random slots), `init[b]` whether it is read."""
    B, T = len(lens), sum(lens)
    pool = pool or B + 3
    qkv = torch.randn(T, 2 * Hk * Dk + Hv * Dv, device=device).to(dtype)
    q = qkv[:, : Hk * Dk].view(T, Hk, Dk)
    k = qkv[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
    v = qkv[:, 2 * Hk * Dk :].view(T, Hv, Dv)
    # per-head decay rates from 1e-3 (state kept over the whole batch: exercises the chunk-to-chunk state) to 1
    g = -torch.rand(T, Hv, device=device) * torch.logspace(-3, 0, Hv, device=device)
    beta = torch.rand(T, Hv, device=device).to(torch.bfloat16)
    qsl = torch.tensor([0] + list(lens), device=device).cumsum(0).int()
    state = torch.randn(pool, Hv, Dk, Dv, device=device) * 0.3
    slots = torch.randperm(pool)[:B] if slots is None else torch.tensor(slots)
    init = torch.rand(B) < 0.5 if init is None else torch.tensor(init)
    return q, k, v, g, beta, qsl, state, slots.int().to(device), init.to(device)


def run_both(args, **kw):
    "The kernel and the reference on copies of the pool: (out, state, out_ref, state_ref)."
    q, k, v, g, beta, qsl, state, slots, init = args
    s1, s2 = state.clone(), state.clone()
    out = gated_delta_rule(q, k, v, g, beta, qsl, s1, slots, init, **kw)
    ref = gated_delta_rule_ref(q, k, v, g, beta, qsl, s2, slots, init, **kw)
    return out, s1, ref, s2


def check(out, s, ref, s_ref, state0, slots, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    # and against the outputs' scale (small where Dk is large: q is scaled by Dk ** -0.5)
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype]['rtol'] * ref.float().abs().max()
    torch.testing.assert_close(s, s_ref, **STATE_TOL[dtype])
    named = torch.zeros(state0.shape[0], dtype=torch.bool)
    named[slots[slots >= 0].long().cpu()] = True
    assert torch.equal(s[~named.to(s.device)], state0[~named.to(s.device)])  # slots not named: untouched
    return (out.float() - ref.float()).abs().max().item(), (s - s_ref).abs().max().item()


# ------------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize('with_init', [False, True])
def test_reference_matches_transformers(with_init):
    "One sequence, GQA (Hv = 2 Hk): the reference equals transformers' recurrent form and its chunked form in fp32."
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    torch.manual_seed(1 + with_init)
    n, Hk, Hv, Dk, Dv = 100, 2, 4, 32, 16
    q, k, v, g, beta, qsl, state, slots, init = make_batch(
        [n], Hk, Hv, Dk, Dv, slots=[1], init=[with_init], device='cpu'
    )
    h0 = state[1:2].clone() if with_init else None
    st = state.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, qsl, st, slots, init)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    args = (q[None], k[None], v[None], g[None], beta[None])
    o_rec, s_rec = qn.torch_recurrent_gated_delta_rule(*args, **kw)
    o_chk, s_chk = qn.torch_chunk_gated_delta_rule(*args, chunk_size=64, **kw)
    torch.testing.assert_close(out, o_rec[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(st[1], s_rec[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, o_chk[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st[1], s_chk[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(st[[0, 2, 3]], state[[0, 2, 3]])


# ------------------------------------------------------------------------------------------------ chunked (prefill)


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
def test_chunked_varlen(dtype):
    "Lengths 1, 5, 64, 70, 130 in one batch, mixed initial states: outputs and final states in their slots."
    torch.manual_seed(10)
    args = make_batch([1, 5, 64, 70, 130], dtype=dtype, init=[True, False, True, False, True])
    out, s, ref, s_ref = run_both(args)
    errs = check(out, s, ref, s_ref, args[6], args[7], dtype)
    print(f'{dtype}: max |out - ref| {errs[0]:.2e}, max |state - ref| {errs[1]:.2e}')


@pytest.mark.interp
def test_chunked_shapes_and_padding():
    "Dk != Dv (64 / 32), Hv = 4 Hk, a custom scale, a zero-length sequence and a padding entry (slot -1)."
    torch.manual_seed(11)
    args = make_batch([40, 0, 65, 3], Hk=1, Hv=4, Dk=64, Dv=32, slots=[2, 0, 5, -1], init=[True, True, False, True])
    out, s, ref, s_ref = run_both(args, scale=0.1)
    check(out, s, ref, s_ref, args[6], args[7], torch.float32)
    assert torch.equal(s[0], args[6][0])  # zero tokens from an initial state: the state as it was


@pytest.mark.interp
def test_chunked_without_l2norm():
    "use_qk_l2norm=False: q, k used as given (small keys, so that the delta rule stays contractive)."
    torch.manual_seed(12)
    q, k, v, g, beta, qsl, state, slots, init = make_batch([70, 9], init=[True, False])
    args = (q * 0.15, k * 0.15, v, g, beta, qsl, state, slots, init)
    out, s, ref, s_ref = run_both(args, use_qk_l2norm=False)
    check(out, s, ref, s_ref, state, slots, torch.float32)


# ------------------------------------------------------------------------------------------------ recurrent (decode)


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_recurrent_decode(dtype):
    "A decode batch (one token per sequence, mixed initial states): with and without the host-side bound."
    torch.manual_seed(20)
    args = make_batch([1] * 6, Hk=2, Hv=4, Dk=64, Dv=64, dtype=dtype, pool=9)
    for kw in ({}, {'max_query_len': 1}):
        out, s, ref, s_ref = run_both(args, **kw)
        errs = check(out, s, ref, s_ref, args[6], args[7], dtype)
    print(f'{dtype}: max |out - ref| {errs[0]:.2e}, max |state - ref| {errs[1]:.2e}')


@pytest.mark.interp
def test_recurrent_multi_token(monkeypatch):
    "The recurrent kernel over short multi-token queries (and a zero-length one) when the bound admits them."
    monkeypatch.setattr(gdr, 'RECURRENT_MAX_QUERY_LEN', 4)
    calls = []
    monkeypatch.setattr(gdr, 'chunk_gated_delta_rule', lambda *a: calls.append(a))
    torch.manual_seed(21)
    args = make_batch([3, 1, 0, 4, 2], init=[True, False, True, True, False])
    out, s, ref, s_ref = run_both(args, max_query_len=4)
    assert not calls  # the recurrent kernel did it
    check(out, s, ref, s_ref, args[6], args[7], torch.float32)


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_prefill_then_decode(dtype):
    "Prefill of N tokens (chunked) then decode of token N+1 (recurrent) == prefill of N+1 tokens: row and state."
    torch.manual_seed(30)
    lens = [63, 64, 70]
    q, k, v, g, beta, qsl, state, slots, init = make_batch([n + 1 for n in lens], dtype=dtype, init=[True, False, True])
    last = qsl[1:].long() - 1  # each sequence's token N+1
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    keep[last] = False
    s_two = state.clone()
    qsl_n = torch.tensor([0] + lens, device=q.device).cumsum(0).int()
    gated_delta_rule(q[keep], k[keep], v[keep], g[keep], beta[keep], qsl_n, s_two, slots, init)
    qsl_1 = torch.arange(len(lens) + 1, device=q.device).int()
    ones = torch.ones(len(lens), dtype=torch.bool, device=q.device)
    dec = gated_delta_rule(q[last], k[last], v[last], g[last], beta[last], qsl_1, s_two, slots, ones, max_query_len=1)
    s_one = state.clone()
    full = gated_delta_rule(q, k, v, g, beta, qsl, s_one, slots, init)
    torch.testing.assert_close(dec.float(), full[last].float(), **TOL[dtype])
    torch.testing.assert_close(s_two, s_one, **STATE_TOL[dtype])


# ------------------------------------------------------------------------------------------------ CUDA, real sizes


QWEN3_NEXT = dict(Hk=16, Hv=32, Dk=128, Dv=128)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_chunked_real_sizes(dtype):
    torch.manual_seed(40)
    lens = [1, 17, 64, 300, 1000, 2049]
    args = make_batch(lens, dtype=dtype, init=[True, False, True, False, True, True], **QWEN3_NEXT)
    out, s, ref, s_ref = run_both(args)
    errs = check(out, s, ref, s_ref, args[6], args[7], dtype)
    print(f'{dtype}: max |out - ref| {errs[0]:.2e}, max |state - ref| {errs[1]:.2e}')


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_cuda_recurrent_real_sizes(dtype):
    torch.manual_seed(41)
    args = make_batch([1] * 64, dtype=dtype, pool=100, **QWEN3_NEXT)
    out, s, ref, s_ref = run_both(args, max_query_len=1)
    errs = check(out, s, ref, s_ref, args[6], args[7], dtype)
    print(f'{dtype}: max |out - ref| {errs[0]:.2e}, max |state - ref| {errs[1]:.2e}')


@pytest.mark.cuda
@pytest.mark.parametrize('lens', [[1] * 32, [5, 64, 200]])
def test_cuda_graph_replay(lens):
    "Both paths captured in a CUDA graph (no host sync) and replayed on new inputs equal eager calls."
    torch.manual_seed(42)
    args = make_batch(lens, dtype=torch.bfloat16, **QWEN3_NEXT)
    q, k, v, g, beta, qsl, state, slots, init = args
    bound = max(lens)
    s_graph = state.clone()
    gated_delta_rule(q, k, v, g, beta, qsl, s_graph.clone(), slots, init, max_query_len=bound)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_rule(q, k, v, g, beta, qsl, s_graph, slots, init, max_query_len=bound)
    new = make_batch(lens, dtype=torch.bfloat16, **QWEN3_NEXT)
    for dst, src in zip((q, k, v, g, beta, qsl, s_graph, slots, init), new):
        dst.copy_(src)
    graph.replay()
    s_eager = new[6].clone()
    eager = gated_delta_rule(*new[:6], s_eager, *new[7:], max_query_len=bound)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    torch.testing.assert_close(s_graph, s_eager, atol=0, rtol=0)
