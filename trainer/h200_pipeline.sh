#!/usr/bin/env bash
# The H200 runs of the reference drafters on `nvidia-h200-x2` (2 GPUs), one phase per device call. The machine
# goes back 30 s after a call, so each phase is issued as soon as the previous one returns:
#   stash   carries GGUF part 1 and the regenerated responses to ~/assets
#   prep    the target alone (joins the GGUF, converts it, writes the bf16 serving folder): for calls that start
#           phases side by side, e.g. `prep && (stage2 & engine; wait)`
#   stashinit  carries .init/NAME (a drafter folder) for train1's S1_INIT=NAME: stage 1 continues from it; and
#           runs/regen (the regen phase's tar parts), unpacked beside the stashed responses
#           (S1_INIT=@previous: from this machine's last train1, so that train1 calls chain in one session)
#   train1  joins the GGUF (md5-checked), converts it, trains stage 1: DFlash on GPU 0, Markov on GPU 1, each
#           with its LR schedule fitted to S1_MINUTES (S1_STEPS: both the same steps, S1_MINUTES a cap); returns bf16
#           stage-1 drafters (insurance)
#   stage2  per type (GPU 0 DFlash, GPU 1 Markov) two continuations of S2_STEPS each from the same stage-1
#           checkpoint: baseline (stage-1 objective) and Carryover; returns the DFlash pair. S2_INIT, S2_RUNS,
#           S2_TAG and S2_GPU run a single Carryover variant from a stashed drafter (see the phase)
#   eval    GPU 0: a time-boxed τ cross-check through generate() itself (T=0 and T=1, GEN_LIMIT prompts);
#           GPU 1: engine check, examples/benchmark.py, profile and 4B projection (τ proper: the `tau` phase)
#   tau     τ of the four drafters, T=0 and T=1, batched engine in fp32 (one pair per GPU; ~4 min)
#   regen   more training responses on both GPUs (sampled sets, or prompts past the first 8000; "eval": the held-out
#           responses), returned as tar parts; REGEN_ENGINE=vllm generates with vLLM (carry .vllm/bundle to vllmstash first)
#   gentau  τ through generate() itself on all prompts, worker processes per GPU, time-boxed (GEN_G0, GEN_G1)
#   ddp     the 1-GPU against 2-GPU training check (trainer/ddp_check.sh) on the real target
#   fetch   returns the checkpoint parts still queued (4 x 15 MB a call)
#   vllmstash  stashes what the call carries for the vLLM phase; carry any of these, within 64 MiB a call:
#           .vllm/bundle (56 MB, one call on its own; installed into ~/assets/vllm_site), .vllm/drafters/NAME (our
#           HF drafter folders, ~25 MB each in bf16, e.g. runs/h200v2/pack/dflash-baseline), .device/p1 and
#           assets/prompts (a fresh machine's GGUF half and prompts), .device/inductor (an inductor cache an engine
#           phase returned as inductor.tgz.part*: `mkdir -p .device/inductor && cp <files_at>/inductor.tgz.part*
#           .device/inductor/`). Make the bundle on a networked machine with
#           `bash ../shared/tools/make_vllm_bundle.sh .vllm/bundle`; /.vllm/ is git-ignored.
#   engine  benchmark rows (engine, HF) and the fp32 compile check on both GPUs without vLLM: E0, E1 are each
#           GPU's jobs in order (see the phase; ENGINE_TURNS=1: side by side, one row a job, timed in turns);
#           PACK_CACHE=1 returns its inductor cache as tar parts (pack_cache)
#   vllm    vLLM 0.26 against our engine on the same prompts, target weights and settings (GPU 0: examples/bench_vllm.py,
#           GPU 1 or after it: benchmark.py engine rows), both appending to results/vllm/bench/bench_raw.jsonl. Needs
#           vllmstash's install and the converted target (train1), or .device/p2 + .whl carried to convert it here.
#           Drafters VLLM_DRAFTERS (default dflash-baseline) from runs/NAME/final of this machine, else the stashed ones.
# The runs that used this script, in order, with the phases each called: trainer/RUNS.md (each run's results
# README has its exact commands).
# vllmstash now refreshes the stashed folders' remote code: a folder saved by an older commit runs its own copy.
# With drafter weights committed in model_cards/, run `bash trainer/device_tree.sh light` before the calls.
# Checkpoints: stage2 packs all four drafters in bf16 and queues them as tar parts (DFlash pair first); each call
# ships the oldest 4 parts.
# Every figure goes to $OUT as soon as it exists; checkpoints come back as tar parts of 15 MB (16 MB a file,
# 8 files and 64 MB a call), named [A-Za-z0-9._-] only. What the calls carry is made by trainer/h200_local_assets.sh.
set -euo pipefail
phase=$1
A=~/assets
OUT=${OUT:-/tmp/out}
mkdir -p "$A" "$OUT"
export HF_CARRYOVER_CACHE=$A/cache HF_CARRYOVER_OFFLINE=1 HF_CARRYOVER_SMOLLM2_GGUF=$A/smollm2.gguf
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_CARRYOVER_COMMIT=$(cat .device/commit 2>/dev/null || echo unknown)
# inductor's and Triton's on-disk caches under ~/assets: a cache packed by an earlier machine's engine phase
# (pack_cache, returned as inductor.tgz.part*) and carried back as .device/inductor (vllmstash unpacks it) serves this
# machine's compiles. Why: compiling an engine on a fresh machine took 114-236 s a row (12-04c/d), from a warm cache
# 63-69 s, and a session's 30 device-minutes spend most of their time compiling
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$A/inductor} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$A/inductor/triton}
TYPES=(${TYPES:-dflash markov})  # two types: GPU i trains TYPES[i]; one type: stage 1 on both GPUs (DDP), then
                                  # its baseline on GPU 0 and its Carryover continuation on GPU 1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); [ "${NGPU:-0}" -ge 1 ] || NGPU=1
gpu() { echo $(( $1 % NGPU )); }  # the phases are written for two GPUs; on one H200 both halves share GPU 0
S1_MINUTES=${S1_MINUTES:-6}
S2_MINUTES=${S2_MINUTES:-5.5}

L=$A/logs/$phase
mkdir -p "$L"
log() { echo "[$(date +%T)] $*" | tee -a "$L/pipeline.log"; }
# logs travel as one tarball, written even when a step fails
R=$A/results/$phase  # small result files: one tarball back, with the logs, even when a step fails
mkdir -p "$R"
flush() {  # (a temporary file per shell: ENGINE_TURNS=1 jobs flush side by side)
  local t="$A/.r.$BASHPID.tgz"
  tar czf "$t" -C "$A" logs results 2>/dev/null && mv "$t" "$OUT/results-$phase.tgz" || rm -f "$t"
}
trap flush EXIT

. "$(dirname "${BASH_SOURCE[0]}")/pipeline_lib.sh"  # serve_target ... resolve_drafter: the phases' shell functions

case $phase in
stash)
  cp .device/p1/part00 "$A/"
  rm -rf "$A/data" && cp -r runs/data/data "$A/data"
  (nvidia-smi -L || echo "no nvidia-smi") | tee "$R/gpu.txt"
  python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" | tee -a "$R/gpu.txt"
  log "stashed: $(du -sh $A/part00 | cut -f1) GGUF part, $(cat $A/data/train/*/shard-*.jsonl | wc -l) train responses"
  ;;
stashinit)  # carries .init/NAME (a bf16 drafter folder, ~24 MB) for train1's S1_INIT, with assets/prompts, and
  # runs/regen (the regen phase's returned data-*.tgz.part* files, ~7 MB): unpacked into ~/assets/data/train, so
  # run it after `stash` (which replaces ~/assets/data with runs/data/data)
  for f in runs/regen/data-*.tgz.partaa; do [ -f "$f" ] || continue
    D=$A/data/train; [[ $f == *-float32.tgz.partaa ]] && D=$A/data/train_float32  # as `regen` keeps them
    [[ $f == */data-heldout-* ]] && D=$A/data/eval  # the held-out responses of REGEN_SETS=eval
    mkdir -p "$D" && cat "${f%aa}"* | tar xzf - -C "$D" && log "stashed responses $(basename ${f%.tgz.partaa}) in $D"
  done
  for d in .init/*/; do rm -rf "$A/init/$(basename $d)" && mkdir -p "$A/init" && cp -r "$d" "$A/init/" \
    && log "stashed init drafter $(basename $d)"; done
  [ -d assets/prompts ] && rm -rf "$A/prompts" && cp -r assets/prompts "$A/prompts" && log "stashed prompts"
  ;;
train1)
  if [ -d .device/p2 ]; then join_gguf  # a later train1 on a warm machine needs no GGUF half
  else have_target || { log "no target here: carry .device/p2 (and .whl)"; exit 2; }; fi
  [ -d assets/prompts ] && rm -rf "$A/prompts" && cp -r assets/prompts "$A/prompts"
  # S1_INIT=NAME: continue stage 1 from ~/assets/init/NAME (stashinit), e.g. the previous run's stage-1 drafter.
  # S1_INIT=@previous: continue from this machine's last train1 (its runs/TYPE-stage1 moves aside first, so that the
  # new run starts from its final weights with a fresh schedule, not from its checkpoints): train1 calls chain
  INIT=""; [ -n "${S1_INIT:-}" ] && INIT="--init_from $A/init/$S1_INIT"
  if [ "${S1_INIT:-}" = @previous ]; then
    [ ${#TYPES[@]} = 1 ] || { log "S1_INIT=@previous needs one type (TYPES=dflash or TYPES=markov)"; exit 2; }
    prev=$A/runs/${TYPES[0]}-stage1-$(date +%H%M%S)
    [ -d $A/runs/${TYPES[0]}-stage1/final ] || { log "S1_INIT=@previous: no earlier ${TYPES[0]} stage 1 here"; exit 2; }
    mv $A/runs/${TYPES[0]}-stage1 $prev && INIT="--init_from $prev/final" && log "stage 1 continues from $prev/final"
  fi
  python3 -c "from hf_carryover.reference import reference_target as r; r()" 2>&1 | tail -2
  log "target converted"
  S1_RUNS_DONE=()  # the stage-1 runs of this call, runs/<name>
  if [ -n "${S1_ARMS:-}" ]; then  # one type, two training sets, one GPU each, equal steps: an A/B of the data
    # S1_ARMS="NAME=DIRS NAME=DIRS", DIRS comma-separated under ~/assets/data (e.g. "bf16=train
    # fp32=train_float32,train/regen-T1-s1,train/regen-T1-s2"); S1_STEPS steps each on one cosine schedule (give it:
    # a time-fitted schedule would give the arms different steps), S1_MINUTES a safety cap; runs/TYPE-stage1-NAME.
    [ ${#TYPES[@]} = 1 ] && [ -n "${S1_STEPS:-}" ] || { log "S1_ARMS needs one type (TYPES=dflash) and S1_STEPS"; exit 2; }
    typ=${TYPES[0]}; L1=$(l1_flag $typ); i=0
    for arm in $S1_ARMS; do
      name=$typ-stage1-${arm%%=*}; dirs=""; IFS=, read -ra parts <<< "${arm#*=}"
      for d in "${parts[@]}"; do dirs="$dirs${dirs:+,}$A/data/$d"; done
      log "$name on GPU $i: $S1_STEPS steps on $dirs ($(find ${dirs//,/ } -name 'shard-*.jsonl' -exec cat {} + | wc -l) responses)"
      CUDA_VISIBLE_DEVICES=$(gpu $i) python3 trainer/train.py --config trainer/configs/smollm2_stage1.json \
        --drafter_type $typ $L1 --data_dir $dirs --eval_data_dir $A/data/eval --output_dir $A/runs/$name \
        --max_steps $S1_STEPS --max_minutes $S1_MINUTES $INIT ${TRAIN_EXTRA:-} > "$L/train_$name.log" 2>&1 &
      S1_RUNS_DONE+=($name); i=$((i + 1))
    done
  elif [ ${#TYPES[@]} = 1 ] && [ $NGPU = 1 ]; then  # one type on one GPU (S1_DATA: comma-separated data folders)
    typ=${TYPES[0]}; L1=$(l1_flag $typ); S1_RUNS_DONE=($typ-stage1)
    CUDA_VISIBLE_DEVICES=0 python3 trainer/train.py --config trainer/configs/smollm2_stage1.json --drafter_type $typ $L1 \
      --data_dir ${S1_DATA:-$A/data/train} --eval_data_dir $A/data/eval --output_dir $A/runs/$typ-stage1 --max_steps 20000 \
      --max_minutes $S1_MINUTES --fit_schedule_to_time true $INIT ${TRAIN_EXTRA:-} > "$L/train_$typ-stage1.log" 2>&1 &
  elif [ ${#TYPES[@]} = 1 ]; then  # one type, both GPUs: data-parallel stage 1 (global batch 2 x per-device)
    typ=${TYPES[0]}; L1=$(l1_flag $typ); S1_RUNS_DONE=($typ-stage1)
    accelerate launch --num_processes 2 ${DDP_FLAGS:---multi_gpu} --main_process_port 29511 trainer/train.py \
      --config trainer/configs/smollm2_stage1.json --drafter_type $typ $L1 --data_dir $A/data/train \
      --eval_data_dir $A/data/eval --output_dir $A/runs/$typ-stage1 --max_steps 20000 --max_minutes $S1_MINUTES \
      --fit_schedule_to_time true $INIT ${TRAIN_EXTRA:-} > "$L/train_$typ-stage1.log" 2>&1 &
  else for i in 0 1; do  # two types: S1_STEPS gives both the same steps on one cosine schedule (the four-drafter
    # comparison: identical data and steps), S1_MINUTES then only a safety cap; else each fits its schedule to the time
    typ=${TYPES[$i]}; S1_RUNS_DONE+=($typ-stage1)
    L1=$(l1_flag $typ)
    STEPS="--max_steps 20000 --fit_schedule_to_time true"; [ -n "${S1_STEPS:-}" ] && STEPS="--max_steps $S1_STEPS"
    CUDA_VISIBLE_DEVICES=$(gpu $i) python3 trainer/train.py --config trainer/configs/smollm2_stage1.json \
      --drafter_type $typ $L1 --data_dir $A/data/train --eval_data_dir $A/data/eval \
      --output_dir $A/runs/$typ-stage1 $STEPS --max_minutes $S1_MINUTES $INIT ${TRAIN_EXTRA:-} \
      > "$L/train_$typ-stage1.log" 2>&1 &
  done; fi
  wait
  flush
  for r in "${S1_RUNS_DONE[@]}"; do
    cp $A/runs/$r/final/eval_metrics.json "$L/eval_$r.json" || true
    cp $A/runs/$r/final/train_log.json "$L/trainlog_$r.json" || true
    fit=$(last_fit $L/trainlog_$r.json || true)
    msg="no schedule fit"; [ -n "$fit" ] && msg="schedule fitted to ${fit% *} steps at ${fit#* } s/step"
    log "$r: $msg; $(grep -o '"step": [0-9]*' $L/trainlog_$r.json | tail -1)"
    log "$r eval: $(tr -d '\n ' < $L/eval_$r.json | head -c 400)"
  done
  # insurance; the Markov drafter (75 MB with its r=256 head) stays behind
  P=$(printf '%s\n' "${S1_RUNS_DONE[@]}" | grep '^dflash' | tr '\n' ' ' || true)  # none with TYPES=markov
  [ -n "$P" ] && pack $P && ship 4 $P
  log "stage 1 done"; flush
  ;;
prep)  # the target only: joins the GGUF (carry .device/p2, .whl) and converts it, plus the bf16 serving folder, so
  # that phases started together in one call (e.g. `stage2 & engine`) find it ready instead of racing to make it
  ready_target
  serve_target
  [ -d assets/prompts ] && [ ! -d "$A/prompts" ] && cp -r assets/prompts "$A/prompts"
  log "target ready"
  ;;
stage2)
  # S2_INIT=NAME continues from ~/assets/init/NAME (stashinit) instead of this machine's runs/TYPE-stage1/final.
  # S2_RUNS (default "baseline carryover"): which continuations; S2_TAG names the Carryover run TYPE-carryoverTAG
  # (a variant beside a shipped one); S2_GPU: the GPU of a run that is alone on its type.
  RUNS=(${S2_RUNS:-baseline carryover})
  for i in "${!TYPES[@]}"; do
    typ=${TYPES[$i]}
    init=$A/runs/$typ-stage1/final; [ -n "${S2_INIT:-}" ] && init=$A/init/$S2_INIT
    # equal steps for the pair, sized from stage 1's measured s/step: a Carryover step costs ~2 stage-1 steps;
    # a pair that time-slices one GPU takes ~3 N s1 for N steps of both, a pair on two GPUs ~2 N s1
    # (0.8 margin, 45 s for load/eval). CARRY_EXTRA adds flags to the Carryover run only (e.g. --carry_chain 2,
    # which costs more per step: give it S2_STEPS explicitly; or --carryover_gate -6, the gated variant, with
    # S2_TAG=-gated to keep it beside an ungated one)
    g0=$i; g1=$i; share=3; [ ${#TYPES[@]} = 1 ] && [ $NGPU -ge 2 ] && { g1=1; share=2; }
    [ ${#RUNS[@]} = 1 ] && { g0=${S2_GPU:-$i}; g1=$g0; }
    L1=$(l1_flag $typ)  # both Markov runs keep DSpark's term
    fit=$(last_fit $init/train_log.json 2>/dev/null || true)
    N=${S2_STEPS:-$(python3 -c "print(int(0.8 * (${S2_MINUTES} * 60 - 45) / ($share * float('${fit#* }'))) if '$fit' else 800)")}
    log "$typ stage 2 from $init: $N steps each, runs: ${RUNS[*]}" \
        "(baseline: GPU $(gpu $g0), Carryover: GPU $(gpu $g1), if run)"
    if [[ " ${RUNS[*]} " == *" carryover "* ]]; then
      CUDA_VISIBLE_DEVICES=$(gpu $g1) python3 trainer/train.py --config trainer/configs/smollm2_stage2.json \
        --init_from $init $L1 --data_dir $A/data/train --eval_data_dir $A/data/eval \
        --output_dir $A/runs/$typ-carryover${S2_TAG:-} --max_steps $N --max_minutes $S2_MINUTES ${TRAIN_EXTRA:-} \
        ${CARRY_EXTRA:-} > "$L/train_$typ-carryover${S2_TAG:-}.log" 2>&1 &
    fi
    if [[ " ${RUNS[*]} " == *" baseline "* ]]; then
      CUDA_VISIBLE_DEVICES=$(gpu $g0) python3 trainer/train.py --config trainer/configs/smollm2_stage2.json \
        --init_from $init --stage 1 --carryover false --num_anchors 256 $L1 \
        --data_dir $A/data/train --eval_data_dir $A/data/eval \
        --output_dir $A/runs/$typ-baseline --max_steps $N --max_minutes $S2_MINUTES ${TRAIN_EXTRA:-} \
        > "$L/train_$typ-baseline.log" 2>&1 &
    fi
    # one GPU, two types: one pair at a time. All four runs side by side ran out of memory (2026-12-02: the DFlash
    # Carryover run died at step 5, the other three processes holding 25, 27 and 59 GB)
    [ $NGPU = 1 ] && [ ${#TYPES[@]} = 2 ] && wait
  done
  wait
  P=""  # queue: the DFlash runs first (complete in this call), then the Markov ones
  for t in "${TYPES[@]}"; do for v in ${RUNS[*]}; do r=$t-$v; [ $v = carryover ] && r=$r${S2_TAG:-}
    P="$P $r"
    cp $A/runs/$r/final/eval_metrics.json "$L/eval_$r.json" || true
    cp $A/runs/$r/final/train_log.json "$L/trainlog_$r.json" || true
    log "$r: $(grep -o '"stopped_early_at_step": [0-9]*' $L/trainlog_$r.json || echo "all steps") $(grep -o '"step": [0-9]*' $L/trainlog_$r.json | tail -1)"
    log "$r eval: $(tr -d '\n ' < $L/eval_$r.json | head -c 300)"
  done; done
  flush
  for r in $P; do rm -f $A/outbox/*-ckpt-$r.tar.part*; done  # this call's runs only: a stage2 phase beside
  pack $P && ship 4 $P                                         # another keeps the other's queued parts
  log "stage 2 done"
  ;;
eval)
  ship  # first: a call cut at its time limit still returns them
  D=""; for t in "${TYPES[@]}"; do for v in baseline carryover; do D="$D $t-$v=$A/runs/$t-$v/final"; done; done
  P="--prompts_dir $A/prompts"; F="--dtype float32"  # τ in fp32: the exactness the tests assert
  BENCH_DRAFTERS=${BENCH_DRAFTERS:-$D}
  (  # GPU 1: the CUDA-graph engine check, then the wall-clock benchmark (same prompts, every method; each finished
     # row lands in bench_raw.jsonl at once), the latency-model run (eager, profiled) and the 4B projection
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    timeout $(call_box ${CHECK_SECONDS:-80}) python3 trainer/gpu_engine_check.py ${CHECK_EXTRA:---compile} --out $R/gpu_engine_check.json \
      > "$L/gpu_engine_check.log" 2>&1 || log "engine check stopped: $?"
    timeout $(call_box ${BENCH_SECONDS:-200}) python3 examples/benchmark.py $P --drafters $BENCH_DRAFTERS --cuda_graphs \
      --datasets humaneval mtbench --limit ${BENCH_LIMIT:-5} --batch_sizes 1 4 16 ${BENCH_EXTRA:-} \
      --out $R/bench > "$L/bench.log" 2>&1 || log "benchmark stopped: $?"
    timeout $(call_box 60) python3 examples/benchmark.py $P --drafters $BENCH_DRAFTERS --methods engine_ar engine \
      --datasets humaneval --limit 3 --batch_sizes 1 --profile ${BENCH_EXTRA:-} \
      --out $R/bench_profile > "$L/bench_profile.log" 2>&1 || log "profile run stopped: $?"
    [ "${BENCH4B:-1}" = 1 ] && timeout $(call_box 60) python3 examples/benchmark.py $P --target qwen3-4b-random --random_drafter \
      --datasets mtbench --limit 2 --max_new_tokens 128 --methods engine_ar engine --profile \
      --out $R/bench4b > "$L/bench4b.log" 2>&1 || log "4B projection stopped or skipped: $?"
  ) &
  export CUDA_VISIBLE_DEVICES=0
  # τ itself is the `tau` phase's (batched engine, all prompts); here only the cross-check through
  # target.generate(assistant_model=...) itself, a few prompts, T=0 and T=1
  timeout $(call_box ${GEN_SECONDS:-200}) python3 examples/evaluate_tau.py $P $F ${TAU_EXTRA:-} --drafters $D --datasets mtbench \
    --temperatures 0 1 --limit ${GEN_LIMIT:-4} --out $R/tau_gen > "$L/tau_gen.log" 2>&1 || log "generate tau stopped: $?"; flush
  python3 examples/evaluate_tau.py $P --drafters $D --out $R/tau_gen --summarize_only > /dev/null 2>&1 || true
  log "generate() cross-check done"
  wait
  log "eval done"
  ;;
tau)  # τ of the four drafters at T=0 and T=1 through the batched engine (fp32), one drafter pair per GPU.
  # The engine's greedy rounds equal generate()'s (tested, round for round since the 2026-11-30d budget rule) and the offline
  # replay's (checked on the H200: 1.373 both, DFlash baseline, MT-Bench); ~4 minutes for 4 x 344 prompts x 2 T.
  # Each call writes its own folders, tau_engine_<group>-<HHMMSS>: a later tau call on the same warm machine would
  # otherwise append to the same raw file, and the folder's summary would name only the last call's command (as the
  # 2026-11-30g summaries did; that folder's README says which call measured what).
  stamp=$(date +%H%M%S)
  tau_run() {  # tau_run GPU NAME DRAFTER...
    local g=$1 n=$2; shift 2
    local tv=TAU_TEMPS_G$g; local temps=${!tv:-${TAU_TEMPS:-0 1}}  # per GPU (TAU_TEMPS_G0), else for both
    CUDA_VISIBLE_DEVICES=$(gpu $g) timeout $(call_box ${TAU_SECONDS:-250}) python3 examples/evaluate_tau.py --prompts_dir $A/prompts \
      --dtype float32 --engine --engine_batch 128 --drafters "$@" --datasets mtbench humaneval sharegpt \
      --temperatures $temps ${TAU_EXTRA:-} --out $R/tau_engine_$n-$stamp > $R/tau_engine_$n-$stamp.log 2>&1
  }
  # groups "NAME:drafter...": one type -> one drafter per GPU; two types -> one pair per GPU. TAU_G0 / TAU_G1 instead
  # name the entries of GPU 0 / GPU 1 themselves: LABEL=RUN[,config=value], RUN from runs/RUN/final or else the
  # stashed init/RUN or drafters/RUN, e.g. "carry-off=dflash-carryover,carryover=false" (rows withheld)
  groups=()
  if [ -n "${TAU_G0:-}${TAU_G1:-}" ]; then
    for g in 0 1; do v=TAU_G$g; [ -n "${!v:-}" ] && groups+=("gpu$g:${!v}"); done
  else for t in "${TYPES[@]}"; do
    if [ ${#TYPES[@]} = 1 ]; then groups+=("$t-baseline:$t-baseline=$t-baseline" "$t-carryover:$t-carryover=$t-carryover")
    else groups+=("$t:$t-baseline=$t-baseline $t-carryover=$t-carryover"); fi
  done; fi
  for i in "${!groups[@]}"; do D=""; for e in ${groups[$i]#*:}; do D="$D $(resolve_drafter $e)"; done
    g=$i; [[ ${groups[$i]} == gpu[01]:* ]] && g=${groups[$i]:3:1}
    tau_run $g ${groups[$i]%%:*} $D &
  done
  wait
  for g in "${groups[@]}"; do D=""; for e in ${g#*:}; do D="$D ${e%%=*}=x"; done
    python3 examples/evaluate_tau.py --out $R/tau_engine_${g%%:*}-$stamp --summarize_only --drafters $D | tail -8 || true
  done
  ;;
regen)  # more training responses (trainer/regenerate.py), REGEN_SETS="T:SEED:START ..." (e.g. "0:0:8000 1:1:0 1:2:0":
  # greedy for the prompts past the first 8000, then two sampled sets over all), set i on GPU i % 2 with REGEN_WORKERS
  # processes each, into ~/assets/data/train/regen-T<T>-s<SEED>; prompts from ~/assets/prompts/sharegpt_train.jsonl
  # (carry assets/prompts made by `trainer/prepare_prompts.py --train 20000`). Each set returns as 15 MB tar parts.
  # REGEN_ENGINE=vllm: one vLLM engine per GPU for its sets (trainer/regenerate.py --engine vllm --sets) instead of
  # REGEN_WORKERS transformers processes per set. REGEN_DTYPE=float32: the target in fp32 (sets named regen-T<T>-s<SEED>-float32). The 2026-11-30f run found
  # the drafter scoring higher on bf16 greedy responses than on fp32 ones, while τ is measured in fp32.
  ready_target
  [ -d assets/prompts ] && rm -rf "$A/prompts" && cp -r assets/prompts "$A/prompts"
  log "regen: $(wc -l < $A/prompts/sharegpt_train.jsonl) training prompts"
  # REGEN_DTYPE sets go to ~/assets/data/train_<dtype>/, outside the default training folder, so that a training run
  # takes them only when named (train1's S1_ARMS). REGEN_GPUS="0 1": one set's workers alternate over both GPUs
  # (default: set i on GPU i % 2).
  D=$A/data/train${REGEN_DTYPE:+_$REGEN_DTYPE}; mkdir -p $D
  spec_vars() {  # spec_vars SPEC: t seed start name prompts out of a set; "eval": greedy responses to the held-out
    # prompts, into ~/assets/data/eval (train1's held-out metrics)
    IFS=: read -r t seed start <<< "$1"; name=regen-T$t-s$seed${REGEN_DTYPE:+-$REGEN_DTYPE}
    prompts=$A/prompts/sharegpt_train.jsonl; out=$D
    [ "$1" = eval ] && { t=0; seed=0; start=0; name=heldout-T0; prompts=$A/prompts/sharegpt.jsonl; out=$A/data/eval; }
    true
  }
  ship_set() {  # the set back as 15 MB tar parts
    n=$(find $out/$name -name "shard-*.jsonl" -exec cat {} + | wc -l)  # w<i>/ folders, or none with one worker
    log "$name: $n responses (${REGEN_ENGINE:-transformers}, in $out)"
    tar czf - -C $out $name | split -b 15M - "$OUT/data-$name.tgz.part"
  }
  sets=(${REGEN_SETS:-1:1:0}); queue=()
  if [ "${REGEN_ENGINE:-}" = vllm ]; then  # per GPU one vLLM engine for all its sets of one start (regenerate.py
    # --sets), the held-out set ("eval", other prompts) after it: vLLM sizes its KV cache from the memory free at its
    # start, so two engines starting together on one GPU both failed (2026-12-01d), and each start costs ~60 s
    [ -d "$A/vllm_site/vllm" ] || { log "REGEN_ENGINE=vllm: no vLLM in $A/vllm_site (vllmstash .vllm/bundle first)"; exit 1; }
    serve_target
    for i in "${!sets[@]}"; do g=$(gpu $i); queue[$g]="${queue[$g]:-} ${sets[$i]}"; done
    vllm_run() {  # vllm_run GPU PROMPTS OUT START LOG [T:SEED...]: with sets, OUT/regen-T<T>-s<SEED>; else greedy into OUT
      local g=$1 pr=$2 o=$3 st=$4 lg=$5; shift 5
      local sets_arg=(); [ $# -gt 0 ] && sets_arg=(--sets "$@")
      CUDA_VISIBLE_DEVICES=$g PYTHONPATH=$A/vllm_site:$PYTHONPATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        timeout $(call_box ${REGEN_SECONDS:-400}) python3 trainer/regenerate.py --engine vllm --target $A/serve/target \
        --prompts $pr --out $o --start $st --batch_size 512 --gpu_memory_utilization 0.85 \
        ${REGEN_DTYPE:+--dtype $REGEN_DTYPE} "${sets_arg[@]}" > "$L/$lg-vllm.log" 2>&1 || log "$lg (vllm) stopped: $?"
    }
    for g in "${!queue[@]}"; do
      ( starts=$(for spec in ${queue[$g]}; do [ $spec = eval ] || echo ${spec##*:}; done | sort -un)
        for st in $starts; do
          grp=(); for spec in ${queue[$g]}; do [ $spec != eval ] && [ ${spec##*:} = $st ] && grp+=($spec); done
          vllm_run $g $A/prompts/sharegpt_train.jsonl $D $st gpu$g-start$st "${grp[@]%:*}"  # T:SEED of each
          for spec in "${grp[@]}"; do spec_vars $spec; ship_set; done
        done
        if [[ " ${queue[$g]} " == *" eval "* ]]; then  # greedy into data/eval/heldout-T0 (spec_vars' name)
          spec_vars eval; vllm_run $g $prompts $out/$name 0 $name; ship_set
        fi ) &
    done
    wait
    exit 0
  fi
  for i in "${!sets[@]}"; do  # REGEN_WORKERS transformers processes per set, set i on GPU i % 2 (REGEN_GPUS: all)
    spec_vars ${sets[$i]}; gpus=(${REGEN_GPUS:-$(gpu $i)})
    ( for w in $(seq 0 $((${REGEN_WORKERS:-4} - 1))); do
        CUDA_VISIBLE_DEVICES=${gpus[$((w % ${#gpus[@]}))]} timeout $(call_box ${REGEN_SECONDS:-400}) python3 trainer/regenerate.py \
          --prompts $prompts --out $out/$name --temperature $t --seed $seed --start $start \
          --num_workers ${REGEN_WORKERS:-4} ${REGEN_DTYPE:+--dtype $REGEN_DTYPE} \
          --worker_index $w > "$L/$name-w$w.log" 2>&1 &
      done; wait
      ship_set ) &
  done
  wait
  ;;
gentau)  # τ through target.generate(assistant_model=...) itself, fp32, GEN_WORKERS processes per GPU (a 135M target
  # decodes launch-bound), GPU g measuring the drafters GEN_G<g> (LABEL=RUN entries as in `tau`), temperatures
  # GEN_TEMPS, within GEN_SECONDS; datasets interleaved, so a cut run covers each dataset's first prompts alike.
  # Draft trees through generate() (drafter.use_draft_tree, greedy): an entry such as
  # "carry-t63lk=dflash-carryover-gated,tree=model_cards/smollm2-135m-instruct-dflash-carryover/draft_tree.json,tree_nodes=63,lookup=15"
  ready_target
  gen_run() {  # gen_run GPU DRAFTER...
    local g=$1; shift
    CUDA_VISIBLE_DEVICES=$(gpu $g) timeout $(call_box ${GEN_SECONDS:-300}) python3 examples/evaluate_tau.py --prompts_dir $A/prompts \
      --dtype float32 --workers ${GEN_WORKERS:-12} --drafters "$@" --datasets mtbench humaneval sharegpt \
      --temperatures ${GEN_TEMPS:-0} --out $R/tau_gen_gpu$g > $R/tau_gen_gpu$g.log 2>&1 || log "generate tau on GPU $g stopped: $?"
    python3 examples/evaluate_tau.py --out $R/tau_gen_gpu$g --summarize_only --drafters "$@" | tail -8 || true
  }
  for g in 0 1; do v=GEN_G$g; [ -n "${!v:-}" ] || continue
    D=""; for e in ${!v}; do D="$D $(resolve_drafter $e)"; done
    gen_run $g $D &
  done
  wait
  ;;
ddp)  # trainer/ddp_check.sh on the real target: stage 1 from scratch on 1 GPU (batch DDP_BATCH) and on 2 GPUs (half
  # each), same seed and steps, then 20 stage-2 steps on 2 GPUs; curves and held-out metrics in $R/ddp_check.json.
  # DDP_DATA (default ~/assets/data): a frozen copy when a `regen` beside it is adding response sets to ~/assets/data
  ready_target
  OUT=$R DDP_TARGET=reference DDP_STEPS=${DDP_STEPS:-300} DDP_BATCH=${DDP_BATCH:-16} DDP_LOG_EVERY=10 \
    DDP_EVAL_RECORDS=64 timeout $(call_box ${DDP_SECONDS:-330}) bash trainer/ddp_check.sh ${DDP_DATA:-$A/data} > "$L/ddp_check.log" 2>&1 \
    || log "ddp check stopped: $?"
  tail -5 "$L/ddp_check.log"
  ;;
fetch)  # the parts still queued, 4 a call
  ship
  ;;
vllmstash)
  if [ -d .vllm/bundle ]; then  # install as make_vllm_bundle.sh says: the wheels, then the slimmed vllm tree on top
    rm -rf "$A/vllm_site" && mkdir -p "$A/vllm_site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$A/vllm_site" .vllm/bundle/wheels/*.whl
    tar xJf .vllm/bundle/vllm026_slim_sm90.tar.xz -C "$A/vllm_site"
    log "vllm installed: $(PYTHONPATH=$A/vllm_site:$PYTHONPATH python3 -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
  fi
  for d in .vllm/drafters/*/; do [ -d "$d" ] && mkdir -p "$A/drafters" && rm -rf "$A/drafters/$(basename $d)" \
    && cp -r "$d" "$A/drafters/" && log "stashed drafter $(basename $d)"; done
  # a folder saved by an older commit carries that commit's remote code, which generate() runs (2026-11-30h: it ignored
  # prompt_lookup_num_tokens); measure with this commit's code
  for d in $A/drafters/*/; do [ -f "$d/generation_carryover.py" ] && \
    cp hf_carryover/{modeling_drafter,configuration_drafter,generation_carryover}.py "$d"; done
  [ -f .device/p1/part00 ] && cp .device/p1/part00 "$A/" && log "stashed GGUF part 1"
  [ -d assets/prompts ] && rm -rf "$A/prompts" && cp -r assets/prompts "$A/prompts" && log "stashed prompts"
  unpack_cache
  (nvidia-smi -L || echo "no nvidia-smi") > "$R/gpu.txt"
  ;;
vllm)
  [ -d "$A/vllm_site/vllm" ] || { log "no vLLM in $A/vllm_site: run vllmstash carrying .vllm/bundle first"; exit 1; }
  have_target || join_gguf
  [ -d "$A/prompts" ] || cp -r assets/prompts "$A/prompts"
  S=$A/serve; rm -rf "$S" && mkdir -p "$S"
  python3 -c "from hf_carryover.reference import save_reference_for_serving as s; print(s('$S/target'))" 2>&1 | tail -1
  log "serving target: $(du -sh $S/target | cut -f1) $(grep -o '"dtype": "[a-z0-9]*"' $S/target/config.json)"
  EXPORTS=""; ENGINE_D=""
  for n in ${VLLM_DRAFTERS:-dflash-baseline}; do
    src=$A/runs/$n/final; [ -d "$src" ] || src=$A/drafters/$n
    if [ -d "$src" ] && python3 -m hf_carryover.export "$src" "$S/$n" >> "$L/export.log" 2>&1; then
      EXPORTS="$EXPORTS $n=$S/$n"; ENGINE_D="$ENGINE_D $n=$src"; log "exported $n from $src"
    else log "drafter $n: none at $src, or its export failed (export.log)"; fi
  done
  for n in ${ENGINE_ONLY:-}; do ENGINE_D="$ENGINE_D $(resolve_drafter $n=$n)"; done  # e.g. a Carryover drafter
  B="--prompts_dir $A/prompts --datasets ${VLLM_DATASETS:-humaneval mtbench} --limit ${VLLM_LIMIT:-10}"
  B="$B --max_new_tokens ${VLLM_MAX_NEW:-256} --batch_sizes ${VLLM_BATCHES:-1 8} --out $R/bench"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
  vllm_bench() {  # bundle first on the path (its pydantic etc. are the versions vLLM was checked with); no network
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$A/vllm_site:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
      TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 timeout -k 20 $(call_box ${VLLM_SECONDS:-$1}) $(pin 0) python3 examples/bench_vllm.py \
      --target $S/target ${EXPORTS:+--drafter_export $EXPORTS} --num_speculative_tokens ${VLLM_K:-15} $B \
      ${VLLM_EXTRA:-} > "$L/bench_vllm.log" 2>&1 || log "vllm bench stopped: $?"
  }
  engine_bench() {  # our engine, same bf16 weights file, CUDA graphs; ENGINE_METHODS="engine_ar engine engine_lookup"
    # with ENGINE_FLAGS="--compile --lookup 15" adds the context-lookup rows
    CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${ENGINE_SECONDS:-$2}) $(pin $1) python3 examples/benchmark.py --target $S/target \
      ${ENGINE_D:+--drafters $ENGINE_D} --methods ${ENGINE_METHODS:-engine_ar engine} --cuda_graphs ${ENGINE_FLAGS:-} $B > "$L/bench_engine.log" 2>&1 \
      || log "engine bench stopped: $?"
  }
  gpu1_extra() {  # after the engine rows on GPU 1 (VLLM_GPU1_EXTRA=1): compile exactness in fp32 on a random
    # SmolLM2-shaped target, then the Qwen3-4B-shaped timing projection
    CUDA_VISIBLE_DEVICES=$(gpu 1) timeout $(call_box ${CHECK_SECONDS:-150}) python3 trainer/gpu_engine_check.py --compile --dtypes fp32 \
      --batch_sizes 1 --out $R/gpu_engine_check_fp32.json > "$L/gpu_engine_check.log" 2>&1 || log "engine check stopped: $?"
    flush
    CUDA_VISIBLE_DEVICES=$(gpu 1) timeout $(call_box 90) python3 examples/benchmark.py --prompts_dir $A/prompts --target qwen3-4b-random \
      --random_drafter --datasets mtbench --limit 2 --max_new_tokens 128 --methods engine_ar engine --profile \
      --out $R/bench4b > "$L/bench4b.log" 2>&1 || log "4B projection stopped: $?"
  }
  if [ "$ngpu" -ge 2 ]; then
    (engine_bench 1 ${ENGINE_BOX:-300}; flush; [ "${VLLM_GPU1_EXTRA:-0}" = 1 ] && gpu1_extra
     [ "${VLLM_GPU1_PROFILE:-0}" = 1 ] && profile_job 1 vllm; flush) & vllm_bench 450; wait
  else vllm_bench 330; flush; engine_bench 0 150; fi
  python3 examples/results_tables.py --bench $R/bench/bench_raw.jsonl > $R/bench_table.md 2>&1 || true
  cat $R/bench_table.md
  log "vllm done"
  ;;
engine)  # engine (and HF) benchmark rows without vLLM, on two GPUs: E0 / E1 are the jobs of GPU 0 / GPU 1, run in order,
  # separated by ';'. A job is "METHODS|DRAFTERS|DATASETS|FLAGS": benchmark.py methods, drafter names (from
  # ~/assets/drafters, stashed by vllmstash carrying .vllm/drafters, else runs/NAME/final), datasets, flags that
  # override the defaults below (e.g. --compile, --limit 32 --batch_sizes 1 2 4 8 16, --temperature 1) and an optional
  # fifth field, the job's time box in seconds (default ENGINE_BOX; cut by call_box to the call's time left; a compiled
  # job whose box comes out under ENGINE_MIN_BOX, 150 s, is not started: too_short). The job
  # "profile" splits a generate() round's time on the GPU (examples/profile_generate.py --device cuda); the job
  # "attnbench" times one layer's attention per way of calling it (trainer/gpu_attention_bench.py); the job
  # "engprofile" splits a captured engine round's (examples/profile_engine.py, PROFILE_* below); the job
  # "check" runs the fp32 exactness check of compiled rounds (CHECK_SECONDS, CHECK_KINDS, CHECK_BATCHES, CHECK_LOOKUP,
  # CHECK_DETERMINISTIC=1, CHECK_CONTINUOUS=1: continuous batching against static too (with and without
  # prefill_ahead; CHECK_AHEAD=N: also prefill_ahead=N), CHECK_COMPILE=0: graph engines without the compiled one,
  # CHECK_INDUCTOR="freezing=True": the compiled engine's inductor options,
  # CHECK_TREE=N with CHECK_DRAFTER: its draft_tree.json, N nodes a round, CHECK_ATTENTION=triton: every engine on the
  # Triton attention kernel; CHECK_ENGINE="rope_table=True": SpeculativeEngine arguments of every engine;
  # CHECK_COMPILE_ENGINE="gemv_rows=64": those of the compiled engine only; CHECK_COMPILE_ONLY=1: only the compiled
  # engine against the eager one, no graph engine or sampled extras, for short time boxes): a random
  # drafter, or with CHECK_DRAFTER=NAME a trained one on the real target, also against plain greedy decoding. The job
  # "gencheck" checks generate()'s static rounds (trainer/gpu_generate_check.py, GENCHECK_* below). The job
  # "replaydiff" compares eager and replayed rounds round by round (trainer/gpu_replay_diff.py, REPLAY_* below).
  # Each job's rows land in $R/<HHMMSS of this call>_gpu<g>_<job>/bench_raw.jsonl (a later call on the same warm
  # machine gets its own folders), flushed to $OUT after every job.
  stamp=$(date +%H%M%S)
  have_target || join_gguf
  serve_target; S=$A/serve
  [ -d "$A/prompts" ] || cp -r assets/prompts "$A/prompts"
  ejob() {  # ejob GPU INDEX "METHODS|DRAFTERS|DATASETS|FLAGS"; TURN=DIR:I:N: benchmark.py's --timing_turn
    if [ -n "${TURN:-}" ] && [[ "$3" != *"|"* ]]; then  # would run beside the group's timed rows
      log "job '$3' skipped: ENGINE_TURNS=1 runs benchmark rows only"; return
    fi
    if [ "$3" = check ]; then  # CHECK_DRAFTER=NAME: the real target, that trained drafter and MT-Bench prompts
      T=""; if [ -n "${CHECK_DRAFTER:-}" ]; then f=$(drafter_dir $CHECK_DRAFTER)
        T="--target reference --drafter $f --prompts_dir $A/prompts"; fi
      CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${CHECK_SECONDS:-200}) $(pin $1) python3 trainer/gpu_engine_check.py $([ "${CHECK_COMPILE:-1}" = 0 ] || echo --compile) --dtypes fp32 \
        --kinds ${CHECK_KINDS:-dflash} --batch_sizes ${CHECK_BATCHES:-1} $T ${CHECK_LOOKUP:+--lookup $CHECK_LOOKUP} \
        ${CHECK_DETERMINISTIC:+--deterministic} ${CHECK_CONTINUOUS:+--continuous} ${CHECK_COMPILE_ONLY:+--compile_only} \
        ${CHECK_AHEAD:+--prefill_ahead $CHECK_AHEAD} \
        ${CHECK_INDUCTOR:+--inductor $CHECK_INDUCTOR} ${CHECK_TREE:+--tree ${f:?CHECK_TREE needs CHECK_DRAFTER}/draft_tree.json \
        --tree_nodes $CHECK_TREE} ${CHECK_ATTENTION:+--attention $CHECK_ATTENTION} ${CHECK_ENGINE:+--engine_options $CHECK_ENGINE} \
        ${CHECK_COMPILE_ENGINE:+--compile_engine_options $CHECK_COMPILE_ENGINE} \
        --out $R/${stamp}_engine_check_fp32.json \
        > "$L/check_$stamp.log" 2>&1 || log "engine check stopped: $?"
      flush; return
    fi
    if [ "$3" = profile ]; then profile_job $1 $stamp; flush; return; fi
    if [ "$3" = attnbench ]; then  # trainer/gpu_attention_bench.py: one layer's attention per way of calling it, at the
      # reference target's shapes, compiled and captured (ATTN_ARGS added, ATTN_SECONDS)
      CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${ATTN_SECONDS:-120}) $(pin $1) python3 trainer/gpu_attention_bench.py \
        ${ATTN_ARGS:-} --out $R/${stamp}_attention_bench.json > "$L/attnbench_$stamp.log" 2>&1 \
        || log "attention bench stopped: $?"
      flush; return
    fi
    if [ "$3" = engprofile ]; then  # examples/profile_engine.py: where a captured round's time goes (batch 1, bf16),
      # PROFILE_DRAFTER (default dflash-carryover-gated) with its draft_tree.json, once per PROFILE_INDUCTOR variant
      # (';'-separated inductor option lists, "-" for none) and PROFILE_ENGINE variant (';'-separated engine option
      # lists, e.g. "-;attention=triton"), modes PROFILE_MODES, PROFILE_ARGS added
      f=$(drafter_dir ${PROFILE_DRAFTER:-dflash-carryover-gated})
      IFS=';' read -ra V <<< "${PROFILE_INDUCTOR:--}"; IFS=';' read -ra EV <<< "${PROFILE_ENGINE:--}"; i=0
      for v in "${V[@]}"; do v=$(sed 's/^ *//; s/ *$//' <<< "$v"); [ "$v" = - ] && v=""
        for e in "${EV[@]}"; do e=$(sed 's/^ *//; s/ *$//' <<< "$e"); [ "$e" = - ] && e=""
          CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${PROFILE_SECONDS:-300}) $(pin $1) python3 examples/profile_engine.py \
            --drafter $f --tree $f/draft_tree.json --prompts_dir $A/prompts --modes ${PROFILE_MODES:-ar tree_lookup} \
            ${v:+--inductor $v} ${e:+--engine_options $e} ${PROFILE_ARGS:-} --out $R/${stamp}_profile_engine_$i.json \
            > "$L/engprofile_${stamp}_$i.log" 2>&1 || log "engine profile $i stopped: $?"
          flush; i=$((i+1))
        done
      done
      return
    fi
    if [ "$3" = replaydiff ]; then  # trainer/gpu_replay_diff.py: where eager and replayed rounds part, round by round,
      # on the real target and REPLAY_DRAFTER (default dflash-carryover-gated), once per REPLAY_MODES (--determinism;
      # default "none all"), with REPLAY_CONFIGS, REPLAY_PAIRS, REPLAY_PROMPTS; REPLAY_PROBE=N: the cumsum probe too
      f=$(drafter_dir ${REPLAY_DRAFTER:-dflash-carryover-gated})
      for m in ${REPLAY_MODES:-none all}; do
        CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${REPLAY_SECONDS:-240}) $(pin $1) python3 trainer/gpu_replay_diff.py \
          --target reference --drafter $f --prompts_dir $A/prompts --prompts ${REPLAY_PROMPTS:-2} --determinism $m \
          ${REPLAY_CONFIGS:+--configs $REPLAY_CONFIGS} ${REPLAY_PAIRS:+--pairs $REPLAY_PAIRS} \
          ${REPLAY_PROBE:+--probe_cumsum $REPLAY_PROBE} --out $R/${stamp}_replay_diff_$m.json \
          > "$L/replaydiff_${stamp}_$m.log" 2>&1 || log "replay diff ($m) stopped: $?"
        flush
      done
      return
    fi
    if [ "$3" = gencheck ]; then  # generate()'s static rounds (CUDA graphs) against plain greedy and the dynamic path,
      # fp32, the real target and GENCHECK_DRAFTER (default dflash-carryover-gated), GENCHECK_LIMIT prompts per dataset
      f=$(drafter_dir ${GENCHECK_DRAFTER:-dflash-carryover-gated})
      CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${GENCHECK_SECONDS:-150}) $(pin $1) python3 trainer/gpu_generate_check.py \
        --drafter $f --prompts_dir $A/prompts --limit ${GENCHECK_LIMIT:-5} --sampled \
        --out $R/${stamp}_generate_check_fp32.json > "$L/gencheck_$stamp.log" 2>&1 || log "generate check stopped: $?"
      flush; return
    fi
    IFS='|' read -r m d ds fl box <<< "$3"; D=""
    too_short ${box:-${ENGINE_BOX:-300}} "$fl ${ENGINE_FLAGS:-}" && { flush; return; }
    for n in $d; do  # NAME (a stashed drafter), or LABEL=NAME[,engine keys or inductor.KEY=VALUE] (resolve_drafter)
      if [[ $n == *=* ]]; then D="$D $(resolve_drafter $n)"; else D="$D $n=$(drafter_dir $n)"; fi; done
    CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${box:-${ENGINE_BOX:-300}}) $(pin $1) python3 examples/benchmark.py --target $S/target --prompts_dir $A/prompts \
      --methods $m ${D:+--drafters $D} --datasets $ds --limit ${VLLM_LIMIT:-10} --max_new_tokens ${VLLM_MAX_NEW:-256} \
      --batch_sizes ${VLLM_BATCHES:-1 8} --cuda_graphs ${ENGINE_FLAGS:-} $fl ${TURN:+--timing_turn $TURN} \
      --out $R/${stamp}_gpu$1_$2 > "$L/bench_${stamp}_gpu$1_$2.log" 2>&1 \
      || log "engine job $2 on GPU $1 stopped: $?"
    flush
  }
  gjobs() {  # the jobs of one GPU in order (each trimmed of surrounding blanks); ENGINE_TURNS=1: side by side, each
    # job one benchmark row (one drafter, dataset, batch size and method) that compiles beside the others and times
    # alone, in job order (benchmark.py --timing_turn, examples/timing_turns.py); `done` is marked again after each
    # job's process ends, so a job that fails or runs out of its box releases the others
    local g=$1 i=0 n=0 k=0 dir; IFS=';' read -ra J <<< "$2"
    if [ "${ENGINE_TURNS:-0}" = 1 ]; then
      dir=$R/turns_${stamp}_gpu$g; mkdir -p "$dir"
      for j in "${J[@]}"; do [ -n "$(sed 's/^ *//; s/ *$//' <<< "$j")" ] && n=$((n+1)); done
      for j in "${J[@]}"; do j=$(sed 's/^ *//; s/ *$//' <<< "$j"); [ -n "$j" ] || continue
        (TURN=$dir:$k:$n ejob $g $k "$j" || true; touch "$dir/done.$k") & k=$((k+1)); done
      wait; return
    fi
    for j in "${J[@]}"; do j=$(sed 's/^ *//; s/ *$//' <<< "$j"); [ -n "$j" ] && ejob $g $i "$j"; i=$((i+1)); done
  }
  # one job list (E1 empty): nothing runs beside it, so it keeps every core (its compiles too) unless ENGINE_PIN=1
  [ -n "${E1:-}" ] || ENGINE_PIN=${ENGINE_PIN:-0}
  gjobs 0 "${E0:-}" & gjobs 1 "${E1:-}"; wait
  cat $R/${stamp}_gpu*_*/bench_raw.jsonl > $R/bench_raw_$stamp.jsonl 2>/dev/null || true
  python3 examples/results_tables.py --bench $R/bench_raw_$stamp.jsonl > $R/bench_table_$stamp.md 2>&1 || true
  cat $R/bench_table_$stamp.md
  if [ $(( ${CALL_SECONDS:-600} - SECONDS )) -gt 30 ]; then pack_cache; else log "inductor cache not packed: the call's time is up"; fi
  ;;
tree)  # draft trees (hf_carryover/engine/tree.py) for the stashed drafters TREE_DRAFTERS (vllmstash's .vllm/drafters;
  # default the shipped pair). TREE_STEPS, in order (default "calib tau speed"), each flushed to $OUT when done:
  #   calib  examples/calibrate_tree.py per drafter on the first TREE_RESPONSES (400) greedy training responses
  #          (~/assets/data/train/regen-T0-s0, stashinit's), TREE_SUPERSET (512) nodes -> $R/tree_<drafter>.json
  #   tau    τ at T=0 on all 344 prompts (fp32, batched engine): per drafter the linear block and dynamic trees of
  #          TREE_NODES (default "31 63") nodes a round, each also with context lookup 15 (TAU_SECONDS box)
  #   speed  examples/benchmark.py, bf16, --compile --cuda_graphs, batch 1, TREE_LIMIT (10) prompts of MT-Bench and
  #          HumanEval: SPEED_METHODS (engine_ar, engine, engine_lookup and engine_tree(_lookup)) per drafter
  #          (SPEED_SECONDS box; each compiled round shape costs about a minute the first time)
  # TREE_DIR: where tau and speed read tree_<drafter>.json (default: this phase's calib output, e.g. a committed
  # results folder instead); TAU_DATASETS (default all three); TAU_LINEAR=0 leaves out the linear and lookup rows,
  # TREE_LOOKUP_ONLY=1 the tree rows without lookup; TAU_SIBLINGS_OFF=1 adds each tree + lookup row with
  # lookup_siblings=false (SpeculativeEngine: a looked-up token's siblings keep their own ranks), for a paired τ.
  stamp=$(date +%H%M%S)
  TD=${TREE_DIR:-$R}
  ready_target
  DR=(${TREE_DRAFTERS:-dflash-baseline dflash-carryover-gated})
  for step in ${TREE_STEPS:-calib tau speed}; do case $step in
  calib)
    for d in "${DR[@]}"; do
      timeout $(call_box ${CALIB_SECONDS:-150}) python3 examples/calibrate_tree.py --drafter $A/drafters/$d \
        --data $A/data/train/regen-T0-s0 --responses ${TREE_RESPONSES:-400} --nodes ${TREE_SUPERSET:-512} \
        --out $R/tree_$d.json > $L/calib_$d.log 2>&1 || log "calibration of $d stopped: $?"
      tail -1 $L/calib_$d.log; flush
    done ;;
  tau)
    D=""
    for d in "${DR[@]}"; do
      [ "${TAU_LINEAR:-1}" = 1 ] && D="$D $d=$A/drafters/$d $d-lookup=$A/drafters/$d,lookup=15"
      for n in ${TREE_NODES:-31 63}; do
        [ "${TREE_LOOKUP_ONLY:-0}" = 1 ] || D="$D $d-tree$n=$A/drafters/$d,tree=$TD/tree_$d.json,tree_nodes=$n"
        D="$D $d-tree$n-lookup=$A/drafters/$d,tree=$TD/tree_$d.json,tree_nodes=$n,lookup=15"
        [ "${TAU_SIBLINGS_OFF:-0}" = 1 ] && \
          D="$D $d-tree$n-lookup-nosib=$A/drafters/$d,tree=$TD/tree_$d.json,tree_nodes=$n,lookup=15,lookup_siblings=false"
      done
    done
    timeout $(call_box ${TAU_SECONDS:-420}) python3 examples/evaluate_tau.py --prompts_dir $A/prompts --dtype float32 --engine \
      --engine_batch 128 --drafters $D --datasets ${TAU_DATASETS:-mtbench humaneval sharegpt} --temperatures 0 \
      --out $R/tau_tree-$stamp > $R/tau_tree-$stamp.log 2>&1 || log "tau stopped: $?"
    python3 examples/evaluate_tau.py --out $R/tau_tree-$stamp --summarize_only --drafters $(for e in $D; do echo ${e%%=*}=x; done) \
      | tail -40 || true
    flush ;;
  speed)
    D=""; T=""; for d in "${DR[@]}"; do D="$D $d=$A/drafters/$d"; T="$T $d=$TD/tree_$d.json"; done
    timeout $(call_box ${SPEED_SECONDS:-420}) python3 examples/benchmark.py --drafters $D --tree $T --tree_nodes ${SPEED_NODES:-${TREE_NODES:-31 63}} \
      --lookup 15 --compile --cuda_graphs --batch_sizes 1 --limit ${TREE_LIMIT:-10} --prompts_dir $A/prompts \
      --datasets mtbench humaneval --methods ${SPEED_METHODS:-engine_ar engine engine_lookup engine_tree engine_tree_lookup} \
      --out $R/speed-$stamp > $R/speed-$stamp.log 2>&1 || log "speed stopped: $?"
    tail -30 $R/speed-$stamp/bench.md 2>/dev/null || tail -20 $R/speed-$stamp.log
    flush ;;
  esac; done
  ;;
esac
ls -la "$OUT"
