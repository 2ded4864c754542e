"""KV capacity of an MLA model: how many tokens the latent paged cache holds at a `gpu_memory_utilization`, against
the same model with materialized per-head K/V in the same memory (`H (qk_nope + qk_rope + v_head_dim)` values per
token and layer instead of `kv_lora_rank + qk_rope_head_dim`).

    python -m benchmarks.mla_kv_capacity [model] [gpu_memory_utilization] [csv]     (default deepseek_v2_lite 0.9)

Dummy weights (the weights' memory is the real one); prints the engine's KV cache size and appends a row to `csv`."""

import sys
from pathlib import Path

import pandas as pd
import torch
import yaml

from cvllm_lab import LLM
from cvllm_lab.bench.sweep import model_dir


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else 'deepseek_v2_lite'
    util = float(sys.argv[2]) if len(sys.argv) > 2 else 0.9
    csv = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    spec = yaml.safe_load(open(f'conf/model/{model}.yaml'))
    hf = spec['hf_config']
    llm = LLM(
        str(model_dir(spec)),
        load_format='dummy',
        skip_tokenizer_init=True,
        gpu_memory_utilization=util,
        max_model_len=4096,
        progress=False,
    )
    r = llm.engine.runner
    kv_bytes, tokens = r.num_blocks * r.bytes_per_block, r.num_tokens_capacity
    e = torch.tensor([], dtype=r.kv_dtype).element_size()
    L, H = hf['num_hidden_layers'], hf['num_attention_heads']
    latent = L * (hf['kv_lora_rank'] + hf['qk_rope_head_dim']) * e
    materialized = L * H * (hf['qk_nope_head_dim'] + hf['qk_rope_head_dim'] + hf['v_head_dim']) * e
    row = dict(
        device=torch.cuda.get_device_name(),
        model=spec['name'],
        gpu_memory_utilization=util,
        kv_cache_gib=kv_bytes / 2**30,
        latent_bytes_per_token=latent,
        latent_tokens=tokens,
        materialized_bytes_per_token=materialized,
        materialized_tokens=kv_bytes // materialized,
        ratio=tokens / (kv_bytes // materialized),
    )
    print(row)
    assert abs(kv_bytes / tokens - latent) < 1e-6 * latent, (
        kv_bytes / tokens,
        latent,
    )  # the cache holds the latent only
    if csv:
        pd.DataFrame([row]).to_csv(csv, mode='a', header=not csv.exists(), index=False)


if __name__ == '__main__':
    main()
