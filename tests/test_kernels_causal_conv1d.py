"""The causal depthwise conv1d of Gated DeltaNet layers (cvllm_lab.kernels.causal_conv1d) against its reference.

The reference itself is checked against `transformers`' Qwen3-Next `causal_conv1d_fn` (a fresh sequence) and
`causal_conv1d_update` (with a state). CPU: the Triton kernels under TRITON_INTERPRET=1 at small sizes (C=160: two
channel blocks, one partial); varlen prefill with sequences shorter than K-1 and longer than a token tile, decode,
and prefill-then-decode == prefill of one more token. Every check also reads the pool: the sequences' slots hold
their new states, the other slots are unchanged. CUDA (`-m cuda`): Qwen3-Next sizes and a CUDA-graph decode replay.
"""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

from cvllm_lab.kernels.causal_conv1d import PREFILL_BLOCK_T, causal_conv1d, causal_conv1d_ref

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_batch(lens, C, K, dtype, S=10, init=None, bias=True, device=DEV, seed=0):
    """Random varlen batch: x a column slice of a wider tensor (row stride > C), `weight [C, K]`, a random
    pool of S slots, sequence b in a distinct random slot; `init` defaults to every other sequence."""
    g = torch.Generator().manual_seed(seed)
    T, B = sum(lens), len(lens)
    x = torch.randn(T, C + 24, generator=g).to(dtype)
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    b = torch.randn(C, generator=g).to(dtype) if bias else None
    pool = torch.randn(S, C, K - 1, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(lens)).cumsum(0).int()
    slots = torch.randperm(S, generator=g)[:B].int()
    init = torch.tensor([b % 2 == 0 for b in range(B)] if init is None else init, dtype=torch.bool)
    out = [t.to(device) if t is not None else None for t in (x, w, b, qsl, pool, slots, init)]
    out[0] = out[0][:, 8 : 8 + C]  # sliced on the device: `.to` would make a copy contiguous
    return out


def run_both(args, activation='silu', max_query_len=None):
    "Kernel and reference on copies of the pool: (y, pool, y_ref, pool_ref)."
    x, w, b, qsl, pool, slots, init = args
    p1, p2 = pool.clone(), pool.clone()
    y = causal_conv1d(x, w, b, qsl, p1, slots, init, activation=activation, max_query_len=max_query_len)
    y_ref = causal_conv1d_ref(x, w, b, qsl, p2, slots, init, activation=activation)
    return y, p1, y_ref, p2


def check(args, y, p, y_ref, p_ref, dtype):
    pool, slots = args[4], args[5]
    assert y.dtype == args[0].dtype and y.shape == args[0].shape
    torch.testing.assert_close(y.float(), y_ref.float(), **TOL[dtype])
    # the state is copied, never computed: exact
    torch.testing.assert_close(p, p_ref, atol=0, rtol=0)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[slots[slots >= 0].long()] = False
    assert torch.equal(p[untouched], pool[untouched])
    return (y.float() - y_ref.float()).abs().max().item()


# ------------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize('L', [1, 2, 5, 13])
@pytest.mark.parametrize('activation', ['silu', None])
def test_ref_vs_transformers_fresh(L, activation):
    "A fresh sequence: `causal_conv1d_fn` (zero left padding); the state becomes its last K-1 inputs."
    C, K = 24, 4
    x, w, b, qsl, pool, slots, init = make_batch([L], C, K, torch.float32, init=[False], device='cpu', seed=L)
    y = causal_conv1d_ref(x, w, b, qsl, pool, slots, init, activation=activation)
    y_hf = causal_conv1d_fn(x.T[None].contiguous(), w, b, activation=activation)[0].T
    torch.testing.assert_close(y, y_hf, atol=1e-6, rtol=1e-6)
    expect = torch.cat([torch.zeros(C, K - 1), x.T], 1)[:, -(K - 1) :]
    torch.testing.assert_close(pool[int(slots[0])], expect, atol=0, rtol=0)


@pytest.mark.parametrize('L', [1, 2, 5])
@pytest.mark.parametrize('activation', ['silu', None])
def test_ref_vs_transformers_update(L, activation):
    "A sequence with a state: `causal_conv1d_update` (state ++ inputs; the state rolled in place)."
    C, K = 24, 4
    x, w, b, qsl, pool, slots, init = make_batch([L], C, K, torch.float32, init=[True], device='cpu', seed=10 + L)
    slot = int(slots[0])
    state = pool[slot : slot + 1].clone()
    y_hf = causal_conv1d_update(x.T[None].contiguous(), state, w, b, activation=activation)[0].T
    y = causal_conv1d_ref(x, w, b, qsl, pool, slots, init, activation=activation)
    torch.testing.assert_close(y, y_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[slot], state[0], atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ kernels (interpreter)

LENS = [1, 2, 3, 7, 40]  # shorter than K-1, equal, longer, and across a token tile


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize('activation', ['silu', None])
@pytest.mark.parametrize('bias', [True, False])
def test_prefill_vs_ref(dtype, activation, bias):
    assert max(LENS) > PREFILL_BLOCK_T  # the long sequence spans two tiles
    args = make_batch(LENS, 160, 4, dtype, init=[True, False, True, True, False], bias=bias, seed=1)
    y, p, y_ref, p_ref = run_both(args, activation)
    err = check(args, y, p, y_ref, p_ref, dtype)
    print(f'prefill {dtype} {activation} bias={bias}: max |err| {err:.3g}')


@pytest.mark.interp
@pytest.mark.parametrize('K', [2, 3, 4])
def test_prefill_kernel_widths(K):
    "Other widths (the state is K-1 wide, STATE_P its power of 2), sequences around K-1 long."
    args = make_batch([1, 2, 3, 4, 35], 40, K, torch.float32, init=[True, True, False, True, True], seed=2)
    check(args, *run_both(args), torch.float32)


@pytest.mark.interp
@pytest.mark.parametrize('max_query_len', [None, 3])
def test_padding_entries(max_query_len):
    "Zero-length sequences (graph padding) and negative slots: nothing read or written for them."
    args = make_batch([3, 0, 2, 1], 40, 4, torch.float32, init=[True, True, True, True], seed=3)
    args[5][2] = -1  # a negative slot: zeros for the state, no write
    check(args, *run_both(args, max_query_len=max_query_len), torch.float32)


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('max_query_len', [1, None])
def test_decode_vs_ref(dtype, max_query_len):
    "One token per sequence (the update kernel; None finds the bound itself), with padding entries."
    lens = [1, 1, 0, 1, 1, 1]
    args = make_batch(lens, 300, 4, dtype, init=[True, False, True, True, True, True], seed=4)
    args[5][4] = -1
    y, p, y_ref, p_ref = run_both(args, max_query_len=max_query_len)
    err = check(args, y, p, y_ref, p_ref, dtype)
    print(f'decode {dtype}: max |err| {err:.3g}')


@pytest.mark.interp
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_prefill_then_decode(dtype):
    "Prefill N tokens then decode token N+1 == prefill N+1 tokens (its last output row and the state)."
    lens = [1, 2, 3, 9, 36]
    C, K = 160, 4
    x_all, w, b, _, pool, slots, init = make_batch([n + 1 for n in lens], C, K, dtype, seed=5)
    qsl_all = torch.tensor([0] + [n + 1 for n in lens], device=x_all.device).cumsum(0).int()
    fresh = torch.zeros_like(init)
    # the whole N+1 tokens at once
    pa = pool.clone()
    y_all = causal_conv1d(x_all, w, b, qsl_all, pa, slots, fresh)
    # N tokens, then the last one alone
    last = qsl_all[1:].long() - 1
    keep = torch.ones(x_all.shape[0], dtype=torch.bool, device=x_all.device)
    keep[last] = False
    pb = pool.clone()
    causal_conv1d(x_all[keep], w, b, torch.tensor([0] + lens, device=x_all.device).cumsum(0).int(), pb, slots, fresh)
    qsl_one = torch.arange(len(lens) + 1, device=x_all.device).int()
    y_one = causal_conv1d(x_all[last], w, b, qsl_one, pb, slots, ~fresh, max_query_len=1)
    torch.testing.assert_close(y_one.float(), y_all[last].float(), **TOL[dtype])
    torch.testing.assert_close(pb, pa, atol=0, rtol=0)
    print(f'prefill-then-decode {dtype}: max |err| {(y_one.float() - y_all[last].float()).abs().max().item():.3g}')


# ------------------------------------------------------------------------------------------------ CUDA, real sizes


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_real_sizes(dtype):
    "Qwen3-Next's conv (C = 2*2048 + 4096 per rank at TP 1, K=4): long prefill, chunks and decodes in one batch."
    lens = [4096, 1, 700, 2, 1, 2000, 3]
    args = make_batch(lens, 8192, 4, dtype, S=64, init=[False, True, True, True, True, True, False], seed=6)
    check(args, *run_both(args), dtype)
    lens = [1] * 64
    args = make_batch(lens, 8192, 4, dtype, S=256, init=[True] * 64, seed=7)
    check(args, *run_both(args, max_query_len=1), dtype)


@pytest.mark.cuda
def test_cuda_graph_decode_replay():
    "Capture decode with max_query_len=1; replay with new tokens and slots written into the inputs."
    B, C, K, S = 16, 8192, 4, 64
    x, w, b, qsl, pool, slots, init = make_batch([1] * B, C, K, torch.bfloat16, S=S, init=[True] * B, seed=8)
    run = lambda: causal_conv1d(x, w, b, qsl, pool, slots, init, max_query_len=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        slots.copy_(torch.randperm(S, device=DEV)[:B].int())
        ref_pool = pool.clone()
        y_ref = causal_conv1d_ref(x, w, b, qsl, ref_pool, slots, init)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), y_ref.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)
