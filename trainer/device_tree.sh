#!/usr/bin/env bash
# The GPU calls carry the whole working tree (64 MiB a call), and the shipped drafter weights in model_cards/ take
# 48 MB of it, which leaves no room for a GGUF half (47 MB) or the vLLM bundle (56 MB). Before a session's GPU calls
# drop them from the working tree with a sparse checkout (they stay committed), and bring them back afterwards:
#   bash trainer/device_tree.sh light   # weights leave the working tree; checked on 2026-11-30: the call carried
#                                       # .device/p1 (47 MB) with the weights committed on main
#   bash trainer/device_tree.sh full    # weights back (git sparse-checkout disable)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
case ${1:-} in
light) git sparse-checkout set --no-cone '/*' '!/model_cards/*/model.safetensors'
       echo "model_cards weights out of the working tree: $(git ls-files -t model_cards | grep -c '^S' || true) files skipped" ;;
full)  git sparse-checkout disable; ls -la model_cards/*/model.safetensors ;;
*)     echo "usage: $0 light|full" >&2; exit 2 ;;
esac
