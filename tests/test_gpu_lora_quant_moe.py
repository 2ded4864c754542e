"""LoRA over quantized bases and on MoE experts on a CUDA GPU (`-m cuda`; skipped without one).

The CPU tests' models and adapters (`test_lora_quant`, `test_lora_moe`) through `LLM` on the GPU kernels:
- quantized bases (`fp8`, `w4a16`) in bf16: the base and the adapter in one batch; the adapter's prompt log-probs are
  near the fp32 reference of the dequantized weights plus `scaling * B A` (0.1: bf16 activations, the FP8 kernels'
  quantized activations) and much nearer it than the base's reference is;
- a tiny Qwen3-MoE in fp32 with expert adapters (CUDA graphs turned off by LoRA on experts): base, a1, a2 and the
  per-expert a2e in one batch, prompt log-probs within 1e-3 of peft and greedy tokens equal.
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
