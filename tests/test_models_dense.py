"""Phi-3/4, StableLM and GLM-4 on the Triton path, which the notebooks (torch backend on CPU) don't run: partial
rotary, GPT-J pairs and LongRoPE caches go through the fused `rotary_and_cache` kernel and Triton paged attention.

CPU (`interp`): the kernels under the Triton interpreter, one forward of a flat paged batch against `transformers`.
CUDA (`-m cuda`): the engine (Triton attention, rotary and norms, CUDA graphs, chunked prefill) against
`transformers` on the GPU in fp32 at a mid-size shape, LongRoPE with both its short and its long factors."""

import tempfile
from pathlib import Path

import pytest
import torch


def _hf_model(
    arch: str, hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=256, orig=32, max_pos=128, seed=0
):
    "A random HF model of family `arch` with the family's distinctive features on (norms and biases randomised)."
    import transformers as T

    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    g = torch.Generator().manual_seed(seed + 1)
    if (
        arch == 'phi3'
    ):  # the Phi-4-mini shape: partial rotary 0.75, LongRoPE, tied embeddings (head_dim = hidden / heads)
        half = int(hidden // heads * 0.75) // 2
        cfg = T.Phi3Config(
            **base,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=orig,
            tie_word_embeddings=True,
            rope_scaling={
                'rope_type': 'longrope',
                'short_factor': (1 + torch.rand(half, generator=g)).tolist(),
                'long_factor': (1 + 8 * torch.rand(half, generator=g)).tolist(),
            },
        )
        cls = T.Phi3ForCausalLM
    elif arch == 'stablelm':  # the 12B shape: q/k LayerNorm per head, parallel residual, QKV bias, partial rotary 0.25
        cfg = T.StableLmConfig(**base, qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True)
        cls = T.StableLmForCausalLM
    else:  # GLM-4: GPT-J pairs on half of each head, QKV bias, post-sublayer norms
        cfg = T.Glm4Config(**base, head_dim=head_dim)
        cls = T.Glm4ForCausalLM
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.5)
            elif 'norm' in n:
                p.normal_(1, 0.5)
    return hf


@pytest.mark.interp
@pytest.mark.parametrize('arch', ['phi3', 'stablelm', 'glm4'])
def test_triton_backend_matches_transformers(arch):
    "Our model with attention_backend='triton' (fused rotary + cache write, Triton attention) equals HF's logits."
    from cvllm_lab.models.llama import compare_with_hf
    from cvllm_lab.models.registry import get_model_class

    hf = _hf_model(arch)
    ours = get_model_class(hf.config)(hf.config, 128, 'triton')
    ours.load_weights(hf.state_dict().items())
    assert ours.model.layers[0].self_attn.attn.backend == 'triton'
    lens = (
        (33, 40, 47) if arch == 'phi3' else (5, 17, 40)
    )  # phi3: engine length 128 > 32 -> long factors, as HF past 32
    assert compare_with_hf(hf, ours, lens=lens) < 1e-4


def engine_check(arch, device, lens, max_model_len, n_gen=8, tol=2e-3, **shape):
    "Prompt log-probs (top 5) within `tol` and `n_gen` greedy tokens equal to HF on `device`, through the engine."
    from cvllm_lab import LLM, SamplingParams

    hf = _hf_model(arch, **shape)
    d = Path(tempfile.mkdtemp())
    hf.save_pretrained(d)
    hf = hf.to(device)
    llm = LLM(
        str(d),
        progress=False,
        device=device,
        dtype='float32',
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        kv_cache_memory=256 << 20,
        block_size=16,
        prefill_chunk_size=64,
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    V, g = hf.config.vocab_size, torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=n_gen, ignore_eos=True, prompt_logprobs=5),
        use_tqdm=False,
    )
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p], device=device)).logits[0].float(), -1).cpu()
            err = max(
                abs(lp.logprob - ref[i, t].item())
                for i, dct in enumerate(o.prompt_logprobs[1:])
                for t, lp in dct.items()
            )
            assert err < tol, (arch, len(p), err)
            gen = hf.generate(
                torch.tensor([p], device=device), max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False
            )
            assert o.outputs[0].token_ids == gen[0, len(p) :].tolist(), (arch, len(p))


MID = dict(hidden=512, heads=8, kv_heads=2, head_dim=128, layers=4, vocab=1024, orig=512, max_pos=4096)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize(
    'arch,lens,max_model_len',
    [
        ('phi3', (7, 100, 300, 480), 512),  # LongRoPE short factors: the engine length is the original length
        ('phi3', (600, 1500, 2900), 4096),  # long factors: every prompt is past the original length, as in HF
        ('stablelm', (7, 100, 333, 1500), 4096),
        ('glm4', (7, 100, 333, 1500), 4096),
    ],
)
def test_engine_cuda_matches_transformers(arch, lens, max_model_len):
    engine_check(arch, 'cuda', lens, max_model_len, **MID)
