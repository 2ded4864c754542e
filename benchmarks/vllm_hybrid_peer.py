"""vLLM 0.26 on a hybrid model's shape (issue 41), for a comparison in the same lease as our `+sweep=hybrid_h100`.

On a GPU machine after `../shared/vllm_peer`'s wheelhouse is installed in /tmp/site (its README):

    PYTHONPATH=/tmp/site:/tmp/wh python3 benchmarks/vllm_hybrid_peer.py qwen3_5_35b_a3b OUT.csv

Writes a folder with the model's config (from our `conf/model/<name>.yaml`, so both engines build the same shape) and
the peer kit's small byte-level tokenizer, loads it with `load_format="dummy"` in bf16, and times each point of
`conf/sweep/hybrid_h100.yaml` as the peer kit's `vllm_peer2.py` does: a generate of 1 token (prefill) and of 129
(prefill + 128 decode steps) on the same fresh random prompts, decode tok/s = batch x 128 / the difference. One CSV row
per point.
"""

from __future__ import annotations
import csv
import json
import os
import random
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def model_dir(name: str, d: Path) -> Path:
    "Our model config at its real shape, as a folder vLLM loads with dummy weights."
    import vllm_peer  # the peer kit (../shared/vllm_peer), carried to /tmp/wh

    vllm_peer.make_model_dir(str(d))  # the tokenizer (and a Llama config, replaced below)
    cfg = yaml.safe_load((ROOT / f'conf/model/{name}.yaml').read_text())['hf_config']
    cfg |= {'torch_dtype': 'bfloat16', 'dtype': 'bfloat16', 'bos_token_id': 0, 'eos_token_id': 1}
    (d / 'config.json').write_text(json.dumps(as_vllm_registers(cfg), indent=1))
    return d


def as_vllm_registers(cfg: dict) -> dict:
    """vLLM 0.26 registers Qwen3.5 only as the image-text model (`Qwen3_5[Moe]ForConditionalGeneration`, its text
    model inside): the text config goes in `text_config`, its RoPE as the multimodal RoPE it expects (for text, each
    section gets the same positions, so it is the text model's RoPE), and `LLM(limit_mm_per_prompt=0)` leaves the
    vision tower out."""
    arch = cfg['architectures'][0]
    if arch not in ('Qwen3_5ForCausalLM', 'Qwen3_5MoeForCausalLM'):
        return cfg
    moe = 'Moe' in arch
    rope = cfg['rope_parameters'] | {'mrope_section': [11, 11, 10], 'mrope_interleaved': True}
    text = cfg | {'rope_parameters': rope, 'architectures': None}
    return {
        'architectures': [f'Qwen3_5{"Moe" if moe else ""}ForConditionalGeneration'],
        'model_type': 'qwen3_5_moe' if moe else 'qwen3_5',
        'text_config': text,
        'tie_word_embeddings': cfg.get('tie_word_embeddings', False),
        'torch_dtype': 'bfloat16',
    }


def points() -> list[dict]:
    return yaml.safe_load((ROOT / 'conf/sweep/hybrid_h100.yaml').read_text())['points']


def main(name: str, out: str):
    os.environ.setdefault('VLLM_USE_FLASHINFER_SAMPLER', '0')  # no FlashInfer on the GPU machines
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    d = model_dir(name, Path(f'/tmp/{name}-peer'))
    t0 = time.time()
    llm = LLM(
        model=str(d),
        load_format='dummy',
        dtype='bfloat16',
        max_model_len=8192,
        max_num_seqs=64,
        gpu_memory_utilization=0.95,
        seed=0,
        limit_mm_per_prompt={'image': 0, 'video': 0},
    )
    init_s = time.time() - t0
    rng = random.Random(0)

    def timed(bs: int, n: int, out_len: int, prompts=None) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    def fresh(bs: int, n: int):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(3, 2000) for _ in range(n)]) for _ in range(bs)]

    timed(4, 64, 16, fresh(4, 64))  # warm-up
    rows = []
    for p in points():
        bs, n = p['batch_size'], p['prompt_len']
        row = dict(engine=f'vllm {__version__}', model=name, batch_size=bs, prompt_len=n, init_s=round(init_s, 1))
        try:
            t1 = timed(bs, n, 1, fresh(bs, n))  # fresh prompts each time: no prefix-cache hit
            t2 = timed(bs, n, 129, fresh(bs, n))
            row |= dict(
                prefill_tok_s=round(bs * n / t1, 1),
                decode_tok_s=round(bs * 128 / max(t2 - t1, 1e-9), 1),
                decode_ms_step=round((t2 - t1) / 128 * 1e3, 3),
            )
        except Exception as e:  # a point that does not fit is a row that says so
            row['error'] = repr(e)[:300]
        print(row, flush=True)
        rows.append(row)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    with open(out, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == '__main__':
    main(*sys.argv[1:3])
