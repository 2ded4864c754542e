"""Gemma 4 (text) at tensor parallel 2 against `transformers`, as `test_tp_models.py` does the other dense families.

The tiny config has everything that splits differently: global layers with their own head size and one KV head
(replicated over the ranks) whose V is K's projection, two KV-shared layers whose `q_only` splits by heads, per-layer
inputs (replicated), a double-wide MLP and soft-capped logits; once more with the MoE block (26B-A4B) on every layer. Each rank loads the full HF state dict and runs the
same flat batch over a paged KV cache; rank 0's gathered logits must match HF's within 1e-4 (fp32).
"""

import torch
import torch.multiprocessing as mp

from cvllm_lab.utils import parallel_state as ps

V = 250


def config(moe: bool = False):
    from transformers import Gemma4TextConfig

    types = ['sliding_attention', 'full_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention']
    cfg = Gemma4TextConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=4,
        vocab_size_per_layer_input=V,
        hidden_size_per_layer_input=8,
        layer_types=types + ['full_attention'],
        num_kv_shared_layers=2,
        attention_k_eq_v=True,
        global_head_dim=32,
        num_global_key_value_heads=1,
        use_double_wide_mlp=True,
        final_logit_softcapping=5.0,
        initializer_range=0.3,
        rope_parameters={
            'sliding_attention': {'rope_type': 'default', 'rope_theta': 100.0},
            'full_attention': {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1e4},
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **(dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24) if moe else {}),
    )
    cfg.architectures = ['Gemma4ForCausalLM']
    cfg._attn_implementation = 'eager'
    return cfg


def _rank(rank, world, port, q):
    from transformers import Gemma4ForCausalLM as HF
    from cvllm_lab.models.registry import get_model_class
    from cvllm_lab.utils.context import bind_kv_cache, prefill_context, set_forward_context

    torch.set_num_threads(1)
    ps.init_distributed(ps.DistInit(rank, world, rank, '127.0.0.1', port), timeout_s=120)
    try:
        res = {}
        lens = (5, 17, 33)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, V, (n,), generator=g) for n in lens]
        for moe in (False, True):
            cfg = config(moe)
            torch.manual_seed(0)
            hf = HF(cfg).eval()
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if 'norm' in n or n.endswith(('router.scale', 'per_expert_scale')):
                        p.copy_(1 + 0.3 * torch.randn_like(p))
            ours = get_model_class(cfg)(cfg)
            ours.load_weights(hf.state_dict().items())
            ctx, nb = prefill_context(list(lens), 16)
            bind_kv_cache(ours, nb, 16)
            with torch.no_grad(), set_forward_context(ctx):
                logits = ours.compute_logits(ours(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))
                if rank == 0:
                    ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
                    heads = [(l.self_attn.H, getattr(l.self_attn, 'Hkv', None)) for l in ours.model.layers]
                    res[moe] = ((logits - ref).abs().max().item(), heads)
                else:
                    assert logits is None
        if rank == 0:
            q.put(('ok', res))
    except BaseException as e:
        q.put(('error', f'rank {rank}: {type(e).__name__}: {e}'))
        raise
    finally:
        ps.destroy_distributed()


def test_gemma4_at_tp2_matches_hf():
    "Both configs in one pair of ranks; with the MoE block each rank holds half of every expert's intermediate dimension."
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_rank, args=(2, ps.free_port(), q), nprocs=2, join=True)
    kind, res = q.get()
    assert kind == 'ok', res
    for moe, (err, heads) in res.items():
        assert err < 1e-4, (moe, err)
        # per rank: 2 of 4 query heads; sliding layers 1 of 2 KV heads, global layers their one KV head (replicated);
        # the KV-shared layers 4 and 5 have no KV heads of their own
        assert heads == [(2, 1), (2, 1), (2, 1), (2, 1), (2, None), (2, None)], heads
    assert set(res) == {False, True}
