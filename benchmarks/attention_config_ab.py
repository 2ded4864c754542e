"""Decode tok/s with the tuned decode-attention configs (`kernels/configs/paged_attention/<device>.json`) against the
launcher's `default`, on one GPU: per format two engines in one process, built alike except that the second
captures its CUDA graphs with `default` (the graphs keep the config they were captured with), timed alternately.

    python -m benchmarks.attention_config_ab [--points none:1:32,none:16:2048,none:64:1024,w4a16:1:32]
                                             [--repeats 3] [--model llama3_8b] [--max-model-len 4096]

A point is `quantization:batch:prompt_len` (`none`: the checkpoint's dtype); decode tok/s is batch x 128 /
(t(129 tokens) - t(1 token)) of fresh random prompts, as the sweep measures it. Printed per point: each engine's
repeats, sorted, and the ratio of the medians.
"""
import statistics
import sys
import time

import torch
import yaml

from benchmarks.kernels.common import arg
from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir
from cvllm_lab.kernels import paged_attention as pa
from cvllm_lab.sampling_params import SamplingParams


def engine(path, quant, max_model_len, max_seqs, default_attention: bool):
    "An engine on dummy weights; `default_attention`: its graphs captured with the decode config `default`."
    tuned = pa.decode_config
    if default_attention: pa.decode_config = lambda *a, **k: pa.configs_for('paged_attention', torch.device('cuda'))['default']
    try:
        return LLM(path, load_format='dummy', skip_tokenizer_init=True, quantization=None if quant == 'none' else quant,
                   progress=False, max_model_len=max_model_len, max_num_seqs=max_seqs, kv_cache_memory=12 << 30,
                   enable_prefix_caching=False)   # t(1) must prefill as t(129) did
    finally: pa.decode_config = tuned


def decode_tok_s(llm, B, P, g):
    sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
    prompts = [{'prompt_token_ids': torch.randint(100, 30000, (P,), generator=g).tolist()} for _ in range(B)]
    def t(O):
        torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(prompts, sp(O), use_tqdm=False)
        torch.cuda.synchronize(); return time.perf_counter() - t0
    return B * 128 / (t(129) - t(1))


def main():
    points = [(q, int(b), int(p)) for q, b, p in (s.split(':') for s in
              arg('--points', 'none:1:32,none:16:2048,none:64:1024,w4a16:1:32').split(','))]
    repeats, mml = int(arg('--repeats', 3)), int(arg('--max-model-len', 4096))
    path = str(model_dir(yaml.safe_load(open(f"conf/model/{arg('--model', 'llama3_8b')}.yaml"))))
    print(f'{torch.cuda.get_device_name()}: tuned tables {pa.configs_for("paged_attention", torch.device("cuda"))}', flush=True)
    for quant in dict.fromkeys(q for q, _, _ in points):
        mine = [(b, p) for q, b, p in points if q == quant]
        seqs = max(b for b, _ in mine)
        eng = {'tuned': engine(path, quant, mml, seqs, False), 'default': engine(path, quant, mml, seqs, True)}
        for B, P in mine:
            res = {k: [] for k in eng}
            for name, llm in eng.items(): decode_tok_s(llm, B, P, torch.Generator().manual_seed(0))   # warm-up
            for r in range(repeats):
                for name, llm in (eng.items() if r % 2 == 0 else reversed(eng.items())):
                    res[name].append(decode_tok_s(llm, B, P, torch.Generator().manual_seed(r + 1)))
            cfg = pa.decode_config(B, 256 if P + 129 <= 256 and B <= 32 else mml, 128, torch.device('cuda'))
            print(f'{quant} batch {B} prompt {P}: tuned {sorted(round(x) for x in res["tuned"])} default '
                  f'{sorted(round(x) for x in res["default"])} tok/s, ratio '
                  f'{statistics.median(res["tuned"]) / statistics.median(res["default"]):.3f} (tuned config {cfg})', flush=True)
        del eng; torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
