"""KV cache groups of two head shapes (Gemma 4's global layers: their own head size): a shared slot's memory is one
page per block, the largest layer's, and a smaller layer's cache is a strided view of the start of each page
(`bind_kv_cache`, notebook 12). The Triton cache write and paged attention on such a view give what they give on a
plain cache, and the page's other bytes stay as they were (CPU: under the interpreter). On a GPU, a tiny Gemma 4 with
global heads of 32 and sliding heads of 16 through the engine (CUDA graphs, Triton kernels, the FlashAttention prefill
split) against `transformers` (the CPU notebook 36a checks the same through the torch backend)."""

import tempfile
from pathlib import Path

import pytest
import torch

from cvllm_lab.kernels.paged_attention import paged_attention, paged_attention_ref, reshape_and_cache


def _padded(nb, bs, Hkv, D, page, device):
    "A `[2, nb, bs, Hkv, D]` view whose blocks sit `page` values apart (a shared slot's view), and its buffer."
    raw = torch.full((2, nb, page), 7.0, device=device)
    return raw.as_strided((2, nb, bs, Hkv, D), (nb * page, page, Hkv * D, D, 1)), raw


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def test_triton_write_and_attention_on_padded_pages(device):
    if device == 'cuda' and not torch.cuda.is_available():
        pytest.skip('needs a CUDA GPU')
    g = torch.Generator().manual_seed(0)
    nb, bs, Hkv, D, H = 6, 4, 2, 16, 4
    page = bs * 2 * 32  # the slot's largest layer: 2 KV heads of 32
    view, raw = _padded(nb, bs, Hkv, D, page, device)
    plain = torch.zeros(2, nb, bs, Hkv, D, device=device)
    view.zero_()  # the layer's part of each page
    lens = [9, 3]  # a 9-token prompt over blocks 4, 1, 3 and a 3-token one in block 0
    bt = torch.tensor([[4, 1, 3], [0, 0, 0]], dtype=torch.int32, device=device)
    slots = torch.tensor([16, 17, 18, 19, 4, 5, 6, 7, 12, 0, 1, 2], device=device)
    k, v = (torch.randn(12, Hkv, D, generator=g).to(device) for _ in range(2))
    q = torch.randn(12, H, D, generator=g).to(device)
    for c in (view, plain):
        reshape_and_cache(k, v, c[0], c[1], slots)
    assert torch.equal(view, plain)
    assert (raw[:, :, bs * Hkv * D :] == 7.0).all()  # the rest of each page untouched
    qsl = torch.tensor([0, 9, 12], dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (qsl, sl, bt, D**-0.5)
    got = paged_attention(q, view[0], view[1], *args, sliding_window=4, max_query_len=9, max_seq_len=9)
    ref = paged_attention_ref(q, plain[0], plain[1], *args, sliding_window=4)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # decode: one token each over the cached rows
    dq = torch.randn(2, H, D, generator=g).to(device)
    dsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    got = paged_attention(dq, view[0], view[1], dsl, sl, bt, D**-0.5, max_query_len=1, max_seq_len=9)
    ref = paged_attention_ref(dq, plain[0], plain[1], dsl, sl, bt, D**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_gemma4_mixed_heads_gpu():
    from transformers import Gemma4TextConfig, Gemma4ForCausalLM

    from cvllm_lab import LLM, SamplingParams

    rope = {
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 100.0},
        'full_attention': {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1e4},
    }
    types = ['sliding_attention', 'full_attention'] + ['sliding_attention'] * 3 + ['full_attention']
    cfg = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        max_position_embeddings=256,
        sliding_window=4,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        num_hidden_layers=6,
        layer_types=types,
        rope_parameters=rope,
        initializer_range=0.3,
        final_logit_softcapping=5.0,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        architectures=['Gemma4ForCausalLM'],
    )
    cfg._attn_implementation = 'eager'
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    d = Path(tempfile.mkdtemp())
    hf.save_pretrained(d)
    llm = LLM(
        str(d),
        device='cuda',
        dtype='float32',
        attention_backend='triton',
        skip_tokenizer_init=True,
        progress=False,
        block_size=16,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=True,
        max_num_batched_tokens=32,
    )
    groups = llm.engine.runner.kv_cache_groups
    assert [(g.sliding_window, g.layers) for g in groups] == [(None, (1, 5)), (4, (0, 2)), (4, (3, 4))]
    assert not llm.engine.runner.model.attention_layers()[0].kv_cache.is_contiguous()  # half of each page
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 71)]
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)
    outs = llm.generate([{'prompt_token_ids': p} for p in prompts], sp, use_tqdm=False)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            got = torch.tensor([[d_[t].logprob for t in range(256)] for d_ in o.prompt_logprobs[1:]])
            assert (got - ref[:-1]).abs().max() < 1e-3
            gen = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(p) :]
            assert o.outputs[0].token_ids == gen.tolist()
