#!/usr/bin/env bash
# Multi-GPU check of the trainer: the same stage-1 (then stage-2) run on 1 GPU and on 2 GPUs at equal global
# batch (DDP_BATCH in all: one GPU takes it whole, two take half each), from the same seed, on the response shards
# in $1. Writes both loss curves and held-out metrics to $OUT/ddp_check.json.
#   bash trainer/ddp_check.sh runs/data/data     (on nvidia-h200-x2)
# DDP_TARGET=random (default): a SmolLM2-shaped random target, a mechanism check only (its loss stays near the
# unigram entropy, so agreement is weak evidence). DDP_TARGET=reference: the real SmolLM2-135M-Instruct (needs the
# converted target, i.e. the pipeline's environment: `h200_pipeline.sh ddp`), where the loss falls fast in the
# first hundreds of steps and the two curves must follow each other down. DDP_STEPS, DDP_STAGE2_STEPS: run lengths.
set -euo pipefail
DATA=$1
OUT=${OUT:-/tmp/out}
TARGET=${DDP_TARGET:-random}
STEPS=${DDP_STEPS:-60}
BATCH=${DDP_BATCH:-8}
W=/tmp/ddp
rm -rf $W && mkdir -p $W $OUT
trap 'cp $W/*.log $OUT/ 2>/dev/null || true' EXIT TERM
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$TARGET" = random ]; then TARGET=$W/target; python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                  tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=2, bos_token_id=1, pad_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/ddp/target")
PY
fi
common="--config trainer/configs/smollm2_stage1.json --target $TARGET --data_dir $DATA/train --eval_data_dir $DATA/eval
  --max_eval_records ${DDP_EVAL_RECORDS:-32} --mask_token_id 16 --logging_steps ${DDP_LOG_EVERY:-5} --save_steps 100000
  --dataloader_num_workers 0"
# one GPU means one visible GPU: with two visible, a single process runs torch's DataParallel over both and doubles
# the batch (n_gpu=2), which is what the 2026-11-29 check compared, unknowingly (its "1-GPU" run logged twice the epochs)
CUDA_VISIBLE_DEVICES=0 accelerate launch --num_processes 1 --main_process_port 29521 trainer/train.py $common \
  --per_device_train_batch_size $BATCH --max_steps $STEPS --output_dir $W/g1 > $W/g1.log 2>&1
accelerate launch --num_processes 2 --multi_gpu --main_process_port 29522 trainer/train.py $common \
  --per_device_train_batch_size $((BATCH / 2)) --max_steps $STEPS --output_dir $W/g2 > $W/g2.log 2>&1
summarize() {  # ddp_check.json from the runs finished so far (written after stage 1 and again after stage 2)
DDP_TARGET_LABEL=${DDP_TARGET:-random} DDP_CMD="DDP_TARGET=${DDP_TARGET:-random} DDP_STEPS=$STEPS DDP_BATCH=$BATCH bash trainer/ddp_check.sh $DATA" \
python3 - <<'PY'
import json, os, subprocess
out = {"target": os.environ["DDP_TARGET_LABEL"], "command": os.environ["DDP_CMD"],
       "commit": os.environ.get("HF_CARRYOVER_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"],
                 capture_output=True, text=True).stdout.strip() or "unknown"}
for run in ["g1", "g2", "g2s2"]:
    if not os.path.exists(f"/tmp/ddp/{run}/final/train_log.json"):
        continue
    log = json.load(open(f"/tmp/ddp/{run}/final/train_log.json"))
    out[run] = [{k: e[k] for k in ("step", "loss", "train_accept_run") if k in e} for e in log if "loss" in e]
    out[run + "_eval"] = json.load(open(f"/tmp/ddp/{run}/final/eval_metrics.json"))
json.dump(out, open(os.environ.get("OUT", "/tmp/out") + "/ddp_check.json", "w"), indent=1)
pairs = [(e1, e2) for e1, e2 in zip(out.get("g1", []), out.get("g2", [])) if e1["step"] == e2["step"]]
for e1, e2 in pairs:
    print(e1["step"], round(e1["loss"], 3), round(e2["loss"], 3))
if pairs:  # one summary of agreement: the curves' gap against how far the loss moved over the run
    gaps = [abs(a["loss"] - b["loss"]) for a, b in pairs]
    out["agreement"] = {"logged_steps": len(pairs), "mean_abs_loss_gap": sum(gaps) / len(gaps),
                        "loss_first_logged": [pairs[0][0]["loss"], pairs[0][1]["loss"]],
                        "loss_last_logged": [pairs[-1][0]["loss"], pairs[-1][1]["loss"]]}
    print(out["agreement"])
json.dump(out, open(os.environ.get("OUT", "/tmp/out") + "/ddp_check.json", "w"), indent=1)
if "g2s2" in out:
    print("stage2 on 2 GPUs:", [round(e["loss"], 3) for e in out["g2s2"]])
PY
}
summarize
if [ "${DDP_STAGE2_STEPS:-20}" -gt 0 ]; then
  accelerate launch --num_processes 2 --multi_gpu --main_process_port 29523 trainer/train.py $common --stage 2 \
    --carryover true --num_anchors 64 --init_from $W/g2/final --per_device_train_batch_size $((BATCH / 2)) \
    --max_steps ${DDP_STAGE2_STEPS:-20} --output_dir $W/g2s2 > $W/g2s2.log 2>&1
  summarize
fi
