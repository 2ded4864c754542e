"""Qwen3-MoE at tensor parallel 2 (CPU, gloo): every expert's intermediate dimension split over the ranks.

Model level: each rank builds the model in the group, loads the full HF state dict (each expert's gate/up rows and
down columns cut to the rank's slice) and rank 0's logits must match `transformers` within 1e-4 (fp32). Engine
level: `LLM(..., tensor_parallel_size=2)` gives TP 1's greedy tokens and prompt log-probs within 1e-4 through the
paged, chunked, batched path. Skipped while `FusedMoE` has no tensor-parallel split (`tp_size`).
"""
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cvllm_lab.layers.fused_moe import FusedMoE
from cvllm_lab.utils import parallel_state as ps

pytestmark = pytest.mark.skipif(not hasattr(FusedMoE(2, 1, 4, 4), 'tp_size'),
                                reason="FusedMoE does not split its experts over tensor-parallel ranks yet")

V = 250


def moe_config():
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128, norm_topk_prob=True, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None, initializer_range=0.1)
    cfg.architectures = ['Qwen3MoeForCausalLM']
    return cfg


def hf_model(cfg, seed=0):
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if 'norm' in n: p.normal_(1, 0.2)
    return hf


def _rank(rank, world, port, q):
    from cvllm_lab.models.llama import check_tensor_parallel
    from cvllm_lab.models.registry import get_model_class
    from cvllm_lab.utils.context import bind_kv_cache, prefill_context, set_forward_context
    torch.set_num_threads(1)
    ps.init_distributed(ps.DistInit(rank, world, rank, '127.0.0.1', port), timeout_s=120)
    try:
        cfg = moe_config()
        hf, ours = hf_model(cfg), get_model_class(cfg)(cfg)
        check_tensor_parallel(ours)
        ours.load_weights(hf.state_dict().items())
        lens = (5, 17, 33)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, V, (n,), generator=g) for n in lens]
        ctx, nb = prefill_context(list(lens), 16)
        bind_kv_cache(ours, nb, 16)
        with torch.no_grad(), set_forward_context(ctx):
            logits = ours.compute_logits(ours(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))
            if rank == 0:
                ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
                experts = next(m for m in ours.modules() if isinstance(m, FusedMoE))
                q.put(('ok', (logits - ref).abs().max().item(), tuple(experts.w13_weight.shape)))
    except BaseException as e:
        q.put(('error', f'rank {rank}: {type(e).__name__}: {e}', None)); raise
    finally: ps.destroy_distributed()


def test_qwen3_moe_at_tp2_matches_hf():
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_rank, args=(2, ps.free_port(), q), nprocs=2, join=True)
    kind, err, w13 = q.get()
    assert kind == 'ok', err
    assert err < 1e-4, err
    assert w13 == (8, 2 * 16, 64)                          # each rank: half of every expert's 32 intermediate rows


def test_qwen3_moe_tp2_matches_tp1_through_the_engine():
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from test_tp_engine import check_same, run
    with tempfile.TemporaryDirectory() as d:
        hf_model(moe_config()).save_pretrained(d)
        from cvllm_lab.config import default_model_path
        from cvllm_lab.tokenizer import load_tokenizer
        gg = default_model_path()
        load_tokenizer(gg.parent, gg.name).save_pretrained(d)
        check_same(run(d, 2), run(d, 1))
