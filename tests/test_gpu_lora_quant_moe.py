"""LoRA over quantized bases and on MoE experts on a CUDA GPU (`-m cuda`; skipped without one).

The CPU tests' models and adapters (`test_lora_quant`, `test_lora_moe`) through `LLM` on the GPU kernels:
- quantized bases (`fp8`, `w4a16`) in bf16: the base and the adapter in one batch; the adapter's prompt log-probs are
  near the fp32 reference of the dequantized weights plus `scaling * B A` (0.1: bf16 activations, the FP8 kernels'
  quantized activations) and much nearer it than the base's reference is;
- a tiny Qwen3-MoE in fp32 with expert adapters (the Triton experts path; CUDA graphs off with LoRA on experts):
  base, a1, a2 and the per-expert a2e in one batch, prompt log-probs within 1e-3 of peft and greedy tokens equal;
- `fused_moe_lora` (Triton) against `fused_moe_lora_ref` at 1, 7 and 300 tokens, fp32 and bf16.
"""

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]
peft = pytest.importorskip('peft')

import test_lora_moe as M  # noqa: E402
from test_lora_quant import SP, V, build, reference, reference_model  # noqa: E402


@pytest.fixture(scope='module')
def setup():
    return build()


@pytest.fixture(scope='module')
def moe_setup():
    return M.build()


@pytest.mark.parametrize('method', ['fp8', 'w4a16'])
def test_lora_on_quantized_base_gpu(setup, method):
    from cvllm_lab import LLM
    from cvllm_lab.engine.lora_manager import LoRARequest

    root, base, deltas = setup
    llm = LLM(str(root / 'base'), dtype='bfloat16', progress=False, skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=8, quantization=method, max_model_len=64, device='cuda')  # fmt: skip
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (11, 9)]
    lr = LoRARequest('ad', 1, str(root / 'ad'))
    outs = llm.generate(prompts + prompts, SP, use_tqdm=False, lora_request=[None, None, lr, lr])
    refs = {None: reference_model(llm, base).float().cpu(), 'ad': reference_model(llm, base, deltas).float().cpu()}
    for k, p in enumerate(prompts):
        lp = {n: reference(refs[n], p)[1] for n in refs}
        got = torch.tensor([[d[t].logprob for t in range(V)] for d in outs[k + 2].prompt_logprobs[1:]])
        near, far = (got - lp['ad']).abs().max().item(), (got - lp[None]).abs().max().item()
        assert near < 0.1 and near < far / 4, (method, near, far)
        assert outs[k].outputs[0].token_ids != outs[k + 2].outputs[0].token_ids


def test_lora_moe_experts_gpu(moe_setup):
    d, refs, reqs = moe_setup
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 13, 11, 7)]
    names = [None, 'a1', 'a2', 'a2e']
    llm = M.engine(d, max_loras=3, device='cuda')
    assert llm.engine.runner.cfg.enforce_eager  # LoRA on experts: eager
    outs = llm.generate(prompts, SP, use_tqdm=False, lora_request=[reqs[n] for n in names])
    M.check(outs, prompts, names, refs, tol=1e-3)


@pytest.mark.parametrize('T', [1, 7, 300])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_fused_moe_lora_kernel_gpu(T, dtype):
    "The Triton MoE LoRA path against the PyTorch reference on the GPU: 3 slots, tokens without adapter among them."
    from cvllm_lab.kernels.fused_moe import select_experts
    from cvllm_lab.layers.lora_moe import fused_moe_lora, fused_moe_lora_ref

    torch.manual_seed(0)
    E, H, I, R, S, K = 16, 256, 128, 16, 3, 4
    dev = dict(device='cuda', dtype=dtype)
    x = torch.randn(T, H, **dev)
    w13, w2 = torch.randn(E, 2 * I, H, **dev) * 0.05, torch.randn(E, H, I, **dev) * 0.05
    lora = (torch.randn(S, E, 2 * R, H, **dev) * 0.05, torch.randn(S, E, 2 * I, R, **dev) * 0.05,
            torch.randn(S, E, R, I, **dev) * 0.05, torch.randn(S, E, H, R, **dev) * 0.05)  # fmt: skip
    tw, ids = select_experts(torch.randn(T, E, device='cuda'), K, True)
    tl = torch.randint(-1, S, (T,), device='cuda', dtype=torch.int32)
    got, ref = fused_moe_lora(x, w13, w2, tw, ids, tl, lora), fused_moe_lora_ref(x, w13, w2, tw, ids, tl, lora)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
