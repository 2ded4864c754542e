"""How many experts a decode step of a dummy-weight MoE model routes to: counts the distinct top-k expert ids of every
MoE layer in the decode steps of `batch` fresh prompts (eager, so that the router runs in Python each step), beside
what uniform random routing would give, `E (1 - (1 - k / E)^B)` (the figure the sweep's active-expert roofline uses).

    python -m benchmarks.moe_routing_probe MODEL BATCH PROMPT_LEN      (e.g. deepseek_v2_lite 64 1024; CUDA)

The dummy weights are the loader's `load_format='dummy'` (uniform in +-1e-3 for every parameter, as vLLM's), so the
count says whether a peer's dummy-weight decode figure could come from a step reading fewer experts."""

import sys
from pathlib import Path

import numpy as np
import torch

import cvllm_lab.layers.fused_moe as fm
import cvllm_lab.models.deepseek_v2 as dsv2
from benchmarks.serve_load import write_dummy_model
from cvllm_lab import LLM
from cvllm_lab.sampling_params import SamplingParams


def main():
    model, B, P = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = write_dummy_model(model, Path('/tmp/moe_routing_probe') / model)
    counts, E = [], {}
    select = fm.select_experts

    def counting(logits, top_k, renorm, *a, **k):
        w, ids = select(logits, top_k, renorm, *a, **k)
        if ids.shape[0] == B:
            counts.append(int(torch.unique(ids).numel()))
            E['n'] = logits.shape[-1]  # a decode step
        return w, ids

    fm.select_experts = dsv2.select_experts = counting  # the names the MoE layer and DeepSeek's router call
    llm = LLM(
        model=str(Path('/tmp/moe_routing_probe') / model),
        load_format='dummy',
        enforce_eager=True,
        max_model_len=max(4096, P + 64),
        gpu_memory_utilization=0.85,
        progress=False,
    )
    rng = np.random.default_rng(0)
    V, k = spec['hf_config']['vocab_size'], spec['hf_config']['num_experts_per_tok']
    prompts = [{'prompt_token_ids': rng.integers(10, V, P).tolist()} for _ in range(B)]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    n = E['n']
    print(
        f'{model} B={B}: decode-step MoE layers route to {np.mean(counts):.1f} of {n} experts on average '
        f'(min {min(counts)}, max {max(counts)}; uniform random routing would give {n * (1 - (1 - k / n) ** B):.1f}); '
        f'distinct first generated tokens {len(set(o.outputs[0].token_ids[0] for o in out))} of {B}'
    )


if __name__ == '__main__':
    main()
