"""In-situ quantized models at tensor parallel 2 through the engine (CPU, gloo): the same answers as one process.

A tiny random Llama (hidden 256, intermediate 256: the row-parallel o_proj and down_proj keep 128 input features
per rank, whole W4A16 groups, GGUF blocks and MXFP4 groups) runs through `LLM(..., quantization=...)` at tensor parallel 1 and 2
on the paged, chunked, batched path. Each rank quantizes its own shard (`quant.base.quantize_parallel`): a
column-parallel shard is whole rows of the full weight and a row-parallel shard whole groups along K, so the
quantized weights of the two ranks are exactly the slices of TP 1's quantized weights. Only the order of the float
sums changes (two partial sums all-reduced instead of one), as for the dense model, so the tolerance is the dense
one: greedy tokens equal and prompt log-probs within 1e-4 (fp32 activations: the engine's exact CPU path,
`CVLLM_LAB_CPU_FAST_PATH=0`, as the test script runs it; the fast path's int4 kernel rounds each rank's partial
sum to bf16, so its TP 2 differs from TP 1 by bf16 rounding, not by the sharding). A GGUF superblock type (Q4_K, 256
weights along K) is refused at TP 2 with an error naming the layer, since 128 columns per rank would cut it.
The same model written as GPTQ and AWQ checkpoints (round to nearest, group 128) loads at TP 2 with each rank
taking its part of every packed tensor (`shard_w4a16_tensor`: whole 8-column words, whole groups) and gives TP 1's
answers.

"""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_tp_engine import check_same, run as _run, VOCAB  # noqa: E402
from cvllm_lab.engine.worker import WorkerError  # noqa: E402


def run(model: str, tp: int, **kw) -> dict:
    "`test_tp_engine.run` on the exact CPU path (`cpu_fast_path=False`: TP 1 is compared with TP 2, which has none)."
    return _run(model, tp, **{'cpu_fast_path': False, **kw})


def make_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab.config import default_model_path
    from cvllm_lab.tokenizer import load_tokenizer

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        attention_bias=True,
        initializer_range=0.1,
        architectures=['LlamaForCausalLM'],
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'):
                p.normal_(0, 0.05)
            elif 'norm' in n:
                p.normal_(1, 0.2)
    hf.save_pretrained(root)
    gg = default_model_path()
    load_tokenizer(gg.parent, gg.name).save_pretrained(root)
    return root


@pytest.fixture(scope='module')
def model():
    with tempfile.TemporaryDirectory() as d:
        yield str(make_model(Path(d)))


@pytest.mark.parametrize('method', ['q8_0', 'q4_0', 'w4a16', 'mxfp4'])
def test_quantized_tp2_matches_tp1(model, method):
    ref = run(model, 1, quantization=method)
    check_same(run(model, 2, quantization=method), ref)
    dense = run(model, 1)  # the quantization did change the model
    assert any(
        abs(a - b) > 1e-3 for g, r in zip(ref['prompt_logprobs'], dense['prompt_logprobs']) for a, b in zip(g[0], r[0])
    )


def test_fp8_block_cut_by_the_shard_is_refused(model):
    "In-situ FP8's 128 x 128 blocks: the k projection's 128 rows (2 KV heads of 64) over 2 ranks would cut a block."
    with pytest.raises(
        WorkerError, match=r'qkv_proj: output size 128 over 2 ranks gives 64 per rank, not a multiple of 128'
    ):
        run(model, 2, quantization='fp8')


def test_superblock_cut_by_the_shard_is_refused(model):
    "Q4_K's 256-weight superblocks along K: o_proj's 256 inputs over 2 ranks would cut each in half."
    with pytest.raises(
        WorkerError, match=r'o_proj: input size 256 over 2 ranks gives 128 per rank, not a multiple of 256'
    ):
        run(model, 2, quantization='q4k')


@pytest.mark.parametrize('fmt', ['gptq', 'awq'])
def test_w4a16_checkpoint_tp2_matches_tp1(model, fmt, tmp_path):
    from cvllm_lab.quant.gptq import convert_checkpoint

    d = str(convert_checkpoint(model, tmp_path / fmt, fmt, algo='rtn', progress=False))
    check_same(run(d, 2), run(d, 1))


def write_fp8_checkpoint(model: str, dst: Path, layout: str) -> str:
    "`model` with its decoder linears as an FP8 checkpoint: 'tensor' (AutoFP8 per-tensor), 'channel' (fbgemm_fp8), 'block'."
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from cvllm_lab.quant.fp8 import quantize_fp8_block, quantize_fp8_channel

    shutil.copytree(model, dst)
    sd, out = load_file(str(dst / 'model.safetensors')), {}
    for k, v in sd.items():
        if '.layers.' in k and k.endswith('_proj.weight'):
            mod = k[: -len('.weight')]
            if layout == 'block':
                out[k], out[mod + '.weight_scale_inv'] = quantize_fp8_block(v.float())
            else:
                out[k], s = quantize_fp8_channel(v.float(), per_tensor=layout == 'tensor')
                out[mod + '.weight_scale'] = s[0].reshape(()) if layout == 'tensor' else s[:, None]
        else:
            out[k] = v
    save_file(out, str(dst / 'model.safetensors'))
    cj = json.loads((dst / 'config.json').read_text())
    cj['quantization_config'] = {
        'tensor': {'quant_method': 'fp8', 'activation_scheme': 'dynamic'},
        'channel': {'quant_method': 'fbgemm_fp8', 'activation_scale_ub': 1200.0},
        'block': {'quant_method': 'fp8', 'activation_scheme': 'dynamic', 'weight_block_size': [128, 128]},
    }[layout]
    (dst / 'config.json').write_text(json.dumps(cj))
    return str(dst)


@pytest.mark.parametrize('layout', ['tensor', 'channel'])
def test_fp8_checkpoint_tp2_matches_tp1(model, layout, tmp_path):
    "Each rank loads its rows (column-parallel) or columns (row-parallel) of the e4m3 weights and their scales."
    d = write_fp8_checkpoint(model, tmp_path / layout, layout)
    check_same(run(d, 2), run(d, 1))


def test_fp8_block_checkpoint_cut_by_the_shard_is_refused(model, tmp_path):
    d = write_fp8_checkpoint(model, tmp_path / 'block', 'block')
    with pytest.raises(WorkerError, match=r'qkv_proj: rows/columns 0..64 of this rank cut a 128 x 128 FP8 block'):
        run(d, 2)


def write_gguf_file(dst: Path, qtype: str) -> str:
    """A tiny random Llama written as llama.cpp writes a GGUF (its metadata keys, Q/K rows permuted), decoder linears
    in `qtype` blocks; no tokenizer merges (the tests send token ids)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab.kernels.gguf_layout import parse_qtype
    from cvllm_lab.quant.gguf import quantize as gguf_quantize

    H, I, L, NH, NKV = 256, 256, 2, 4, 2
    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        initializer_range=0.1,
    )
    sd = {k: v.float() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    path = dst / f'tiny-{qtype}.gguf'
    w = gguf.GGUFWriter(str(path), 'llama')
    for add, v in (
        (w.add_block_count, L),
        (w.add_context_length, 256),
        (w.add_embedding_length, H),
        (w.add_feed_forward_length, I),
        (w.add_head_count, NH),
        (w.add_head_count_kv, NKV),
        (w.add_layer_norm_rms_eps, 1e-6),
        (w.add_rope_freq_base, 10000.0),
        (w.add_vocab_size, VOCAB),
    ):
        add(v)
    w.add_tokenizer_model('gpt2')
    w.add_token_list([f't{i}' for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_tensor('token_embd.weight', sd['model.embed_tokens.weight'].numpy())
    w.add_tensor('output_norm.weight', sd['model.norm.weight'].numpy())
    w.add_tensor('output.weight', sd['lm_head.weight'].numpy())
    names = {
        'attn_q': 'self_attn.q_proj',
        'attn_k': 'self_attn.k_proj',
        'attn_v': 'self_attn.v_proj',
        'attn_output': 'self_attn.o_proj',
        'ffn_gate': 'mlp.gate_proj',
        'ffn_up': 'mlp.up_proj',
        'ffn_down': 'mlp.down_proj',
    }
    for i in range(L):
        w.add_tensor(f'blk.{i}.attn_norm.weight', sd[f'model.layers.{i}.input_layernorm.weight'].numpy())
        w.add_tensor(f'blk.{i}.ffn_norm.weight', sd[f'model.layers.{i}.post_attention_layernorm.weight'].numpy())
        for g, hf in names.items():
            t = sd[f'model.layers.{i}.{hf}.weight']
            if g in ('attn_q', 'attn_k'):  # llama.cpp's converter permutes Q/K rows; the loader undoes it
                nh = NH if g == 'attn_q' else NKV
                t = t.reshape(nh, 2, t.shape[0] // nh // 2, -1).transpose(1, 2).reshape(t.shape)
            w.add_tensor(f'blk.{i}.{g}.weight', gguf_quantize(t, qtype).numpy(), raw_dtype=parse_qtype(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize('qtype', ['q8_0', 'q4_0'])
def test_gguf_file_tp2_matches_tp1(qtype, tmp_path):
    """A GGUF file kept in its blocks (`quantization='gguf'`, the exact CPU path at both sizes): each rank's blocks are
    cut from the file (rows whole, columns in whole blocks), giving TP 1's answers."""
    path = write_gguf_file(tmp_path, qtype)
    got = run(path, 2, skip_tokenizer_init=True, quantization='gguf')
    check_same(got, run(path, 1, skip_tokenizer_init=True, quantization='gguf'))


def test_gguf_file_superblock_cut_by_the_shard_is_refused(tmp_path):
    "Q4_K's 256-weight superblocks: o_proj's 256 inputs over 2 ranks would cut each in half."
    with pytest.raises(WorkerError, match=r'o_proj'):
        run(write_gguf_file(tmp_path, 'q4k'), 2, skip_tokenizer_init=True, quantization='gguf')
