"""τ of a stage-1 drafter, and of the Carryover drafter stage 2 would start from, before any stage-2 step.

Why: stage 2 turns a stage-1 drafter into a Carryover one (a zero marker vector, and the rows as extra keys at
the positions the block drafts). If that start already drafts worse than the stage-1 drafter, stage 2 spends its
steps recovering. This decodes the same prompts with `generate()` three ways: the stage-1 drafter, its
Carryover version without a gate, and with a nearly closed gate (`carryover_gate`).

    python examples/carryover_init_check.py --drafter .init/dflash-stage1 --gate -6 --limit 8 --out check.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="a stage-1 (carryover=False) drafter folder")
    p.add_argument("--gate", type=float, default=-6.0)
    p.add_argument("--prompts", default="assets/prompts/sharegpt.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--out")
    args = p.parse_args()

    import hf_carryover  # noqa: F401  (the generate() hook)
    from hf_carryover import Drafter
    from hf_carryover.reference import reference_target

    target, _ = reference_target(dtype=torch.float32)
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    variants = {"stage-1 drafter": {}, "carryover, no gate": {"carryover": True},
                f"carryover, gate {args.gate:g}": {"carryover": True, "carryover_gate": args.gate}}
    out = {"command": " ".join(["python"] + sys.argv), "torch": torch.__version__, "prompts": len(rows),
           "max_new_tokens": args.max_new_tokens, "tau": {}}
    for name, kw in variants.items():
        drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32, **kw)
        accepted = []
        for r in rows:
            target.generate(torch.tensor([r["input_ids"]]), assistant_model=drafter,
                            max_new_tokens=args.max_new_tokens, do_sample=False)
            accepted += [x["accepted"] for x in drafter.last_candidate_generator.rounds]
        out["tau"][name] = (sum(accepted) + len(accepted)) / len(accepted)
        print(f"{name}: τ {out['tau'][name]:.3f} over {len(accepted)} rounds", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
