"""Decode tok/s with a kernel's tuned configs for this GPU against without them, on one GPU: per format two
engines in one process, built alike except that the second captures its CUDA graphs without the tuned table (the
graphs keep the kernels they were captured with), timed alternately.

    python -m benchmarks.config_ab [--kernel paged_attention] [--points none:1:32,none:16:2048,...]
                                   [--repeats 3] [--model llama3_8b] [--max-model-len 4096]

`paged_attention`: the decode attention's tuned tables (`configs/paged_attention/<device>.json`) against its
`default` config. Another kernel whose launcher looks its table up through one module function joins `UNTUNED`,
as does a fast path switched by one function (`fp32_stream`: the Llama layers' fp32 residual stream against the
fused bf16 adds; `w4a16_mma`: the MMA kernel against the GEMV; `deferred_norm`, run with `CVLLM_LAB_DEFER_NORMS=1`:
the fp32 stream's norms split around their matmuls against a norm kernel each).

A point is `quantization:batch:prompt_len` (`none`: the checkpoint's dtype); decode tok/s is batch x 128 /
(t(129 tokens) - t(1 token)) of fresh random prompts, as the sweep measures it. Printed per point: each engine's
repeats, sorted, and the ratio of the medians.
"""

import statistics
import time

import torch
import yaml

from benchmarks.kernels.common import arg
from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir
from cvllm_lab.kernels import paged_attention as pa
from cvllm_lab.kernels import tuned
from cvllm_lab.kernels import w4a16 as KW
from cvllm_lab.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from cvllm_lab.sampling_params import SamplingParams


# kernel -> (module, the lookup to replace, what it returns without the tuned table)
UNTUNED = {
    'paged_attention': (
        pa,
        'decode_config',
        lambda *a, **k: pa.configs_for('paged_attention', torch.device('cuda'))['default'],
    ),
    'w4a16_mma': (KW, 'mma_supported', lambda *a, **k: False),  # 'untuned': the kernels before it
    'fp32_stream': (LlamaForCausalLM, 'fp32_stream', lambda *a, **k: False),  # 'untuned': bf16 residual adds
    'deferred_norm': (LlamaDecoderLayer, 'defers_norms', lambda *a, **k: False),
}  # 'untuned': norm kernels


def engine(path, quant, max_model_len, max_seqs, kernel: str | None):
    "An engine on dummy weights; with `kernel`, its graphs captured without that kernel's tuned table."
    mod, fn, untuned = UNTUNED[kernel] if kernel else (None, None, None)
    tuned = mod and getattr(mod, fn)
    if mod:
        setattr(mod, fn, untuned)
    try:
        return LLM(
            path,
            load_format='dummy',
            skip_tokenizer_init=True,
            quantization=None if quant == 'none' else quant,
            progress=False,
            max_model_len=max_model_len,
            max_num_seqs=max_seqs,
            kv_cache_memory=12 << 30,
            enable_prefix_caching=False,
        )  # t(1) must prefill as t(129) did
    finally:
        if mod:
            setattr(mod, fn, tuned)


def decode_tok_s(llm, B, P, g):
    sp = lambda O: SamplingParams(temperature=0, max_tokens=O, ignore_eos=True, detokenize=False)
    prompts = [{'prompt_token_ids': torch.randint(100, 30000, (P,), generator=g).tolist()} for _ in range(B)]

    def t(O):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, sp(O), use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return B * 128 / (t(129) - t(1))


def main():
    points = [
        (q, int(b), int(p))
        for q, b, p in (
            s.split(':') for s in arg('--points', 'none:1:32,none:16:2048,none:64:1024,w4a16:1:32').split(',')
        )
    ]
    repeats, mml, kernel = (
        int(arg('--repeats', 3)),
        int(arg('--max-model-len', 4096)),
        arg('--kernel', 'paged_attention'),
    )
    path = str(model_dir(yaml.safe_load(open(f'conf/model/{arg("--model", "llama3_8b")}.yaml'))))
    tables = pa.configs_for(kernel, torch.device('cuda')) if (tuned.CONFIG_DIR / kernel).is_dir() else '(a switch)'
    print(f'{torch.cuda.get_device_name()}: {kernel} tables {tables}', flush=True)
    for quant in dict.fromkeys(q for q, _, _ in points):
        mine = [(b, p) for q, b, p in points if q == quant]
        seqs = max(b for b, _ in mine)
        eng = {'tuned': engine(path, quant, mml, seqs, None), 'untuned': engine(path, quant, mml, seqs, kernel)}
        for B, P in mine:
            res = {k: [] for k in eng}
            for name, llm in eng.items():
                decode_tok_s(llm, B, P, torch.Generator().manual_seed(0))  # warm-up
            for r in range(repeats):
                for name, llm in eng.items() if r % 2 == 0 else reversed(eng.items()):
                    res[name].append(decode_tok_s(llm, B, P, torch.Generator().manual_seed(r + 1)))
            print(
                f'{quant} batch {B} prompt {P}: tuned {sorted(round(x) for x in res["tuned"])} untuned '
                f'{sorted(round(x) for x in res["untuned"])} tok/s, ratio '
                f'{statistics.median(res["tuned"]) / statistics.median(res["untuned"]):.3f}',
                flush=True,
            )
        del eng
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
