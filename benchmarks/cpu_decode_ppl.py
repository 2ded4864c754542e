"""Perplexity of the CPU fast path's *decode* steps (the `CPUDecoderLayer` path), against the fp32 model: the
committed text (`data/ppl_text.txt`) as B streams of N tokens, each token after the first fed as one decode step
(teacher forcing), B sequences per step. `python -m benchmarks.cpu_decode_ppl [B] [N]` from the repository root
(default 16 streams of 128 tokens, then 1 stream of 256)."""

import dataclasses
import math
import sys
import time
from pathlib import Path
import torch
from cvllm_lab.config import EngineConfig, default_model_path
from cvllm_lab.weights.loader import load_model, load_hf_config, resolve_model_source
from cvllm_lab.tokenizer import load_tokenizer
from cvllm_lab.utils.context import ForwardContext, bind_kv_cache, prefill_context, set_forward_context
from cvllm_lab.engine.model_runner import ModelRunner


@torch.inference_mode()
def decode_ppl(model, logits, streams: torch.Tensor) -> float:
    "exp(mean NLL) of `streams` `[B, N]`: token 0 prefilled, tokens 1.. each predicted by a decode step."
    B, N = streams.shape
    ctx, nb = prefill_context([N] * B, 16)  # consecutive blocks per stream
    bind_kv_cache(model, nb, 16)
    bt, nll = ctx.block_tables, 0.0
    for s in range(N - 1):
        L = torch.full((B,), s + 1, dtype=torch.int32)
        slots = bt[:, s // 16].long() * 16 + s % 16
        c = ForwardContext(slots, torch.arange(B + 1, dtype=torch.int32), L, bt, 1, s + 1)
        with set_forward_context(c):
            h = model(streams[:, s].contiguous(), torch.full((B,), s, dtype=torch.long))
        lp = torch.log_softmax(logits(h).float(), -1)
        nll -= lp.gather(1, streams[:, s + 1, None]).sum().item()
    return math.exp(nll / (B * (N - 1)))


gguf = default_model_path()
hcfg = load_hf_config(resolve_model_source(gguf))
ids = torch.tensor(load_tokenizer(gguf.parent, gguf.name).encode(Path('data/ppl_text.txt').read_text()))
cfg = EngineConfig(model=str(gguf), device='cpu', max_model_len=1024, kv_cache_memory=8 << 20).finalize(
    hcfg.max_position_embeddings
)
base = load_model(cfg, hcfg, progress=False)
fast = ModelRunner(dataclasses.replace(cfg, cpu_fast_path=True), hcfg, resolve_model_source(gguf), progress=False)
shapes = [(int(sys.argv[1]), int(sys.argv[2]))] if len(sys.argv) > 2 else [(16, 128), (1, 256)]
for B, N in shapes:
    streams = ids[: B * N].view(B, N)
    t = time.time()
    pb = decode_ppl(base, base.compute_logits, streams)
    tb = time.time() - t
    t = time.time()
    pf = decode_ppl(fast.model, fast.compute_logits, streams)
    tf = time.time() - t
    print(
        f'B={B} N={N}: fp32 {pb:.3f} ({tb:.0f} s), fast path {pf:.3f} ({tf:.0f} s): {100 * (pf / pb - 1):+.2f}%  '
        f'(layers: {type(fast.model.model.layers[0]).__name__})'
    )
