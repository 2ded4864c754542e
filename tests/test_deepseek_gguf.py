"""DeepSeek V2 / V3 GGUF files (llama.cpp arch `deepseek2`) read by `models.deepseek_v2`: tiny random models written
with `gguf.GGUFWriter` as llama.cpp's converter writes them (metadata keys, `gguf`'s tensor names, stacked experts,
`kv_b_proj` split into `attn_k_b` (transposed) and `attn_v_b`, or whole as older files have it; F32, F16 and Q8_0
tensors) must give the config the HF one had and the logits of the same weights loaded from safetensors.
"""

import numpy as np
import pytest
import torch

from cvllm_lab.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    deepseek_config_from_gguf,
    iterate_deepseek_gguf,
)
from cvllm_lab.models.llama import compare_with_hf

from test_models_deepseek import tiny_hf


def read_safetensors(d):
    from cvllm_lab.weights.loader import iterate_safetensors

    return dict(iterate_safetensors(d, progress=False))


def write_gguf(sd, cfg, path, qtype='F32', split_kv_b=True):
    """llama.cpp's `DeepseekV2Model` conversion of the checkpoint `sd` (tensor names from `gguf`'s map, experts
    stacked, `kv_b_proj` split); `qtype` for 2-D weights whose rows are a multiple of 32 values (Q8_0's block), norms
    and biases F32. Returns the file's tensors dequantized, under checkpoint names (experts per expert, kv_b whole)."""
    import gguf

    n, H, P, V = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = gguf.GGUFWriter(str(path), 'deepseek2')
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(1)  # MLA as MQA, as llama.cpp writes it
    w.add_rope_freq_base(cfg.rope_parameters['rope_theta'])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(P + cfg.qk_rope_head_dim)
    w.add_value_length_mla(V)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if cfg.model_type == 'deepseek_v3' else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if cfg.n_group:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rp = cfg.rope_parameters
    if rp.get('rope_type') == 'yarn':
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp['factor'])
        w.add_rope_scaling_orig_ctx_len(rp['original_max_position_embeddings'])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp['mscale_all_dim'])
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n)
    sd = {k: v.float() for k, v in sd.items()}
    tensors = {}
    for i in range(n):  # experts stacked, kv_b split (llama.cpp's modify_tensors)
        p = f'model.layers.{i}.'
        if f'{p}mlp.experts.0.gate_proj.weight' in sd:
            for m in ('gate', 'up', 'down'):
                tensors[f'{p}mlp.experts.{m}_proj.weight'] = torch.stack(
                    [sd.pop(f'{p}mlp.experts.{e}.{m}_proj.weight') for e in range(cfg.n_routed_experts)]
                )
        if split_kv_b:
            kv_b = sd.pop(f'{p}self_attn.kv_b_proj.weight').view(H, P + V, -1)
            tensors[f'{p}self_attn.k_b_proj.weight'] = kv_b[:, :P].transpose(1, 2).contiguous()
            tensors[f'{p}self_attn.v_b_proj.weight'] = kv_b[:, P:].contiguous()
    tensors |= sd
    stored = {}
    for name, t in tensors.items():
        gname = tmap.get_name(
            name.replace('e_score_correction_bias', 'e_score_correction.bias'), try_suffixes=('.weight', '.bias')
        )
        assert gname is not None, name
        a = t.numpy()
        q = getattr(gguf.GGMLQuantizationType, qtype)
        if t.dim() < 2 or a.shape[-1] % 32:
            q = gguf.GGMLQuantizationType.F32
        data = (
            a.astype(np.float16)
            if q == gguf.GGMLQuantizationType.F16
            else (gguf.quants.quantize(a, q) if q != gguf.GGMLQuantizationType.F32 else a)
        )
        w.add_tensor(
            gname,
            data,
            raw_dtype=q if q not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None,
        )
        stored[name] = torch.from_numpy(gguf.quants.dequantize(data, q).copy()).view(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = {}
    for k, t in stored.items():  # back to the checkpoint's layout, in torch
        if k.endswith('.k_b_proj.weight'):
            v = stored[k.replace('k_b_proj', 'v_b_proj')]
            out[k.replace('k_b_proj', 'kv_b_proj')] = torch.cat([t.transpose(1, 2), v], 1).reshape(-1, t.shape[1])
        elif '.mlp.experts.' in k:
            out |= {k.replace('experts.', f'experts.{e}.'): t[e] for e in range(t.shape[0])}
        elif not k.endswith('.v_b_proj.weight'):
            out[k] = t
    return out


def logits(model, lens=(7, 19), seed=0):
    "Our model's logits of a flat prefill batch of random prompts."
    from cvllm_lab.utils.context import bind_kv_cache, prefill_context, set_forward_context

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lens]
    ctx, nb = prefill_context(list(lens), 16)
    bind_kv_cache(model, nb, 16)
    with torch.no_grad(), set_forward_context(ctx):
        return model.compute_logits(model(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens])))


@pytest.mark.parametrize(
    'v3,qtype,split',
    [
        (False, 'F32', True),
        (True, 'F32', True),
        (False, 'F32', False),
        (True, 'F16', True),
        (False, 'Q8_0', True),
        (True, 'Q8_0', True),
    ],
)
def test_gguf_matches_safetensors(tmp_path, v3, qtype, split):
    """The file's config equals the HF one; our model from the GGUF gives the logits of our model loaded from
    safetensors holding the same (for F16/Q8_0: the file's rounded) weights, and at F32 HF's own."""
    from safetensors.torch import save_file

    hf, d = tiny_hf(v3, seed=3)
    path = tmp_path / 'tiny.gguf'
    sd = read_safetensors(d)
    stored = write_gguf(sd, hf.config, path, qtype, split)
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = deepseek_config_from_gguf(
        {k: f.contents() for k, f in reader.fields.items()}, [t.name for t in reader.tensors]
    )
    ref_cfg = hf.config
    for k in (
        'vocab_size',
        'hidden_size',
        'intermediate_size',
        'moe_intermediate_size',
        'num_hidden_layers',
        'num_attention_heads',
        'kv_lora_rank',
        'q_lora_rank',
        'qk_rope_head_dim',
        'qk_nope_head_dim',
        'v_head_dim',
        'n_routed_experts',
        'num_experts_per_tok',
        'n_shared_experts',
        'first_k_dense_replace',
        'n_group',
        'topk_group',
        'routed_scaling_factor',
        'norm_topk_prob',
        'max_position_embeddings',
        'tie_word_embeddings',
    ):
        assert getattr(cfg, k) == getattr(ref_cfg, k), (k, getattr(cfg, k), getattr(ref_cfg, k))
    assert cfg.model_type == ref_cfg.model_type and cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps)
    if not v3:
        assert cfg.topk_method == ref_cfg.topk_method == 'group_limited_greedy'
    cls = DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM
    ours = cls(cfg)
    ours.load_weights(iterate_deepseek_gguf(path))
    (tmp_path / 'st').mkdir()
    save_file({k: v.contiguous() for k, v in stored.items()}, str(tmp_path / 'st' / 'model.safetensors'))
    ref = cls(ref_cfg)
    ref.load_weights(read_safetensors(tmp_path / 'st').items())
    torch.testing.assert_close(logits(ours), logits(ref), atol=1e-5, rtol=0)
    if qtype == 'F32':
        assert compare_with_hf(hf, ours, lens=(7, 19)) < 1e-4
    else:  # it did round: the file's experts are not the original ones
        k = 'model.layers.1.mlp.experts.0.gate_proj.weight'
        assert not torch.equal(stored[k], sd[k].float())


def test_yarn_metadata_round_trip(tmp_path):
    "V2-Lite's YaRN fields survive the metadata (mscale_all_dim stored as 0.1 * it, llama.cpp's yarn_log_multiplier)."
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM as HF

    yarn = {
        'rope_type': 'yarn',
        'factor': 4.0,
        'original_max_position_embeddings': 32,
        'mscale': 0.707,
        'mscale_all_dim': 0.707,
        'beta_fast': 32.0,
        'beta_slow': 1.0,
        'rope_theta': 10000.0,
    }
    cfg = DeepseekV2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        rope_parameters=yarn,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf = HF(cfg).eval()
    hf.save_pretrained(tmp_path / 'hf')
    path = tmp_path / 'yarn.gguf'
    write_gguf(read_safetensors(tmp_path / 'hf'), cfg, path)
    import gguf

    reader = gguf.GGUFReader(str(path))
    ours_cfg = deepseek_config_from_gguf(
        {k: f.contents() for k, f in reader.fields.items()}, [t.name for t in reader.tensors]
    )
    rp = ours_cfg.rope_parameters
    assert rp['rope_type'] == 'yarn' and rp['factor'] == 4.0 and rp['original_max_position_embeddings'] == 32
    assert rp['mscale_all_dim'] == pytest.approx(0.707) and ours_cfg.topk_method == 'greedy'
    ours = DeepseekV2ForCausalLM(ours_cfg)
    ours.load_weights(iterate_deepseek_gguf(path))
    assert compare_with_hf(hf, ours, lens=(9, 40)) < 1e-4


@pytest.mark.parametrize('v3', [False, True])
def test_keep_quantized_linears(tmp_path, v3):
    """`keep_quantized`: the Q8_0 decoder linears load as `GGUFLinear` through `quant.apply.load_quantized` (V3's
    q_a / kv_a halves as one merged layer), `kv_b_proj` and the experts float, and the logits equal the float load's."""
    from cvllm_lab.quant.checkpoint import load_quantized
    from cvllm_lab.quant.gguf import GGUFLinear

    hf, d = tiny_hf(v3, seed=3)
    path = tmp_path / 'q8.gguf'
    write_gguf(read_safetensors(d), hf.config, path, 'Q8_0')
    cls = DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM
    flt, q = cls(hf.config), cls(hf.config)
    flt.load_weights(iterate_deepseek_gguf(path))
    load_quantized(q, iterate_deepseek_gguf(path, keep_quantized=True), {'method': 'gguf'}, progress=False)
    attn = q.model.layers[1].self_attn
    quantized = ['fused_qkv_a_proj', 'o_proj'] if v3 else ['q_proj', 'kv_a_proj_with_mqa', 'o_proj']
    assert all(isinstance(getattr(attn, n), GGUFLinear) for n in quantized)
    assert not isinstance(attn.kv_b_proj, GGUFLinear) and isinstance(
        q.model.layers[1].mlp.shared_experts.down_proj, GGUFLinear
    )
    torch.testing.assert_close(logits(q), logits(flt), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------- through the engine


@pytest.mark.parametrize('v3', [False, True])
def test_q8_gguf_through_the_engine(tmp_path, v3):
    """`LLM('tiny-Q8_0.gguf')` on the CPU: its linears kept quantized (the CPU path loads GGUFs that way), prompt
    log-probs and 8 greedy tokens of `transformers`' model holding the file's (rounded) weights. 5e-3: the CPU fast
    path's own numerics (it differs by 4e-3 from the float load too; 1e-6 with CVLLM_LAB_CPU_FAST_PATH=0)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from cvllm_lab import LLM, SamplingParams
    from cvllm_lab.quant.gguf import GGUFLinear

    hf, d = tiny_hf(v3, seed=4)
    path = tmp_path / 'tiny-Q8_0.gguf'
    stored = write_gguf(read_safetensors(d), hf.config, path, 'Q8_0')
    (tmp_path / 'st').mkdir()
    save_file({k: v.contiguous() for k, v in stored.items()}, str(tmp_path / 'st' / 'model.safetensors'))
    hf.config.save_pretrained(tmp_path / 'st')
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / 'st', dtype=torch.float32).eval()
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype='float32',
        progress=False,
        block_size=4,
        max_model_len=64,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        kv_cache_memory=8 << 20,
    )
    model = llm.engine.runner.model
    assert type(model).__name__ == ('DeepseekV3ForCausalLM' if v3 else 'DeepseekV2ForCausalLM')
    if llm.engine.runner.gguf:
        assert isinstance(model.model.layers[1].self_attn.o_proj, GGUFLinear)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19)]
    outs = llm.generate(
        [{'prompt_token_ids': p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=-1, ignore_eos=True),
        use_tqdm=False,
    )
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            lp = torch.log_softmax(ref(torch.tensor([p])).logits[0], -1)[:-1]
            got = torch.tensor([[x[t].logprob for t in range(256)] for x in o.prompt_logprobs[1:]])
            torch.testing.assert_close(got, lp, atol=5e-3, rtol=0)
            gen = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
                0, len(p) :
            ].tolist()
            assert o.outputs[0].token_ids == gen
