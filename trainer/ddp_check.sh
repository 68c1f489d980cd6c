#!/usr/bin/env bash
# Multi-GPU check of the trainer: the same stage-1 (then stage-2) run on 1 GPU and on 2 GPUs at equal global
# batch, on a SmolLM2-shaped *random* target (the mechanism, not drafter quality, is under test) and the
# response shards in $1 (token ids; any will do). Writes both loss curves to $OUT/ddp_check.json.
#   bash trainer/ddp_check.sh runs/data/data     (on nvidia-h200-x2)
set -euo pipefail
DATA=$1
OUT=${OUT:-/tmp/out}
W=/tmp/ddp
mkdir -p $W $OUT
trap 'cp $W/*.log $OUT/ 2>/dev/null || true' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                  tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=2, bos_token_id=1, pad_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/ddp/target")
PY
common="--config trainer/configs/smollm2_stage1.json --target $W/target --data_dir $DATA/train --eval_data_dir $DATA/eval
  --max_eval_records 32 --mask_token_id 16 --logging_steps 5 --save_steps 1000 --dataloader_num_workers 0"
accelerate launch --num_processes 1 trainer/train.py $common --per_device_train_batch_size 8 --max_steps 60 \
  --output_dir $W/g1 > $W/g1.log 2>&1
accelerate launch --num_processes 2 --multi_gpu trainer/train.py $common --per_device_train_batch_size 4 --max_steps 60 \
  --output_dir $W/g2 > $W/g2.log 2>&1
accelerate launch --num_processes 2 --multi_gpu trainer/train.py $common --stage 2 --carryover true --num_anchors 64 \
  --init_from $W/g2/final --per_device_train_batch_size 4 --max_steps 20 --output_dir $W/g2s2 > $W/g2s2.log 2>&1
python3 - <<'PY'
import json, os
out = {}
for run in ["g1", "g2", "g2s2"]:
    log = json.load(open(f"/tmp/ddp/{run}/final/train_log.json"))
    out[run] = [{k: e[k] for k in ("step", "loss", "train_accept_run") if k in e} for e in log if "loss" in e]
    out[run + "_eval"] = json.load(open(f"/tmp/ddp/{run}/final/eval_metrics.json"))
json.dump(out, open(os.environ.get("OUT", "/tmp/out") + "/ddp_check.json", "w"), indent=1)
for e1, e2 in zip(out["g1"], out["g2"]):
    print(e1["step"], round(e1["loss"], 3), round(e2["loss"], 3))
print("stage2 on 2 GPUs:", [round(e["loss"], 3) for e in out["g2s2"]])
PY
