#!/usr/bin/env bash
# One device call: examples/profile_engine.py's tree-round profile (GPU time of the captured round, its kernels) for
# several engine option sets in turn, each in its own process, on the reference target's shapes with random weights
# (`--target smollm2-random`: no converted target to carry). Why: an A/B of round-cost changes needs every variant on
# one machine start; a variant is one compile (~150 s on an H100), so a 590 s call holds three.
#   VARIANTS="base=-;kern=draft_topk=triton,skinny_rows=64" bash trainer/gpu_round_variants.sh
# Each variant NAME=OPTS (OPTS comma-separated engine options, "-" for none) writes $OUT/profile_NAME.json and .log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_CARRYOVER_OFFLINE=1
export HF_CARRYOVER_COMMIT=${HF_CARRYOVER_COMMIT:-$(cat .device/commit 2>/dev/null || echo unknown)}
D=${DRAFTER:-model_cards/smollm2-135m-instruct-dflash-carryover}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
IFS=';' read -ra V <<< "${VARIANTS:?VARIANTS=\"NAME=OPTS;...\"}"
for v in "${V[@]}"; do
  name=${v%%=*}; opts=${v#*=}; [ "$opts" = - ] && opts=""
  echo "[$(date +%T)] $name: ${opts:-defaults}"
  timeout "${VARIANT_SECONDS:-190}" python3 examples/profile_engine.py --target smollm2-random --drafter "$D" \
    --tree "$D/draft_tree.json" --tree_nodes "${TREE_NODES:-31}" --lookup 15 --prompts_dir assets/prompts \
    --dataset humaneval --limit "${LIMIT:-3}" --modes ${MODES:-tree_lookup} --no_parts --inductor freezing=True \
    ${opts:+--engine_options ${opts//,/ }} --out "$OUT/profile_$name.json" > "$OUT/profile_$name.log" 2>&1
  echo "[$(date +%T)] $name: exit $?"
done
