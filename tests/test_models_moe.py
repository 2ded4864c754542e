"""MoE models through the engine: the Qwen3-30B-A3B bench shape (conf/model/qwen3_30b_a3b.yaml) built with dummy
weights at a shrunken scale on the CPU, and, on a GPU (`-m cuda`), the fused-kernel path of a tiny random Qwen3-MoE
against `transformers` and the real shape's decode with CUDA graphs."""

import pytest
import torch

from cvllm_lab import LLM, SamplingParams
from cvllm_lab.layers.fused_moe import FusedMoE

from helpers import bench_model_dir, tiny_qwen3_moe, tiny_tokenizer


SHRINK = dict(
    num_hidden_layers=2,
    hidden_size=64,
    moe_intermediate_size=32,
    intermediate_size=96,
    num_experts=16,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def test_bench_shape_builds_with_dummy_weights():
    "The bench config's fields survive (top-8, renormalized, QK-norm, GQA); batched = each alone."
    llm = LLM(
        str(bench_model_dir('qwen3_30b_a3b', SHRINK)),
        load_format='dummy',
        skip_tokenizer_init=True,
        dtype='float32',
        progress=False,
        max_model_len=256,
        kv_cache_memory=8 << 20,
        block_size=4,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
    )
    model = llm.engine.runner.model
    assert type(model).__name__ == 'Qwen3MoeForCausalLM'
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all((m.num_experts, m.top_k, m.renormalize) == (16, 8, True) for m in moes)
    assert moes[0].w13_weight.shape == (16, 64, 64) and moes[0].w2_weight.shape == (16, 64, 32)
    assert model.model.layers[0].self_attn.q_norm is not None
    for p in model.parameters():  # every weight filled by the dummy loader
        assert p.abs().max() <= 1e-3 and p.abs().max() > 0
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 512, (n,), generator=g).tolist()} for n in (3, 19, 11)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 6 for t in together)
    assert together == [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_tiny_tokenizer_through_the_engine():
    "The offline tokenizer saved beside a shrunken model: text prompts encode to its ids and outputs decode back."
    d = bench_model_dir('qwen3_30b_a3b', SHRINK)
    tiny_tokenizer(SHRINK['vocab_size']).save_pretrained(d)
    llm = LLM(
        str(d),
        load_format='dummy',
        dtype='float32',
        progress=False,
        max_model_len=64,
        kv_cache_memory=4 << 20,
        block_size=4,
    )
    out = llm.generate(['w5 w17 w600'], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 17, 0]
    ids = out.outputs[0].token_ids
    assert len(ids) == 4 and out.outputs[0].text.split() == [('<unk>' if i == 0 else f'w{i}') for i in ids]


def test_bench_shape_config_is_the_real_one():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bench_model_dir('qwen3_30b_a3b'))
    assert (
        cfg.num_hidden_layers,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
    ) == (48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    assert cfg.norm_topk_prob and cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers


# ------------------------------------------------------------------------------------------------ GPU


def fp8_dequantized_reference(hf, model, dtype):
    """A copy of `hf` holding exactly the weights `model` (in-situ FP8) computes with: the attention projections and
    the experts dequantized from their FP8 blocks, everything else rounded to `dtype` as the engine holds it.
    Compared with it, the bound tests the kernels, not the quantization error."""
    import copy
    from cvllm_lab.quant.fp8 import FP8Linear

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).float())
        for ours, theirs in zip(model.model.layers, ref.model.layers):
            a, b = ours.self_attn, theirs.self_attn
            q, k, v = a.qkv_proj.dequantize().float().split([a.H * a.D, a.Hkv * a.D, a.Hkv * a.D])
            for lin, w in ((b.q_proj, q), (b.k_proj, k), (b.v_proj, v), (b.o_proj, a.o_proj.dequantize().float())):
                lin.weight.copy_(w)
            m = ours.mlp.experts
            for n, dst in (
                ('w13_weight', theirs.mlp.experts.gate_up_proj),
                ('w2_weight', theirs.mlp.experts.down_proj),
            ):
                w, s = getattr(m, n), getattr(m, f'{n}_scale_inv')
                dst.copy_(
                    torch.stack([FP8Linear.from_fp8(w[e].cpu(), s[e].cpu()).dequantize() for e in range(m.num_experts)])
                )
    return ref


def check_qwen3_moe_through_engine(device, quantization):
    """A tiny random Qwen3-MoE through the engine against `transformers` on the CPU: prompt log-probs and 12 greedy
    tokens in fp32. FP8 (W8A16; bf16 activations on CUDA, fp32 on the CPU) against the same model with the FP8
    weights dequantized: at every position our top token is within 0.1 nats of the reference's best (a near tie may
    pick either) and the log-probs are close (bf16: 0.05 on average; fp32: 1e-3 everywhere)."""
    cfg, hf, d = tiny_qwen3_moe()
    tiny_tokenizer(cfg.vocab_size).save_pretrained(d)
    dtype = torch.bfloat16 if quantization and device == 'cuda' else torch.float32
    llm = LLM(
        str(d),
        device=device,
        dtype=str(dtype).removeprefix('torch.'),
        progress=False,
        quantization=quantization,
        block_size=16,
        prefill_chunk_size=16,
        max_num_batched_tokens=32,
        kv_cache_memory=64 << 20,
        max_num_seqs=8,
    )
    model = llm.engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all((m.quant_method is None) == (quantization is None) for m in moes), (
        'in-situ quantization must reach the experts (quant.apply.quantize_model -> quant.moe.quantize_moe)'
    )
    if quantization == 'fp8':
        hf = fp8_dequantized_reference(hf, model, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 41, 23)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True), use_tqdm=False
    )
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]
            got = torch.tensor([[d[t].logprob for t in range(256)] for d in o.prompt_logprobs[1:]])
            if quantization is None:
                torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
                gen = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
                assert o.outputs[0].token_ids == gen[0, len(p) :].tolist()
            else:
                gap = ref.max(-1).values - ref.gather(-1, got.argmax(-1, keepdim=True))[:, 0]
                assert gap.max() < 0.1, gap.max()
                if dtype == torch.float32:
                    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
                else:
                    assert (got - ref).abs().mean() < 0.05, (got - ref).abs().mean()


@pytest.mark.cuda
@pytest.mark.parametrize('quantization', [None, 'fp8'])
def test_qwen3_moe_fused_kernel_through_engine(quantization):
    "The fused MoE kernel path on CUDA (Triton attention, CUDA graphs): see `check_qwen3_moe_through_engine`."
    check_qwen3_moe_through_engine('cuda', quantization)


def test_qwen3_moe_fp8_experts_on_cpu():
    "The FP8 case's reference (the dequantized weights) on the CPU path, where no GPU is needed to check it."
    check_qwen3_moe_through_engine('cpu', 'fp8')


@pytest.mark.cuda
def test_qwen3_30b_a3b_decode_on_gpu():
    "The real shape in bf16 with dummy weights: builds, captures CUDA graphs, decodes a batch of 64."
    llm = LLM(
        str(bench_model_dir('qwen3_30b_a3b')),
        load_format='dummy',
        skip_tokenizer_init=True,
        progress=False,
        max_model_len=2048,
        max_num_seqs=64,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [{'prompt_token_ids': torch.randint(0, 151936, (64,), generator=g).tolist()} for _ in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.runner.graphs, 'decode ran without CUDA graphs'
