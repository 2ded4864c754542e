"""Speculative decoding on hybrid Gated-DeltaNet models on a GPU (notebook 51g): tiny random Qwen3-Next (MoE) and
Qwen3.5 (dense) in fp32 on the Triton kernels, with one MTP layer (the last layer of a 5-layer model, renamed to
`mtp.layers.0.*`, plus `mtp.fc` and the three norms) appended to the checkpoint. Greedy output with n-gram (k = 3)
and MTP (k = 1, 2) equals greedy output without (CUDA graphs there), token for token, in a small pool that preempts;
the per-position state kernels against their references at real head sizes (both paths of the delta rule). Skipped without CUDA."""

import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]

V, H = 512, 256
BASE = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256)
TYPES = ['linear_attention', 'linear_attention', 'full_attention', 'linear_attention']


def _model(kind) -> str:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    cls, make = {
        'qwen3_next': (Qwen3NextForCausalLM, lambda **kw: Qwen3NextConfig(**BASE, **MOE, **kw)),
        'qwen3_5': (Qwen3_5ForCausalLM, lambda **kw: Qwen3_5TextConfig(**BASE, **kw)),
    }[kind]
    torch.manual_seed(0)
    full = cls(make(num_hidden_layers=5, layer_types=TYPES + ['full_attention'])).eval()
    with torch.no_grad():
        for n, p in full.named_parameters():
            if 'norm' in n or n.endswith(('A_log', 'dt_bias')):
                p.normal_(0, 0.5)
        full.lm_head.weight.mul_(4)
    d = Path(tempfile.mkdtemp())
    full.save_pretrained(d)
    cfg = make(num_hidden_layers=4, layer_types=TYPES, mtp_num_hidden_layers=1)
    cfg.architectures = [cls.__name__]
    cfg.save_pretrained(d)
    sd = load_file(str(d / 'model.safetensors'))
    sd = {('mtp.layers.0.' + k[15:] if k.startswith('model.layers.4.') else k): v for k, v in sd.items()}
    sd |= {
        'mtp.fc.weight': torch.randn(H, 2 * H) / (2 * H) ** 0.5,
        'mtp.pre_fc_norm_embedding.weight': 0.3 * torch.randn(H),
        'mtp.pre_fc_norm_hidden.weight': 0.3 * torch.randn(H),
        'mtp.norm.weight': 0.3 * torch.randn(H),
    }
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / 'model.safetensors'), metadata={'format': 'pt'})
    return str(d)


@pytest.mark.parametrize('kind', ['qwen3_next', 'qwen3_5'])
def test_hybrid_spec_greedy_equals_plain(kind):
    from cvllm_lab import LLM, SamplingParams

    path = _model(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 150)]
    prompts += [[5, 6, 7, 8, 9] * 12, [3] * 40]  # the n-gram proposer is right here, partly
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    specs = {
        'none': None,
        'ngram3': dict(method='ngram', num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
        'mtp1': dict(method='mtp', num_speculative_tokens=1),
        'mtp2': dict(method='qwen3_next_mtp', num_speculative_tokens=2),
    }
    outs, stats = {}, {}
    for name, spec in specs.items():
        llm = LLM(
            path,
            progress=False,
            device='cuda',
            dtype='float32',
            attention_backend='triton',
            skip_tokenizer_init=True,
            block_size=16,
            prefill_chunk_size=64,
            max_num_batched_tokens=64,
            num_gpu_blocks_override=24,
            max_model_len=256,
            max_num_seqs=8,
            speculative_config=spec,
        )
        res = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)
        outs[name], stats[name] = [o.outputs[0].token_ids for o in res], llm.engine.core.stats()
        del llm
        torch.cuda.empty_cache()
    for name in specs:
        assert outs[name] == outs['none'], name
    assert 0 < stats['ngram3']['spec_decode_num_accepted_tokens'] < stats['ngram3']['spec_decode_num_draft_tokens']
    assert stats['mtp2']['spec_decode_num_draft_tokens'] > 0


def test_state_per_position_kernels_cuda():
    from cvllm_lab.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
    from cvllm_lab.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_ref

    dev, lens, P = 'cuda', [4, 1, 3, 4, 2], 4
    torch.manual_seed(0)
    B, T, Hk, Hv, Dk, Dv, C, K = len(lens), sum(lens), 4, 8, 128, 128, 1024, 4
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v = torch.randn(T, Hk, Dk, device=dev), torch.randn(T, Hk, Dk, device=dev), torch.randn(T, Hv, Dv, device=dev)
    g, beta = -torch.rand(T, Hv, device=dev), torch.rand(T, Hv, device=dev)
    idx = torch.arange(B, dtype=torch.int32, device=dev)
    init = torch.tensor([True, True, False, True, True], device=dev)
    out_idx = (B + torch.arange(B * P, dtype=torch.int32, device=dev)).view(B, P)
    out_idx[1, 1:] = -1
    S0, cs0 = torch.randn(B * (P + 1), Hv, Dk, Dv, device=dev), torch.randn(B * (P + 1), C, K - 1, device=dev)
    x, w = torch.randn(T, C, device=dev), torch.randn(C, K, device=dev)
    S1, S2, c1, c2 = S0.clone(), S0.clone(), cs0.clone(), cs0.clone()
    o1 = gated_delta_rule(q, k, v, g, beta, qsl, S1, idx, init, state_out_idx=out_idx)
    o2 = gated_delta_rule_ref(q, k, v, g, beta, qsl, S2, idx, init, state_out_idx=out_idx)
    y1 = causal_conv1d(x, w, None, qsl, c1, idx, init, 'silu', 4, out_idx)
    y2 = causal_conv1d_ref(x, w, None, qsl, c2, idx, init, 'silu', 4, out_idx)
    torch.testing.assert_close(o1, o2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S1, S2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y1, y2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c1, c2)
    S3 = S0.clone()  # a verification batch (every query at most P tokens): one recurrent pass, the same results
    o3 = gated_delta_rule(q, k, v, g, beta, qsl, S3, idx, init, None, True, P, out_idx)
    torch.testing.assert_close(o3, o2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S3, S2, atol=1e-4, rtol=1e-4)
