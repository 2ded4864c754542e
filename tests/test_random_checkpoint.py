"""`benchmarks/random_checkpoint.py` and our routing counter (`benchmarks/moe_same_ckpt.py`) at tiny DeepseekV2 and
Qwen3-MoE shapes on CPU (issue 50): the written folder loads in `transformers` and in our engine with the same
log-probs, its tensors are named and initialized as transformers' own model is, and the counter's distinct experts
per decode step lie between top-k and min(E, B k)."""

import json

import pytest
import torch

from benchmarks.moe_same_ckpt import count_distinct_experts
from benchmarks.random_checkpoint import hf_config, tensor_specs, transformers_config, write_checkpoint

TINY = {
    'deepseek_v2_lite': dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        bos_token_id=2,
        eos_token_id=1,
    ),
    'qwen3_30b_a3b': dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}


@pytest.fixture(scope='module', params=list(TINY))
def ckpt(request, tmp_path_factory):
    name = request.param
    cfg = hf_config(name, override=TINY[name])
    d = tmp_path_factory.mktemp(name)
    write_checkpoint(cfg, d, shard_gb=100e3 / 1e9, log=lambda s: None)  # ~100 kB shards: several of them
    return name, cfg, d


def test_layout(ckpt):
    "Sharded safetensors with an index naming every tensor once, per-expert names, bf16."
    from safetensors import safe_open

    name, cfg, d = ckpt
    index = json.loads((d / 'model.safetensors.index.json').read_text())['weight_map']
    shards = sorted(set(index.values()))
    assert len(shards) > 1 and all((d / s).exists() for s in shards)
    seen = {}
    for s in shards:
        with safe_open(str(d / s), 'pt') as f:
            seen |= {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert set(seen) == set(index) and set(seen.values()) == {'BF16'}
    assert 'model.layers.1.mlp.experts.7.gate_proj.weight' in index and 'model.layers.1.mlp.gate.weight' in index
    assert json.loads((d / 'config.json').read_text())['num_hidden_layers'] == cfg['num_hidden_layers']


def test_init_as_transformers(ckpt):
    """Each tensor's init kind is what transformers' own `_init_weights` gives it at this config (ones, zeros, or
    normal with the config's `initializer_range`)."""
    from transformers import AutoModelForCausalLM

    name, cfg, d = ckpt
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers_config(cfg))
    sd = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion

        sd = revert_weight_conversion(model, sd)
    except ImportError:
        pass
    for k, shape, kind in tensor_specs(cfg):
        t = sd[k].float()
        assert tuple(t.shape) == shape, k
        if kind == 'ones':
            assert (t == 1).all(), k
        elif kind == 'zeros':
            assert (t == 0).all(), k
        else:
            assert abs(t.std().item() - cfg['initializer_range']) < 0.2 * cfg['initializer_range'], k


def test_transformers_and_ours_agree(ckpt):
    "Next-token log-probs of transformers (fp32, from_pretrained) and our LLM(model=DIR) (fp32) within 1e-3."
    from transformers import AutoModelForCausalLM

    from cvllm_lab import LLM, SamplingParams

    name, cfg, d = ckpt
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3, 250, 42, 7], [11, 200, 31]]
    with torch.no_grad():
        want = [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1) for p in prompts]
    llm = LLM(str(d), dtype='float32', device='cpu', progress=False, enforce_eager=True, max_model_len=256)
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=1, logprobs=-1, ignore_eos=True),
        use_tqdm=False,
    )
    V = cfg['vocab_size']
    for o, w in zip(outs, want):
        got = torch.tensor([o.outputs[0].logprobs[0][t].logprob for t in range(V)])
        assert (got - w).abs().max() < 1e-3, (name, (got - w).abs().max())
        assert w.max() - w.min() > 0.05  # the logits are spread, not near-tied
    for B in (1, 4):
        c = count_distinct_experts(llm, cfg, B, 6, steps=3)
        E, k = c['num_experts'], c['top_k']
        assert c['n_counted'] == 3 * (cfg['num_hidden_layers'] - cfg.get('first_k_dense_replace', 0)), c
        assert k <= c['distinct_min'] <= c['distinct_max'] <= min(E, B * k), c


def test_vllm_counters_on_a_stand_in():
    """The peer's hook functions (run inside vLLM's worker through `apply_model`) on a stand-in for vLLM 0.26's
    `MoERunner`: a module with a `.router` that calls `capture_fn(topk_ids)` (`BaseRouter.set_capture_fn`), and one
    whose router has only `select_experts` (wrapped instead)."""
    from benchmarks.vllm_moe_peer import decode_counts, install_counters, take_counts

    class Router:
        def __init__(self, capture):
            self.capture_fn = None
            if capture:
                self.set_capture_fn = lambda fn: setattr(self, 'capture_fn', fn)

        def select_experts(self, hidden_states, router_logits):
            ids = router_logits.topk(2, -1)[1]
            if self.capture_fn is not None:
                self.capture_fn(ids)
            return router_logits.softmax(-1).gather(1, ids), ids

    class Runner(torch.nn.Module):
        def __init__(self, capture):
            super().__init__()
            self.router = Router(capture)

        def forward(self, x):
            return self.router.select_experts(hidden_states=x, router_logits=x)

    model = torch.nn.Sequential(Runner(True), Runner(False))
    assert install_counters(model) == 2
    for T in (6, 1, 1):  # a prefill of 6 tokens, then two decode steps of one
        x = torch.randn(T, 8)
        model[0](x), model[1](x[-1:] if T > 1 else x)  # the prefill's last layer on its last token only
    got = take_counts(model)
    assert [(layer, T) for layer, T, _ in got] == [(0, 6), (1, 1), (0, 1), (1, 1), (0, 1), (1, 1)]
    assert decode_counts([(T, c) for _, T, c in got], 1) == [2, 2, 2, 2] and take_counts(model) == []
