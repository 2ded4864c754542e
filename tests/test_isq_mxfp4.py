"""In-situ MXFP4 (`quantization='mxfp4'`, notebook 43a): `Mxfp4Linear` on its kernel path (the decode-shaped Triton
matmul up to `MM_MIN_ROWS` rows, the tensor-core tile kernel above) against the dequantized weight, for
3-D inputs, a bias and sizes off the kernel's tiles (CPU: under the interpreter); on a GPU, a tiny Llama and a tiny
Qwen3-MoE through `LLM(quantization='mxfp4')` against the same float models with their decoder linears and experts
replaced by the MXFP4-dequantized values (the CPU notebook checks the same through the CPU path)."""

import tempfile
from pathlib import Path

import pytest
import torch

from cvllm_lab.kernels.mxfp4 import MM_MIN_ROWS, dequantize_mxfp4_ref, quantize_mxfp4, quantize_mxfp4_ref
from cvllm_lab.layers.basic import Linear
from cvllm_lab.quant.mxfp4 import Mxfp4Linear

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'


@pytest.mark.parametrize('rows', [1, 5, MM_MIN_ROWS, MM_MIN_ROWS + 1, 70])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_mxfp4_linear_kernel_path(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(160, [72, 24], bias=True, shard_ids=['q', 'k'])  # N = 96, K = 160: off the 64-wide tiles
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 160, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=g))
    q = Mxfp4Linear.from_linear(lin).to(DEV)
    w = dequantize_mxfp4_ref(*quantize_mxfp4_ref(lin.weight.detach())).to(DEV)
    x = torch.randn(1, rows, 160, generator=g).to(DEV, dtype)
    got = q.forward_kernel(x)
    assert got.shape == (1, rows, 96) and got.dtype == dtype
    ref = x.float() @ w.T + lin.bias.to(DEV)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_quantize_mxfp4_large_matches_reference():
    "The chunked quantizer against the plain one on a bf16 weight of real width (many exact ties once scaled)."
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 4096, generator=g) * 0.02).to(DEV, torch.bfloat16)
    b, s = quantize_mxfp4(w, max_elements=1 << 16)
    rb, rs = quantize_mxfp4_ref(w)
    assert torch.equal(b, rb) and torch.equal(s, rs)


def _tiny(name):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    small = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    small |= dict(num_hidden_layers=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    if name == 'llama':
        return LlamaForCausalLM(LlamaConfig(**small, intermediate_size=96, architectures=['LlamaForCausalLM']))
    cfg = Qwen3MoeConfig(
        **small,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        architectures=['Qwen3MoeForCausalLM'],
    )
    return Qwen3MoeForCausalLM(cfg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
@pytest.mark.parametrize('name', ['llama', 'qwen3_moe'])
def test_isq_mxfp4_engine_gpu(name):
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.layers.fused_moe import FusedMoE
    from cvllm_lab.quant.apply import decoder_linears

    torch.manual_seed(0)
    d = Path(tempfile.mkdtemp())
    _tiny(name).save_pretrained(d)
    kw = dict(device='cuda', dtype='float32', skip_tokenizer_init=True, progress=False, kv_cache_memory=16 << 20)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 40)]
    sp = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=-1, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{'prompt_token_ids': p} for p in prompts], sp, use_tqdm=False)
        lp = [torch.tensor([[x[t].logprob for t in range(256)] for x in o.prompt_logprobs[1:]]) for o in outs]
        return torch.cat(lp), [o.outputs[0].token_ids for o in outs]

    q = LLM(str(d), quantization='mxfp4', **kw)  # CUDA graphs for decode: the decode-shaped matmul inside them
    lp_q, tok_q = run(q)
    del q
    f = LLM(str(d), **kw)
    m = f.engine.runner.model
    with torch.no_grad():
        for _, lin in decoder_linears(m):
            lin.weight.copy_(dequantize_mxfp4_ref(*quantize_mxfp4_ref(lin.weight)))
        for e in m.modules():
            if isinstance(e, FusedMoE):
                for w in (e.w13_weight, e.w2_weight):
                    w.copy_(dequantize_mxfp4_ref(*quantize_mxfp4_ref(w)))  # in place: its CUDA graphs still hold
    lp_r, tok_r = run(f)
    assert (lp_q - lp_r).abs().max() < 1e-3
    assert tok_q == tok_r
