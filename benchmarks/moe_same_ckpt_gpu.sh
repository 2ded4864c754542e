#!/usr/bin/env bash
# Issue 50 on a GPU machine: both engines on the same random-weight MoE checkpoint, for one shape.
#
#   bash benchmarks/moe_same_ckpt_gpu.sh SHAPE [LAYERS] [PHASES]
#
# SHAPE: qwen3_30b_a3b (LAYERS default 24 of 48: its 48 layers are 61 GB in bf16, the disk is 64 GiB) or
# deepseek_v2_lite (default: all 27 layers, 31 GB). PHASES (default "write ours vllm rm"), in order:
#   write  benchmarks/random_checkpoint.py on cuda -> /tmp/ckpt_<SHAPE>
#   ours   benchmarks/moe_same_ckpt.py: counts (eager) then the sweep's timing (CUDA graphs) -> $OUT/same_ckpt_<SHAPE>_ours.csv
#   vllm   benchmarks/vllm_moe_peer.py: counts (eager, hooks) then timing (CUDA graphs) -> $OUT/same_ckpt_<SHAPE>_vllm.csv
#   rm     delete the checkpoint
# A shape's phases can be split over device calls while the machine stays warm (/tmp is kept), e.g. "write ours" in
# one call and "vllm rm" in the next (a device call runs at most 10 minutes; each phase has its own time limit,
# T_WRITE / T_OURS / T_VLLM seconds, default 240 / 300 / 420). Env: OUT (default outputs/), RUNS (our sweep's runs per
# point, default 3),
# SWEEP (conf/sweep name or points B:P:O,...; default the shape's sweep, moe or mla); for a CPU check of the script:
# DEVICE=cpu (where the weights are drawn), HF_CONFIG='{...}' (config fields over the yaml's), NO_BOX_ENV=1.
# Our side runs on the PYTHONPATH benchmarks/box_env.sh sets (the call carries .whl); vLLM on /tmp/site:/tmp/wh, the
# wheelhouse installed there as ../shared/vllm_peer/README.md says (skipped with a message when it is not).
set -u
SHAPE=${1:?usage: moe_same_ckpt_gpu.sh SHAPE [LAYERS] [PHASES]}
case $SHAPE in
  qwen3_30b_a3b) DEF_LAYERS=24 ;;
  *) DEF_LAYERS= ;;
esac
LAYERS=${2:-$DEF_LAYERS}
PHASES=${3:-write ours vllm rm}
OUT=${OUT:-outputs}
RUNS=${RUNS:-3}
T_WRITE=${T_WRITE:-240} T_OURS=${T_OURS:-300} T_VLLM=${T_VLLM:-420}
CKPT=/tmp/ckpt_$SHAPE
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] $*"; }
SWEEP_ARG=()
[ -n "${SWEEP:-}" ] && SWEEP_ARG=(--sweep "$SWEEP")

if [ -z "${NO_BOX_ENV:-}" ]; then
  . benchmarks/box_env.sh || { echo "box_env.sh failed (does the call carry .whl?)"; exit 1; }
fi
OUR_PYTHONPATH=${PYTHONPATH:-$PWD}
HF_ARG=()
[ -n "${HF_CONFIG:-}" ] && HF_ARG=(--hf-config "$HF_CONFIG")
df -h /tmp | tail -1

for phase in $PHASES; do
  case $phase in
    write)
      say "write $SHAPE ${LAYERS:+($LAYERS layers) }-> $CKPT"
      rm -rf "$CKPT"
      timeout -k 10 "$T_WRITE" python3 -m benchmarks.random_checkpoint "$SHAPE" --out "$CKPT" --device "${DEVICE:-cuda}" \
        ${LAYERS:+--layers $LAYERS} "${HF_ARG[@]}" \
        || { say "writing failed"; exit 1; }
      du -sh "$CKPT"; df -h /tmp | tail -1
      ;;
    ours)
      say "ours: $SHAPE on $CKPT"
      PYTHONPATH=$OUR_PYTHONPATH timeout -k 10 "$T_OURS" python3 -m benchmarks.moe_same_ckpt "$CKPT" "$SHAPE" "$OUT/same_ckpt_${SHAPE}_ours.csv" \
        --runs "$RUNS" "${SWEEP_ARG[@]}" 2>&1 | tee "$OUT/same_ckpt_${SHAPE}_ours.log" \
        | stdbuf -oL tr '\r' '\n' | grep --line-buffered -Ev '_same_ckpt: .*(warm-up|run [0-9]|steady)|^\s*$'
      say "ours done (rc ${PIPESTATUS[0]})"
      ;;
    vllm)
      if [ ! -d /tmp/site/vllm ]; then
        say "vllm: /tmp/site/vllm missing: install the wheelhouse first (../shared/vllm_peer/README.md); skipped"
        continue
      fi
      say "vllm: $SHAPE on $CKPT"
      env PYTHONPATH=/tmp/site:/tmp/wh VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
        HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        timeout -k 10 "$T_VLLM" python3 benchmarks/vllm_moe_peer.py "$CKPT" "$SHAPE" "$OUT/same_ckpt_${SHAPE}_vllm.csv" "${SWEEP_ARG[@]}" \
        > "$OUT/same_ckpt_${SHAPE}_vllm.log" 2>&1 &
      pid=$!
      # the log's rows as they come (vLLM's own logging stays in the file)
      tail -f "$OUT/same_ckpt_${SHAPE}_vllm.log" --pid=$pid | grep --line-buffered -E "^\{|^vllm B=|pass:|rows ->|Error|error" &
      wait $pid; rc=$?
      sleep 1
      say "vllm done (rc $rc)"
      [ $rc -ne 0 ] && tail -40 "$OUT/same_ckpt_${SHAPE}_vllm.log"
      ;;
    rm)
      say "rm $CKPT"
      rm -rf "$CKPT"
      ;;
    *) echo "unknown phase $phase (write ours vllm rm)"; exit 1 ;;
  esac
done
ls -l "$OUT"/same_ckpt_"${SHAPE}"_*
say "all done"
