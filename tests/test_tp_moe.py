"""The MoE families at tensor parallel 2 and 4 (CPU, gloo): every expert's intermediate dimension split over the ranks.

Model level: each rank builds Qwen2-MoE (shared expert, sigmoid gate, one dense layer), Qwen3-MoE and Mixtral (and,
at TP 2, Llama 4: chunked and NoPE attention, top-1 experts and a shared expert) in the group, loads the full HF state dict (each expert's gate/up rows and down columns cut to the rank's slice by
`FusedMoE.weight_loader`) and rank 0's logits must match `transformers` within 1e-4 (fp32). Engine level:
`LLM(..., tensor_parallel_size=N)` gives TP 1's greedy tokens and prompt log-probs within 1e-4 through the paged,
chunked, batched path (4-token blocks, 8-token prefill chunks, a 16-token step budget). DeepSeek-V2/V3 run at TP 2
with their experts and shared experts sharded the same way and MLA attention replicated (every rank computes all
heads: correct, not yet split).
"""

import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.layers.fused_moe import FusedMoE
from cvllm_lab.utils import parallel_state as ps

V = 250
BASE = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    initializer_range=0.1,
)


def moe_config(name):
    "Tiny configs whose expert (32), shared-expert (48) and dense (96) widths split over 2 and 4 ranks."
    import transformers as T

    if name == 'qwen2_moe':
        cfg = T.Qwen2MoeConfig(
            **BASE,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    elif name == 'qwen3_moe':
        cfg = T.Qwen3MoeConfig(
            **BASE, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
        )
    elif name == 'llama4':  # chunked RoPE layers with the QK norm, a NoPE layer, top-1 experts + shared expert
        cfg = T.Llama4TextConfig(
            **{**BASE, 'intermediate_size': 32, 'num_hidden_layers': 4},
            intermediate_size_mlp=96,
            head_dim=16,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            floor_scale=4,
        )
    else:
        cfg = T.MixtralConfig(**{**BASE, 'intermediate_size': 32}, num_local_experts=4, num_experts_per_tok=2)
    cfg.architectures = [
        {
            'qwen2_moe': 'Qwen2MoeForCausalLM',
            'qwen3_moe': 'Qwen3MoeForCausalLM',
            'mixtral': 'MixtralForCausalLM',
            'llama4': 'Llama4ForCausalLM',
        }[name]
    ]
    return cfg


def hf_model(cfg, seed=0):
    "The HF model in fp32 (the same on every rank), norms and biases off their init values."
    import transformers as T

    torch.manual_seed(seed)
    hf = getattr(T, cfg.architectures[0])(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.05)
            elif 'norm' in n:
                p.normal_(1, 0.2)
    return hf


def _rank(rank, world, port, names, q):
    from cvllm_lab.models.llama import check_tensor_parallel
    from cvllm_lab.models.registry import get_model_class
    from cvllm_lab.utils.context import bind_kv_cache, prefill_context, set_forward_context

    torch.set_num_threads(1)
    ps.init_distributed(ps.DistInit(rank, world, rank, '127.0.0.1', port), timeout_s=120)
    try:
        res = {}
        lens = (5, 17, 33)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, V, (n,), generator=g) for n in lens]
        for name in names:
            if name.startswith('deepseek'):
                from test_models_deepseek import tiny_hf

                hf = tiny_hf(name == 'deepseek_v3')[0]
                cfg = hf.config
                ours = get_model_class(cfg)(cfg)
            else:
                cfg = moe_config(name)
                hf, ours = hf_model(cfg), get_model_class(cfg)(cfg)
            check_tensor_parallel(ours)
            ours.load_weights(hf.state_dict().items())
            ctx, nb = prefill_context(list(lens), 16)
            bind_kv_cache(ours, nb, 16)
            with torch.no_grad(), set_forward_context(ctx):
                logits = ours.compute_logits(ours(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))
                if rank == 0:
                    ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
                    res[name] = (logits - ref).abs().max().item()
            experts = next(m for m in ours.modules() if isinstance(m, FusedMoE))
            res[f'{name}.w13'] = tuple(experts.w13_weight.shape)
        if rank == 0:
            q.put(('ok', res))
    except BaseException as e:
        q.put(('error', f'rank {rank}: {type(e).__name__}: {e}'))
        raise
    finally:
        ps.destroy_distributed()


def run_ranks(world, names):
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_rank, args=(world, ps.free_port(), names, q), nprocs=world, join=True)
    kind, res = q.get()
    assert kind == 'ok', res
    return res


@pytest.mark.parametrize('world', [2, 4])
def test_moe_families_at_tp_match_hf(world):
    names = ['qwen2_moe', 'qwen3_moe', 'mixtral']
    res = run_ranks(world, names)
    for n in names:
        assert res[n] < 1e-4, (n, res[n])
    assert res['qwen3_moe.w13'] == (8, 2 * 32 // world, 64)  # each rank: its slice of every expert's 32 rows
    assert res['mixtral.w13'] == (4, 2 * 32 // world, 64)


def test_llama4_at_tp2_matches_hf():
    "Llama 4's heads, experts, shared expert and dense MLP sharded (router replicated): rank 0 = HF within 1e-4."
    res = run_ranks(2, ['llama4'])
    assert res['llama4'] < 1e-4, res['llama4']
    assert res['llama4.w13'] == (4, 2 * 32 // 2, 64)


def test_deepseek_at_tp2_matches_hf():
    "Routed experts (grouped top-k, V3's scoring bias) and shared experts sharded, MLA replicated: rank 0 = HF."
    sys.path.insert(0, os.path.dirname(__file__))
    res = run_ranks(2, ['deepseek_v2', 'deepseek_v3'])
    for n in ('deepseek_v2', 'deepseek_v3'):
        assert res[n] < 1e-4, (n, res[n])
    assert res['deepseek_v2.w13'] == (16, 2 * 64 // 2, 128)


def save_model(d, name):
    from cvllm_lab.config import default_model_path
    from cvllm_lab.tokenizer import load_tokenizer

    hf_model(moe_config(name)).save_pretrained(d)
    gg = default_model_path()
    load_tokenizer(gg.parent, gg.name).save_pretrained(d)
    return d


@pytest.mark.parametrize('name,world', [('qwen2_moe', 2), ('qwen3_moe', 2), ('mixtral', 2), ('qwen2_moe', 4)])
def test_moe_tp_matches_tp1_through_the_engine(name, world):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_tp_engine import check_same, run

    with tempfile.TemporaryDirectory() as d:
        save_model(d, name)
        check_same(run(d, world), run(d, 1))


def test_indivisible_expert_width_is_refused():
    "An expert width that does not split over the ranks is refused at build time, naming the dimension."
    with pytest.raises(ValueError, match='expert intermediate size 30 is not divisible by the tensor-parallel size 4'):
        FusedMoE(8, 2, 64, 30, tp_rank=1, tp_size=4)
