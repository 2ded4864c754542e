"""Every dense model family at tensor parallel 2 (and Llama/Qwen3/StableLM at 4, KV heads replicated) against `transformers`.

Each rank builds the model inside a gloo group (so every parallel layer holds its slice), loads the full HF state
dict through `load_weights` (each `weight_loader` keeps its rank's part) and runs the same flat batch of three
prompts over a paged KV cache; rank 0's gathered logits must match HF's within 1e-4 (fp32). The vocabulary (250)
is not a multiple of the ranks' padding, so the last rank's embedding and LM-head rows are part padding. The MoE
families are in `tests/test_tp_moe.py`; here, an MoE whose expert width does not split over the ranks is refused
while the model is built, naming the dimension.
"""

import torch
import torch.multiprocessing as mp

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
)


def configs(names):
    import transformers as T

    def c(cls, arch, eager=False, **kw):
        cfg = getattr(T, cls)(**{**BASE, **kw})
        cfg.architectures = [arch]
        if eager:
            cfg._attn_implementation = 'eager'
        return cfg

    all_ = {
        'llama': lambda: c('LlamaConfig', 'LlamaForCausalLM', attention_bias=True),
        'llama_tied': lambda: c('LlamaConfig', 'LlamaForCausalLM', tie_word_embeddings=True, head_dim=32),
        'mistral': lambda: c('MistralConfig', 'MistralForCausalLM', eager=True, sliding_window=8),
        'qwen2': lambda: c('Qwen2Config', 'Qwen2ForCausalLM'),
        'qwen3': lambda: c('Qwen3Config', 'Qwen3ForCausalLM', head_dim=32),
        'phi3': lambda: c('Phi3Config', 'Phi3ForCausalLM', partial_rotary_factor=0.75),
        'gemma2': lambda: c(
            'Gemma2Config',
            'Gemma2ForCausalLM',
            eager=True,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
        'glm4': lambda: c('Glm4Config', 'Glm4ForCausalLM', partial_rotary_factor=0.5, attention_bias=True),
        'stablelm': lambda: c('StableLmConfig', 'StableLmForCausalLM', use_parallel_residual=True, use_qkv_bias=True),
        'stablelm_qk': lambda: c('StableLmConfig', 'StableLmForCausalLM', qk_layernorm=True),  # per-head norms, split
    }
    return {n: all_[n]() for n in names}


def hf_model(cfg, seed=0):
    "The HF model in fp32 (the same on every rank: same seed), norms and biases off their init values."
    import transformers as T

    torch.manual_seed(seed)
    hf = getattr(T, cfg.architectures[0])(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.1)
            elif 'norm' in n:
                p.normal_(0 if 'Gemma' in cfg.architectures[0] else 1, 0.3)  # Gemma's scale is 1 + w
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
        for name, cfg in configs(names).items():
            hf = hf_model(cfg)
            ours = get_model_class(cfg)(cfg)
            check_tensor_parallel(ours)
            ours.load_weights(hf.state_dict().items())
            ctx, nb = prefill_context(list(lens), 16)
            bind_kv_cache(ours, nb, 16)
            with torch.no_grad(), set_forward_context(ctx):
                logits = ours.compute_logits(ours(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))
                if rank == 0:
                    ref = torch.cat([hf(p[None]).logits[0] for p in prompts])
                    res[name] = (logits - ref).abs().max().item()
                else:
                    assert logits is None
            heads = ours.model.layers[0].self_attn
            res[f'{name}.heads'] = (heads.H, heads.Hkv)
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


def test_dense_families_at_tp2_match_hf():
    names = ['llama', 'llama_tied', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'glm4', 'stablelm', 'stablelm_qk']
    res = run_ranks(2, names)
    for n in names:
        assert res[n] < 1e-4, (n, res[n])
    assert res['llama.heads'] == (2, 1)  # 4 query heads, 2 KV heads over 2 ranks


def test_tp4_replicates_kv_heads():
    res = run_ranks(4, ['llama', 'qwen3', 'stablelm_qk'])
    for n in ('llama', 'qwen3', 'stablelm_qk'):
        assert res[n] < 1e-4, (n, res[n])
    assert res['llama.heads'] == (1, 1)  # 2 KV heads over 4 ranks: each held by 2 ranks


def _refuse(rank, world, port, q):
    import transformers as T
    from cvllm_lab.models.registry import get_model_class

    ps.init_distributed(ps.DistInit(rank, world, rank, '127.0.0.1', port), timeout_s=60)
    try:
        moe = T.Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=33)
        moe.architectures = ['Qwen3MoeForCausalLM']
        try:
            get_model_class(moe)(moe)
            msg = 'built'
        except ValueError as e:
            msg = str(e)
        if rank == 0:
            q.put(msg)
    finally:
        ps.destroy_distributed()


def test_moe_with_indivisible_experts_refuses_tp2():
    q = mp.get_context('spawn').SimpleQueue()
    mp.spawn(_refuse, args=(2, ps.free_port(), q), nprocs=2, join=True)
    assert 'expert intermediate size 33 is not divisible by the tensor-parallel size 2' in q.get()
