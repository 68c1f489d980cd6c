#!/usr/bin/env bash
# The H200 runs of the reference drafters, one phase per device call (see DESIGN.md and the device notes):
#   stash    carries GGUF part 1 to ~/assets, checks the GPU stack on a random SmolLM2-shaped target
#   prepare  joins the GGUF (md5-checked), converts it, regenerates responses (within 30 s of stash)
#   stage1   trains stage 1 of each drafter type in $TYPES (default "dflash markov"), concurrently
#   stage2   continues each stage-1 drafter twice with equal steps: baseline (stage-1 objective) and Carryover
#   eval     tau of the four drafters: T=0 by exact offline replay, T=1 through target.generate
#   pack     bf16 copies of the four drafters, 15 MB shards
#   fetch N.. tars the named packed drafters into $OUT in 15 MB parts (64 MB come back per call)
# Every figure goes to $OUT as soon as it exists. Paths on the machine: ~/assets (kept while it stays warm).
# What the calls carry is made here first by trainer/h200_local_assets.sh.
set -euo pipefail
phase=$1
A=~/assets
OUT=${OUT:-/tmp/out}
mkdir -p "$A" "$OUT"
export HF_CARRYOVER_CACHE=$A/cache HF_CARRYOVER_OFFLINE=1 HF_CARRYOVER_SMOLLM2_GGUF=$A/smollm2.gguf
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_CARRYOVER_COMMIT=$(cat .device/commit 2>/dev/null || echo unknown)
S1_STEPS=${S1_STEPS:-2000}   # 2 concurrent runs did ~4.5 steps/s each on the H200 (batch 8)
S2_STEPS=${S2_STEPS:-600}
RUNS=""; for t in ${TYPES:-dflash markov}; do RUNS="$RUNS $t-baseline $t-carryover"; done
export RUNS

L=$A/logs/$phase
mkdir -p "$L"
log() { echo "[$(date +%T)] $*" | tee -a "$L/pipeline.log"; }
# $OUT takes 8 files a call: logs travel as one tarball, written even when a step fails
trap 'tar czf "$OUT/logs-$phase.tgz" -C "$L" . 2>/dev/null || true' EXIT

case $phase in
stash)
  cp .device/p1/part00 "$A/"
  nvidia-smi -L | tee "$OUT/gpu.txt"
  python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" | tee -a "$OUT/gpu.txt"
  python3 trainer/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$L/gpu_check.log" | tail -40
  ;;
prepare)
  cat "$A/part00" .device/p2/part01 > "$A/smollm2.gguf"
  (cd "$A" && echo "$(cut -d' ' -f1 "$OLDPWD/.device/p2/smollm2.md5")  smollm2.gguf" | md5sum -c -)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  python3 -c "from hf_carryover.reference import reference_target as r; r()" 2>&1 | tail -2
  log "target converted"
  W=4
  for i in $(seq 0 $((W-1))); do
    python3 trainer/regenerate.py --prompts assets/prompts/sharegpt_train.jsonl --out $A/data/train \
      --num_workers $W --worker_index $i --batch_size 256 --max_new_tokens 256 > "$L/regen_$i.log" 2>&1 &
  done
  python3 trainer/regenerate.py --prompts assets/prompts/sharegpt.jsonl --out $A/data/eval --batch_size 128 \
    --max_new_tokens 256 > "$L/regen_eval.log" 2>&1
  wait
  log "responses: $(cat $A/data/train/*/shard-*.jsonl | wc -l) train, $(cat $A/data/eval/shard-*.jsonl | wc -l) eval"
  tar czf "$OUT/data.tgz" -C $A data
  ;;
stage1)
  for typ in ${TYPES:-dflash markov}; do
    L1=""; [ "$typ" = markov ] && L1="--l1_weight 0.9"  # DSpark: 0.1 CE + 0.9 ||p_draft - p_target||_1
    python3 trainer/train.py --config trainer/configs/smollm2_stage1.json --drafter_type $typ $L1 \
      --data_dir $A/data/train --eval_data_dir $A/data/eval --output_dir $A/runs/$typ-stage1 \
      --max_steps $S1_STEPS --max_minutes ${S1_MINUTES:-8} > "$L/train_$typ-stage1.log" 2>&1 &
  done
  wait
  for typ in ${TYPES:-dflash markov}; do cp $A/runs/$typ-stage1/final/eval_metrics.json "$L/eval_$typ-stage1.json" || true; done
  log "stage 1 done"
  ;;
stage2)
  for typ in ${TYPES:-dflash markov}; do
    python3 trainer/train.py --config trainer/configs/smollm2_stage2.json --init_from $A/runs/$typ-stage1/final \
      --data_dir $A/data/train --eval_data_dir $A/data/eval --output_dir $A/runs/$typ-carryover \
      --max_steps $S2_STEPS --max_minutes ${S2_MINUTES:-6} > "$L/train_$typ-carryover.log" 2>&1 &
    python3 trainer/train.py --config trainer/configs/smollm2_stage2.json --init_from $A/runs/$typ-stage1/final \
      --stage 1 --carryover false --num_anchors 256 \
      --data_dir $A/data/train --eval_data_dir $A/data/eval --output_dir $A/runs/$typ-baseline \
      --max_steps $S2_STEPS --max_minutes ${S2_MINUTES:-6} > "$L/train_$typ-baseline.log" 2>&1 &
  done
  wait
  for r in $RUNS; do
    cp $A/runs/$r/final/eval_metrics.json "$L/eval_$r.json" || true
    cp $A/runs/$r/final/train_log.json "$L/trainlog_$r.json" || true
  done
  log "stage 2 done"
  ;;
eval)
  D=""
  for r in $RUNS; do D="$D $r=$A/runs/$r/final"; done
  # T=0: exact offline replay over one batched greedy rollout per prompt (fast, all prompts)
  python3 examples/evaluate_tau.py --offline --drafters $D --datasets mtbench humaneval sharegpt \
    --out $A/tau0 > "$L/tau0.log" 2>&1 || true
  cp $A/tau0/summary.json "$OUT/tau0_summary.json" || true
  # T=0 and T=1 through the batched engine (all prompts as rows; rounds equal generate()'s but the last)
  python3 examples/evaluate_tau.py --engine --drafters $D --datasets mtbench humaneval sharegpt \
    --temperatures 0 1 --out $A/tau_engine > "$L/tau_engine.log" 2>&1 || true
  cp $A/tau_engine/summary.json "$OUT/tau_engine_summary.json" || true
  # T=1: generate() in ONE process (several processes on one GPU time-slice and crawl), time-boxed
  timeout ${EVAL_SECONDS:-300} python3 examples/evaluate_tau.py --drafters $D --datasets ${EVAL_DATASETS:-mtbench humaneval sharegpt} \
    --temperatures 1 --workers 1 --out $A/tau1 ${EVAL_LIMIT:+--limit $EVAL_LIMIT} > "$L/tau1.log" 2>&1 || true
  python3 examples/evaluate_tau.py --drafters $D --out $A/tau1 --summarize_only > /dev/null
  cp $A/tau1/summary.json "$OUT/tau1_summary.json"
  cat $A/tau0/raw-*.jsonl $A/tau_engine/raw-*.jsonl $A/tau1/raw-*.jsonl | gzip > "$OUT/tau_raw.jsonl.gz"
  log "eval done"
  ;;
pack)
  # bf16 copies of the four drafters, each as shards of < 15 MB (the return limit is 16 MB a file)
  python3 - <<'EOF'
import os, torch
from hf_carryover import Drafter
A = os.path.expanduser("~/assets")
for r in os.environ["RUNS"].split():
    d = Drafter.from_pretrained(f"{A}/runs/{r}/final", dtype=torch.bfloat16)
    d.save_pretrained(f"{A}/pack/{r}", max_shard_size="15MB")
EOF
  ls -la $A/pack/* | tee "$L/pack.txt"
  ;;
fetch)
  shift
  # one tar of the named drafters, cut into 15 MB parts (16 MB a file, 64 MB a call come back)
  tar cf - -C $A/pack "$@" | split -b 15M - "$OUT/ckpt-$(echo "$@" | tr ' ' '_').tar.part"  # names: [A-Za-z0-9._-]
  ls -la "$OUT"
  ;;
esac
