"""In-situ quantized models at tensor parallel 2 through the engine (CPU, gloo): the same answers as one process.

A tiny random Llama (hidden 256, intermediate 256: the row-parallel o_proj and down_proj keep 128 input features
per rank, whole W4A16 groups and GGUF blocks) runs through `LLM(..., quantization=...)` at tensor parallel 1 and 2
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
from test_tp_engine import check_same, run, VOCAB  # noqa: E402
from cvllm_lab.engine.worker import WorkerError  # noqa: E402



def make_model(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    from cvllm_lab.config import default_model_path
    from cvllm_lab.tokenizer import load_tokenizer
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
                      bos_token_id=None, attention_bias=True, initializer_range=0.1, architectures=['LlamaForCausalLM'])
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith('bias'): p.normal_(0, 0.05)
            elif 'norm' in n: p.normal_(1, 0.2)
    hf.save_pretrained(root)
    gg = default_model_path()
    load_tokenizer(gg.parent, gg.name).save_pretrained(root)
    return root


@pytest.fixture(scope='module')
def model():
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        mp.setenv('CVLLM_LAB_CPU_FAST_PATH', '0')            # read by every runner, the spawned workers' too
        yield str(make_model(Path(d)))


@pytest.mark.parametrize('method', ['q8_0', 'q4_0', 'w4a16'])
def test_quantized_tp2_matches_tp1(model, method):
    ref = run(model, 1, quantization=method)
    check_same(run(model, 2, quantization=method), ref)
    dense = run(model, 1)                                   # the quantization did change the model
    assert any(abs(a - b) > 1e-3 for g, r in zip(ref['prompt_logprobs'], dense['prompt_logprobs'])
               for a, b in zip(g[0], r[0]))


def test_fp8_block_cut_by_the_shard_is_refused(model):
    "In-situ FP8's 128 x 128 blocks: the k projection's 128 rows (2 KV heads of 64) over 2 ranks would cut a block."
    with pytest.raises(WorkerError, match=r'qkv_proj: output size 128 over 2 ranks gives 64 per rank, not a multiple of 128'):
        run(model, 2, quantization='fp8')


def test_superblock_cut_by_the_shard_is_refused(model):
    "Q4_K's 256-weight superblocks along K: o_proj's 256 inputs over 2 ranks would cut each in half."
    with pytest.raises(WorkerError, match=r'o_proj: input size 256 over 2 ranks gives 128 per rank, not a multiple of 256'):
        run(model, 2, quantization='q4k')


@pytest.mark.parametrize('fmt', ['gptq', 'awq'])
def test_w4a16_checkpoint_tp2_matches_tp1(model, fmt, tmp_path):
    from cvllm_lab.quant.gptq import convert_checkpoint
    d = str(convert_checkpoint(model, tmp_path / fmt, fmt, algo='rtn', progress=False))
    check_same(run(d, 2), run(d, 1))
