#!/usr/bin/env bash
# Quantized matmuls for M > 1 on one GPU: the CUDA tests of the FP8 and W4A16 kernels, the tuners (writing
# kernels/configs/{fp8_gemm,w4a16_tc}/<device>.json), the perplexity of each format through the GPU kernels, and the
# decode sweep `+sweep=quant` (bf16, W4A16, q4k, q8_0, FP8 at batch 1/16/64).
#
#   benchmarks/quant_gpu.sh [all|tests|tune|ppl|sweep]...  OUT_DIR (default results/quant_gpu)
#
# Stages, about: tests 3-4 min, tune 4-5 min (budgets below), ppl 1 min, sweep 5-8 min. Each stage's log is
# OUT_DIR/<stage>.log; the tuners' CSVs and the perplexity CSV go to OUT_DIR, the sweep's rows to results/ as the
# sweep config says. Run from the repository root with the package installed (`pip install -e .`).
set -u
cd "$(dirname "$0")/.."
stages=(); out=results/quant_gpu
for a in "$@"; do case $a in all|tests|tune|ppl|sweep) stages+=("$a");; *) out=$a;; esac; done
[ ${#stages[@]} -eq 0 ] && stages=(all)
mkdir -p "$out"
want() { for s in "${stages[@]}"; do [ "$s" = all ] || [ "$s" = "$1" ] && return 0; done; return 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc=0

if want tests; then   # kernels at real sizes: expect every test to pass (the blockwise scaled_mm one may skip)
  python -m pytest -q -m cuda -rs tests/test_kernels_fp8.py tests/test_kernels_w4a16.py 2>&1 | tee "$out/tests.log" | tail -25
  rc=$((rc | PIPESTATUS[0]))
fi

if want tune; then    # --write: the device's config files (and default.json on the H200)
  python -m benchmarks.kernels.tune_fp8_mm --ms 16,64,512 --budget 100 --workers 12 --out "$out" --write \
    2>&1 | tee "$out/tune_fp8_mm.log" | grep -E '^(block|channel|wrote|budget|WRONG|failed|compile failed)' | tail -40
  python -m benchmarks.kernels.bench_tc --ms 16,64 --budget 60 --out "$out" --write \
    2>&1 | tee "$out/bench_tc.log" | grep -E 'M= *[0-9]+ current|^layer|wrote|budget|fail' | tail -20
fi

if want ppl; then     # perplexity of SmolLM2 on data/ppl_text.txt, bf16 on the GPU, every decoder linear quantized
  python - "$out" <<'EOF' 2>&1 | tee "$out/ppl.log"
import copy, math, sys, time
from pathlib import Path
import pandas as pd, torch
from cvllm_lab.config import EngineConfig, default_model_path
from cvllm_lab.weights.loader import load_model, load_hf_config, resolve_model_source
from cvllm_lab.tokenizer import load_tokenizer
from cvllm_lab.quant.apply import quantize_model
from cvllm_lab.quant.base import QuantLinear
from cvllm_lab.quant.fp8 import FP8Linear
from cvllm_lab.bench.perplexity import perplexity, layer_types

def fp8_channel(model):
    "Every decoder linear as per-channel FP8 (the layout of per-channel / per-tensor checkpoints)."
    for parent in list(model.model.layers.modules()):
        for n, c in list(parent.named_children()):
            if type(c).__name__ == 'Linear' and not isinstance(c, QuantLinear): setattr(parent, n, FP8Linear.from_linear(c, block=False))
    return model

path = default_model_path()
hcfg = load_hf_config(resolve_model_source(path))
base = load_model(EngineConfig(model=str(path), device='cuda', dtype='bfloat16').finalize(hcfg.max_position_embeddings), hcfg, progress=False)
ids = torch.tensor(load_tokenizer(path.parent, path.name).encode(Path('data/ppl_text.txt').read_text()))
rows = []
for name, make in [('bf16', lambda m: m), ('fp8 (128x128 blocks)', lambda m: quantize_model(m, 'fp8', progress=False)),
                   ('fp8 (per channel)', fp8_channel), ('w4a16', lambda m: quantize_model(m, 'w4a16', progress=False))]:
    t = time.time()
    m = make(copy.deepcopy(base))
    for rows_per_call in (2311, 64):   # one flat prefill of 512-token windows (M = 2311), or one 64-token window per call (M = 64)
        if rows_per_call > 64: p = perplexity(m, ids, 512)
        else:                      # exp of the mean NLL over the windows, each window its own forward
            parts = [c for c in ids.split(64) if len(c) > 1]
            p = math.exp(sum(math.log(perplexity(m, c, 64)) * (len(c) - 1) for c in parts) / sum(len(c) - 1 for c in parts))
        rows.append(dict(format=name, M=rows_per_call, types=layer_types(m) or 'bf16', ppl=round(p, 3)))
        print(rows[-1], f'{time.time() - t:.0f} s', flush=True)
    del m; torch.cuda.empty_cache()
df = pd.DataFrame(rows)
for M in (2311, 64):
    b = df[(df.M == M) & (df.format == 'bf16')].ppl.item()
    df.loc[df.M == M, 'delta_pct'] = (100 * (df[df.M == M].ppl / b - 1)).round(2)
df.to_csv(Path(sys.argv[1]) / 'perplexity_gpu.csv', index=False)
print(df.to_string(index=False))
EOF
  rc=$((rc | PIPESTATUS[0]))
fi

if want sweep; then   # Llama-3-8B (dummy weights), 32 -> 128 tokens, decode tok/s per format and batch
  python -m cvllm_lab.bench +sweep=quant 2>&1 | tee "$out/sweep.log" | tail -30
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
