# The shell functions of trainer/h200_pipeline.sh, sourced by it (not run on their own). They read the globals the
# pipeline sets before sourcing: A (~/assets), OUT, L and R (the phase's log and result folders), NGPU, and its
# log/gpu helpers. Kept apart so that the pipeline file holds its phases, and tests/test_pipeline_script.py runs
# the functions that guard a GPU call (join_gguf, call_box, too_short, the inductor cache's packing) in bash on the CPU.

serve_target() {  # the bf16 serving folder of the converted target, ~/assets/serve/target, made once per machine
  [ -d "$A/serve/target" ] || python3 -c "from hf_carryover.reference import save_reference_for_serving as s; s('$A/serve/target')"
}
call_box() {  # call_box SECONDS [quiet]: that time box, cut to what is left of the device call since this script
  # started (CALL_SECONDS, default 600, the call's limit; 15 s kept for the flush; the cut logged unless quiet), so that
  # a job ends and its rows travel before the call is killed (2026-12-04c: the GGUF join and conversion ran before a
  # 570 s box, and the call was killed at 600 s mid-row). Every `timeout` of the pipeline takes its box through it.
  local left=$(( ${CALL_SECONDS:-600} - SECONDS - 15 ))
  if [ "$1" -gt "$left" ]; then
    [ -n "${2:-}" ] || log "time box $1 s cut to $left s (CALL_SECONDS=${CALL_SECONDS:-600}, $SECONDS s gone)" >&2
    echo $(( left > 1 ? left : 1 ))
  else echo "$1"; fi
}
too_short() {  # too_short SECONDS FLAGS: true (and logged) for a compiled job (FLAGS hold --compile) whose box, as
  # call_box would cut it, is under ENGINE_MIN_BOX (default 150 s), so the job is not started. Why: a compiled row took
  # 106-186 s in h100-2026-12-06b, warm inductor cache included, and a call of three jobs boxed at 95-120 s ran all
  # three into their boxes and returned no row (316 s of device time); a skipped job returns the call that much sooner.
  [[ " $2 " == *" --compile "* ]] || return 1
  local b; b=$(call_box "$1" quiet)  # quiet: the job's own call_box logs the cut
  [ "$b" -lt "${ENGINE_MIN_BOX:-150}" ] || return 1
  log "compiled job not started: its box would be $b s, under ENGINE_MIN_BOX=${ENGINE_MIN_BOX:-150} s"
}
pack_cache() {  # pack_cache: ~/assets/inductor as gzip tar parts of PACK_PART_MB (15) MiB into $OUT/inductor.tgz.part*,
  # at most PACK_PARTS (4) of them (a larger cache stays behind, logged); off unless PACK_CACHE=1: in 12-04e the caches
  # were 246-481 MiB, never returned, and packing them cost device time every call. Carry parts that do come back as
  # .device/inductor (with a drafter folder while they stay under ~38 MB, else in a vllmstash call of their own)
  [ "${PACK_CACHE:-0}" = 1 ] && [ -d "$A/inductor" ] || return 0
  local part=${PACK_PART_MB:-15} max=${PACK_PARTS:-4}
  tar czf "$A/.inductor.tgz" -C "$A" inductor || { rm -f "$A/.inductor.tgz"; return 0; }
  local size; size=$(stat -c %s "$A/.inductor.tgz")
  if [ "$size" -gt $(( part * max * 1048576 )) ]; then
    log "inductor cache: $(( size / 1048576 )) MiB packed, over $max parts of $part MiB: not returned"
    # what fills it (12-04e: 246-481 MiB packed after one to three engine calls), for choosing what to return
    log "inductor cache by folder (MiB): $(cd "$A/inductor" && { du -sm -- */; du -sm -- */*/; } 2>/dev/null | sort -k1,1nr -k2,2 | head -8 | awk '{printf "%s %s; ", $2, $1}')"
  else
    rm -f "$OUT"/inductor.tgz.part*
    split -b ${part}m -d "$A/.inductor.tgz" "$OUT/inductor.tgz.part" \
      && log "inductor cache returned: $(( size / 1048576 )) MiB in $(ls "$OUT"/inductor.tgz.part* | wc -l) part(s)"
  fi
  rm -f "$A/.inductor.tgz"
}
unpack_cache() {  # unpack_cache: a carried .device/inductor/inductor.tgz.part* into ~/assets/inductor (merged with
  # what this machine compiled already). Unpacked aside first, so that a damaged archive leaves no half-written entry
  # for inductor to load: it is logged and left out
  ls .device/inductor/inductor.tgz.part* >/dev/null 2>&1 || return 0
  local tmp="$A/.inductor_unpack"; rm -rf "$tmp"; mkdir -p "$tmp"
  if cat .device/inductor/inductor.tgz.part* | tar xzf - -C "$tmp" 2>/dev/null && [ -d "$tmp/inductor" ]; then
    mkdir -p "$A/inductor" && cp -a "$tmp/inductor/." "$A/inductor/" \
      && log "stashed inductor cache ($(du -sm "$A/inductor" | cut -f1) MiB)"
  else log "inductor cache: the carried parts did not unpack; left out"; fi
  rm -rf "$tmp"
}
pin() {  # pin GPU: the command prefix that keeps a GPU's job on its own half of the cores (ENGINE_PIN=0: off). The
  # batch-1 engine is launch-bound, so a job compiling on all cores beside it slows it: the likely cause of the
  # 2026-11-30e speed differences between calls. Inductor's compile threads are capped to the same half.
  local n; n=$(nproc); local h=$((n / 2))
  if [ "${ENGINE_PIN:-1}" = 1 ] && command -v taskset >/dev/null && [ "$h" -ge 2 ]; then
    echo "env TORCHINDUCTOR_COMPILE_THREADS=$h taskset -c $(( $1 * h ))-$(( $1 * h + h - 1 ))"
  fi
}
drafter_dir() {  # drafter_dir NAME: the stashed drafter folder (vllmstash's .vllm/drafters), else this machine's run
  if [ -d "$A/drafters/$1" ]; then echo "$A/drafters/$1"; else echo "$A/runs/$1/final"; fi
}
profile_job() {  # profile_job GPU TAG: where a generate() round's time goes on the GPU (bf16, batch 1): target
  # forwards, our candidate generator, transformers' loop; PROFILE_DRAFTER (default dflash-carryover-gated), with and
  # without lookup
  local f; f=$(drafter_dir ${PROFILE_DRAFTER:-dflash-carryover-gated})
  CUDA_VISIBLE_DEVICES=$(gpu $1) timeout $(call_box ${PROFILE_SECONDS:-200}) $(pin $1) python3 examples/profile_generate.py --device cuda \
    --drafter $f --num_assistant_tokens 15 4 --lookup 15 --max_new_tokens 128 --out $R/$2_profile_gpu$1.json \
    > "$L/profile_$2.log" 2>&1 || log "profile stopped: $?"
}
l1_flag() {  # l1_flag TYPE: the Markov drafter trains DSpark's 0.1 CE + 0.9 ||p_draft - p_target||_1 (both stages)
  [ "$1" = markov ] && echo "--l1_weight 0.9" || true
}
have_target() { [ -f "$A/cache/SmolLM2-135M-Instruct/hf_carryover_source.json" ] || [ -f "$A/smollm2.gguf" ]; }
ready_target() {  # the converted reference target, joining the GGUF first where this machine has none yet
  have_target || join_gguf
  python3 -c "from hf_carryover.reference import reference_target as r; r()" 2>&1 | tail -1
}
join_gguf() {  # the reference GGUF from stash's half and the carried .device/p2 half, md5-checked. Called as
  # `have_target || join_gguf`, where bash's set -e does not reach inside the function: each step returns on failure
  # itself, and a GGUF that fails its check is removed (2026-12-02d: a call on a fresh machine without the stashed
  # half left an empty GGUF that have_target then took for the target, and the next call failed on it)
  [ -f "$A/part00" ] && [ -f .device/p2/part01 ] \
    || { log "join_gguf: needs $A/part00 (stash, carrying .device/p1) and .device/p2/part01 (carried here)"; return 1; }
  cat "$A/part00" .device/p2/part01 > "$A/smollm2.gguf.part" || return 1
  (cd "$A" && echo "$(cut -d' ' -f1 "$OLDPWD/.device/p2/smollm2.md5")  smollm2.gguf.part" | md5sum -c -) \
    || { rm -f "$A/smollm2.gguf.part"; log "join_gguf: md5 mismatch, the halves do not make the target"; return 1; }
  mv "$A/smollm2.gguf.part" "$A/smollm2.gguf"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
}

last_fit() {  # the last LR-schedule fit in a train_log.json (indented JSON, so grep cannot read it): "steps s/step"
  python3 -c "import json,sys; f=[e for e in json.load(open(sys.argv[1])) if 'seconds_per_step' in e]; print(f'{f[-1][\"schedule_fitted_to_steps\"]} {f[-1][\"seconds_per_step\"]:.3f}' if f else '')" "$1"
}

pack() {  # pack NAME...: bf16 copies of ~/assets/runs/NAME/final, queued in ~/assets/outbox as 15 MB tar parts
  python3 - "$@" <<'PY'
import os, sys, torch
from hf_carryover import Drafter
A = os.path.expanduser("~/assets")
for r in sys.argv[1:]:
    Drafter.from_pretrained(f"{A}/runs/{r}/final", dtype=torch.bfloat16).save_pretrained(f"{A}/pack/{r}")
PY
  mkdir -p $A/outbox
  for r in "$@"; do
    cp $A/runs/$r/final/{eval_metrics,train_log}.json $A/pack/$r/ 2>/dev/null || true
    n=$(ls $A/outbox $A/shipped 2>/dev/null | grep -c part || true)
    tar cf - -C $A/pack $r | split -b 15M - "$A/outbox/q$(printf %03d $n)-ckpt-$r.tar.part"
  done
}
ship() {  # ship [N [RUN...]]: moves the oldest queued parts (of RUN... only, if named) to $OUT, N (4) x 15 MB a call
  # (the limit is 64 MB); the rest wait. Two stage2 phases side by side name their runs, so neither takes the other's
  local n=${1:-4}; shift || true; local only=" $* "
  mkdir -p $A/shipped
  for f in $(ls $A/outbox 2>/dev/null | sort); do
    r=${f#q???-ckpt-}; r=${r%.tar.part*}; [ "$only" = "  " ] || [[ $only == *" $r "* ]] || continue
    [ $n -gt 0 ] || break; n=$((n - 1))
    cp $A/outbox/$f "$OUT/" && mv $A/outbox/$f $A/shipped/
  done
  log "shipped: $(ls $OUT | grep part | tr '\n' ' '); still queued: $(ls $A/outbox | wc -l)"
}

resolve_drafter() {  # LABEL=RUN[,opts] -> LABEL=FOLDER[,opts]: RUN from runs/RUN/final, else init/RUN or drafters/RUN
  local label=${1%%=*} rest=${1#*=}; local run=${rest%%,*} opts=""; [[ $rest == *,* ]] && opts=,${rest#*,}
  for f in $A/runs/$run/final $A/init/$run $A/drafters/$run; do [ -d $f ] && { echo "$label=$f$opts"; return; }; done
  log "no drafter folder for $run" >&2
}
