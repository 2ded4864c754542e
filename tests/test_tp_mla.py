"""DeepSeek V2 / V3 (MLA + MoE) at tensor parallel 2 (CPU, gloo): heads split, the latent replicated.

Model level: each rank builds the tiny V2 (no q LoRA, group-limited routing) and V3 (q LoRA, sigmoid router with
the correction bias) models of `tests/test_models_deepseek.py` (one dense layer, two MoE layers with shared
experts) in the group and loads the full HF state dict: `q_proj`/`q_b_proj` and `kv_b_proj` keep their rank's
heads' rows, `o_proj` their columns, the experts and shared experts their intermediate slices, the latent path
whole. Rank 0's logits of a flat prefill batch must match `transformers` within 1e-4 (fp32). Engine level: `LLM(...,
tensor_parallel_size=2)` gives TP 1's greedy tokens and prompt log-probs within 1e-4 through the paged, chunked,
batched path (prefill decompression, absorbed decode, mixed steps).
"""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.utils import parallel_state as ps

sys.path.insert(0, os.path.dirname(__file__))
from test_models_deepseek import tiny_hf  # noqa: E402


def _rank(rank, world, port, q):
    from cvllm_lab.models.llama import check_tensor_parallel
    from cvllm_lab.models.registry import get_model_class
    from cvllm_lab.utils.context import bind_kv_cache, prefill_context, set_forward_context

    torch.set_num_threads(1)
    ps.init_distributed(ps.DistInit(rank, world, rank, '127.0.0.1', port), timeout_s=120)
    try:
        res = {}
        lens = (5, 17, 33)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 256, (n,), generator=g) for n in lens]
        for v3 in (False, True):
            hf, _ = tiny_hf(v3)
            cfg = hf.config
            ours = get_model_class(cfg)(cfg)
            check_tensor_parallel(ours)
            ours.load_weights(hf.state_dict().items())
            ctx, nb = prefill_context(list(lens), 16)
            bind_kv_cache(ours, nb, 16)
            with torch.no_grad(), set_forward_context(ctx):
                logits = ours.compute_logits(ours(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))
                if rank == 0:
                    ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
                    res[v3] = (logits - ref).abs().max().item()
            a = ours.model.layers[0].self_attn
            res[f'{v3}.shapes'] = (
                a.num_heads,
                tuple(a.kv_b_proj.weight.shape),
                tuple(a.o_proj.weight.shape),
                tuple(ours.attention_layers()[1].kv_cache.shape[1:]),
                tuple(ours.model.layers[1].mlp.experts.w13_weight.shape),
            )
        if rank == 0:
            q.put(('ok', res))
    except BaseException as e:
        q.put(('error', f'rank {rank}: {type(e).__name__}: {e}'))
        raise
    finally:
        ps.destroy_distributed()


def test_deepseek_at_tp2_matches_hf():
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_rank, args=(2, ps.free_port(), q), nprocs=2, join=True)
    kind, res = q.get()
    assert kind == 'ok', res
    for v3 in (False, True):
        assert res[v3] < 1e-4, (v3, res[v3])
    # 4 heads over 2 ranks: 2 heads' kv_b rows (P + V = 64 each) and o_proj columns (V = 32 each); the latent row whole
    # (L + R = 80 per token, as at TP 1); each expert's gate/up rows halved (2 x 64 / 2)
    assert res['False.shapes'] == res['True.shapes'] == (2, (2 * 64, 64), (128, 2 * 32), (16, 80), (16, 64, 128))


@pytest.mark.parametrize('v3', [False, True])
def test_deepseek_tp2_matches_tp1_through_the_engine(v3):
    from test_tp_engine import check_same, run

    _, d = tiny_hf(v3, seed=2)
    check_same(run(str(d), 2), run(str(d), 1))
