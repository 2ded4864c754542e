"""The attention layer's prefill split (nbs/22_attention) at real sizes on a GPU: prefill rows with or without a
cached prefix on FlashAttention-2 varlen over K/V gathered from the paged cache, decode rows on the paged kernel.

Eight prefill sequences with 0..3000 cached tokens and chunks of 512-2048 (two of them sharing their prefix blocks,
as a prefix-cache hit does), after three decode rows, 32 query heads over 4 or 8 KV heads of 128, bf16, with and
without a 1024-token window: the split's output against `varlen_attention_ref` (fp32 softmax over each sequence's
whole K/V) and against the paged kernel alone. The CPU tests of the same path (the reference in FlashAttention's
place) are in the notebooks 22 and 50. `python -m benchmarks.kernels.bench_prefill_attention` times it.
"""

import pytest
import torch

from cvllm_lab.layers.attention import Attention, flash_varlen_attention, varlen_attention_ref
from cvllm_lab.utils.context import DecodeSplit, ForwardContext, PrefillMetadata, set_forward_context

pytestmark = pytest.mark.cuda

PREFIXES = [0, 3000, 17, 1024, 2500, 0, 511, 3000]  # cached tokens before the step; sequences 1 and 7 share blocks
CHUNKS = [512, 2048, 700, 1536, 512, 2048, 1024, 999]
DECODES = [4000, 1, 2047]  # tokens cached before each decode row
H, D, BS = 32, 128, 16
TOL = dict(atol=2e-2, rtol=2e-2)


def cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32, device='cuda').cumsum(0).int()


@pytest.mark.parametrize('Hkv', [4, 8])
@pytest.mark.parametrize('window', [None, 1024])
def test_flash_varlen_equals_reference(Hkv, window):
    "The kernel alone on contiguous K/V: chunks over prefixes (more keys than queries), the mask aligned bottom-right."
    torch.manual_seed(0)
    lk = [p + c for p, c in zip(PREFIXES, CHUNKS)]
    q = torch.randn(sum(CHUNKS), H, D, device='cuda', dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lk), Hkv, D, device='cuda', dtype=torch.bfloat16) for _ in range(2))
    args = (cu(CHUNKS), cu(lk), max(CHUNKS), max(lk), D**-0.5, window)
    got, ref = flash_varlen_attention(q, k, v, *args), varlen_attention_ref(q, k, v, *args)
    torch.testing.assert_close(got.float(), ref.float(), **TOL)


def mixed_step(Hkv, window, prefixes=PREFIXES, chunks=CHUNKS):
    "Decodes then prefills over one shuffled paged cache: the layer, the step's inputs, and each sequence's whole K/V."
    torch.manual_seed(1)
    ctx_lens, q_lens = DECODES + prefixes, [1] * len(DECODES) + chunks
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblk = [-(-s // BS) for s in seq_lens]
    perm = torch.randperm(sum(nblk) + 1, device='cuda').int()
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device='cuda')
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[sum(nblk[:i]) : sum(nblk[:i]) + n]
    a, b = len(DECODES) + 1, len(DECODES) + 7  # b's prefix is a's: the same K/V in the same full blocks
    full = [[torch.randn(s, Hkv, D, device='cuda', dtype=torch.bfloat16) for s in seq_lens] for _ in range(2)]
    for kv in full:
        kv[b][: prefixes[7]] = kv[a][: prefixes[7]]
    bt[b, : prefixes[7] // BS] = bt[a, : prefixes[7] // BS]
    att = Attention(H, D, D**-0.5, Hkv, sliding_window=window, backend='triton')
    att.kv_cache = torch.zeros(2, len(perm), BS, Hkv, D, device='cuda', dtype=torch.bfloat16)
    slot = lambda i, pos: bt[i, pos // BS].long() * BS + pos % BS
    for i, c in enumerate(ctx_lens):  # the cached prefixes
        pos = torch.arange(c, device='cuda')
        for j in range(2):
            att.kv_cache[j].view(-1, Hkv, D)[slot(i, pos)] = full[j][i][:c]
    new = [torch.arange(c, s, device='cuda') for c, s in zip(ctx_lens, seq_lens)]
    q = torch.randn(sum(q_lens), H, D, device='cuda', dtype=torch.bfloat16)
    k, v = (torch.cat([x[i][c:] for i, c in enumerate(ctx_lens)]) for x in full)
    qsl = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    ctx = ForwardContext(
        torch.cat([slot(i, p) for i, p in enumerate(new)]),
        cu(q_lens),
        torch.tensor(seq_lens, dtype=torch.int32, device='cuda'),
        bt,
        max(q_lens),
        max(seq_lens),
    )
    ctx.prefill = PrefillMetadata.build(qsl, seq_lens, len(DECODES), 'cuda')
    ctx.prefill.fresh = not any(prefixes)
    return att, ctx, q, k, v, full, q_lens, seq_lens


@pytest.mark.parametrize('Hkv', [4, 8])
@pytest.mark.parametrize('window', [None, 1024])
def test_layer_split_equals_reference_and_paged(Hkv, window):
    att, ctx, q, k, v, full, q_lens, seq_lens = mixed_step(Hkv, window)
    assert att.prefill_fn is flash_varlen_attention and att._prefill_split_ok(q, att.kv_cache[0])
    calls = []

    def spy(*a):
        calls.append(a[3:7])
        return flash_varlen_attention(*a)

    outs = {}
    for name, fn in (('split', spy), ('paged', None)):
        att.prefill_fn = fn
        with set_forward_context(ctx):
            outs[name] = att(q.flatten(1), k.flatten(1), v.flatten(1)).view_as(q)
    ((cq, ck, mq, mk),) = calls  # one FlashAttention call, for the 8 prefills
    first = [0 if window is None else max(0, p - window + 1) for p in PREFIXES]
    assert ck.tolist() == [0] + torch.tensor([p + c - f for p, c, f in zip(PREFIXES, CHUNKS, first)]).cumsum(0).tolist()
    assert (cq.tolist(), mq) == ([0] + torch.tensor(CHUNKS).cumsum(0).tolist(), max(CHUNKS))
    ref = varlen_attention_ref(
        q, torch.cat(full[0]), torch.cat(full[1]), cu(q_lens), cu(seq_lens), max(q_lens), max(seq_lens), D**-0.5, window
    )
    torch.testing.assert_close(outs['split'].float(), ref.float(), **TOL)
    torch.testing.assert_close(outs['split'].float(), outs['paged'].float(), **TOL)
    err = lambda o: (o.float() - ref.float()).norm() / ref.float().norm()
    assert err(outs['split']) <= 1.5 * err(outs['paged']) + 1e-3, (err(outs['split']), err(outs['paged']))


@pytest.mark.parametrize('window', [None, 1024])
def test_decodes_apart_from_a_chunk_in_the_head(window):
    """The first prefill left before the run (as the run's key bound leaves a chunk out), or every row on the paged
    kernel: with `DecodeSplit` the three decodes take a paged call of their own on the decode path, the chunk another;
    the output against the reference and against one paged call for the head."""
    att, ctx, q, k, v, full, q_lens, seq_lens = mixed_step(8, window)
    qsl, n = [0] + torch.tensor(q_lens).cumsum(0).tolist(), len(DECODES)
    ref = varlen_attention_ref(
        q, torch.cat(full[0]), torch.cat(full[1]), cu(q_lens), cu(seq_lens), max(q_lens), max(seq_lens), D**-0.5, window
    )
    paged, calls = att._attn_fn, []

    def spy(q, *a, max_query_len=None, **kw):  # (sequences, max_query_len) of each paged call
        calls.append((a[3].shape[0], max_query_len))
        return paged(q, *a, max_query_len=max_query_len, **kw)

    att._attn_fn = spy
    for start in (n + 1, None):  # the run from the second prefill on; no run
        ctx.prefill = None if start is None else PrefillMetadata.build(qsl, seq_lens, start, 'cuda')
        outs = {}
        for name in ('apart', 'one call'):
            ctx.decodes = DecodeSplit.build(qsl, seq_lens, 'cuda') if name == 'apart' else None
            calls.clear()
            with set_forward_context(ctx):
                outs[name] = att(q.flatten(1), k.flatten(1), v.flatten(1)).view_as(q)
            heads = n + 1 if start else len(seq_lens)
            assert calls == (
                [(n, 1), (heads - n, max(q_lens[n:heads]))] if name == 'apart' else [(heads, max(q_lens[:heads]))]
            )
        torch.testing.assert_close(outs['apart'].float(), ref.float(), **TOL)
        torch.testing.assert_close(outs['apart'].float(), outs['one call'].float(), **TOL)


def test_engine_split_on_equals_off():
    """A tiny bf16 Llama through `LLM` with chunked prefill (256 tokens a step) and prefix caching (a shared 512-token
    prefix): the split on (later chunks and prefix-cache hits on FlashAttention) and off (`prefill_fn` None, as with
    CVLLM_LAB_FLASH_PREFILL=0) give the same first greedy tokens and prompt log-probs within bf16 noise."""
    import tempfile
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab import LLM, SamplingParams

    torch.manual_seed(0)
    d = tempfile.mkdtemp()
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            architectures=['LlamaForCausalLM'],
        )
    ).save_pretrained(d)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()
    prefix = rand(512)
    rounds = [[prefix + rand(300), rand(700)], [prefix + rand(400), prefix + rand(150), rand(900)]]
    calls, outs = [], {}

    def spy(q, k, v, cu_q, cu_k, *a):
        calls.append(cu_q.tolist() != cu_k.tolist())
        return flash_varlen_attention(q, k, v, cu_q, cu_k, *a)

    for fn in (None, spy):
        llm = LLM(
            d,
            progress=False,
            device='cuda',
            dtype='bfloat16',
            skip_tokenizer_init=True,
            block_size=16,
            kv_cache_memory=256 << 20,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            enable_prefix_caching=True,
        )
        for a in llm.engine.runner.model.attention_layers():
            a.prefill_fn = fn
        outs[fn] = [
            o
            for ps in rounds
            for o in llm.generate(
                [{'prompt_token_ids': p} for p in ps],
                [
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0 if i % 2 else None)
                    for i in range(len(ps))
                ],
                use_tqdm=False,
            )
        ]
        del llm
    assert any(calls) and any(o.num_cached_tokens for o in outs[spy])
    for a, b in zip(outs[None], outs[spy]):
        assert (
            a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        )  # later tokens may flip on bf16 near-ties of a random model
        if a.prompt_logprobs is not None:
            la, lb = ([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in (a, b))
            assert max(abs(x - y) for x, y in zip(la, lb)) < 0.05


@pytest.mark.parametrize('n,L', [(8, 1024), (1, 4096), (3, 600)])
def test_cudnn_equal_fresh_prompts(n, L):
    "Equal-length fresh prompts on cuDNN's fused attention (`cudnn_prefill_attention`) = FlashAttention-2 = the reference."
    from cvllm_lab.layers.attention import cudnn_attention_available, cudnn_prefill_attention

    q = torch.randn(n * L, H, D, device='cuda', dtype=torch.bfloat16)
    k, v = (torch.randn(n * L, 8, D, device='cuda', dtype=torch.bfloat16) for _ in range(2))
    if not cudnn_attention_available(q):
        pytest.skip('cuDNN fused attention needs sm90 and cuDNN 9')
    c = cu([L] * n)
    got = cudnn_prefill_attention(q, k, v, n, D**-0.5).float()
    torch.testing.assert_close(got, varlen_attention_ref(q, k, v, c, c, L, L, D**-0.5).float(), **TOL)
    torch.testing.assert_close(got, flash_varlen_attention(q, k, v, c, c, L, L, D**-0.5).float(), **TOL)


def test_cudnn_equal_prompts_then_a_shorter_one():
    """A chunked prefill's usual step: decode rows, then seven fresh 1024-token prompts and an eighth the token budget
    cut to 1016: from the shape's third step on cuDNN takes the seven in one call, FlashAttention-2 the last
    (`dense_prefill_split`); the layer's output equals the reference on both paths."""
    from cvllm_lab.layers import attention as A

    chunks = [1024] * 7 + [1016]
    att, ctx, q, k, v, full, q_lens, seq_lens = mixed_step(8, None, [0] * 8, chunks)
    if not A.cudnn_attention_available(q):
        pytest.skip('cuDNN fused attention needs sm90 and cuDNN 9')
    calls, orig = [], A.cudnn_prefill_attention
    A.cudnn_prefill_attention = lambda *a: calls.append(a[3]) or orig(*a)
    ref = varlen_attention_ref(
        q, torch.cat(full[0]), torch.cat(full[1]), cu(q_lens), cu(seq_lens), max(q_lens), max(seq_lens), D**-0.5
    )
    A.cudnn_shape_steps.pop((1024, 7), None)
    try:  # the shape's first two steps on FlashAttention-2, the third on cuDNN (`cudnn_shape_ready`)
        for step in range(A.CUDNN_PLAN_AFTER):
            ctx.prefill.memo.clear()  # a new step of the same shape
            with set_forward_context(ctx):
                out = att(q.flatten(1), k.flatten(1), v.flatten(1)).view_as(q)
            assert calls == ([7] if step == A.CUDNN_PLAN_AFTER - 1 else []), (step, calls)
            torch.testing.assert_close(out.float(), ref.float(), **TOL)
    finally:
        A.cudnn_prefill_attention = orig
