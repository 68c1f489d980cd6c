"""Where training left a gated Carryover drafter's gate: the learned attention-logit bias on the carryover keys.

    python examples/carryover_gate_values.py runs/h200g/dflash-carryover-gated --init -6 --out gate.json

Why: the gate (`config.carryover_gate`, one bias per layer and head) starts closed so that stage 2 begins at the
stage-1 drafter's τ; whether training then opens it says whether the drafter found the carryover states worth
attending to. A gate that stays at its initial value on average (some heads up, some down) means the objective saw
no use for the rows; one that rises across heads means it did. exp(bias) is the factor on those keys' attention
weights against a committed-context key of equal score.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from safetensors.torch import load_file


def gate_stats(folder: str | Path, init: float | None) -> dict:
    state = load_file(str(Path(folder) / "model.safetensors"))
    if "carryover_gate" not in state:
        raise SystemExit(f"{folder}: no carryover_gate tensor (not a gated drafter: config.carryover_gate is None)")
    gate = state["carryover_gate"].float()  # [layers, heads]
    layers = []
    for i, row in enumerate(gate):
        layers.append({"layer": i, "mean": row.mean().item(), "min": row.min().item(), "max": row.max().item(),
                       "values": [round(v, 4) for v in row.tolist()]})
    out = {"folder": str(folder), "shape": list(gate.shape), "mean": gate.mean().item(), "min": gate.min().item(),
           "max": gate.max().item(), "max_weight_factor": math.exp(gate.max().item()), "layers": layers}
    if init is not None:
        moved = gate - init
        out.update(init=init, mean_move=moved.mean().item(), heads_opened=int((moved > 0).sum()),
                   heads_closed=int((moved < 0).sum()), largest_opening=moved.max().item())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="drafter folders (model.safetensors with a carryover_gate)")
    p.add_argument("--init", type=float, nargs="+", help="the gate's initial value per folder (--carryover_gate)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    inits = args.init or [None] * len(args.folders)
    if len(inits) != len(args.folders):
        raise SystemExit(f"--init: {len(inits)} values for {len(args.folders)} folders")
    res = {"command": " ".join(["python"] + sys.argv), "drafters": {}}
    for folder, init in zip(args.folders, inits):
        s = gate_stats(folder, init)
        res["drafters"][Path(folder).name] = s
        line = f"{Path(folder).name}: gate mean {s['mean']:+.2f} (min {s['min']:+.2f}, max {s['max']:+.2f})"
        if init is not None:
            line += (f", moved {s['mean_move']:+.2f} on average from {init:+.1f}; {s['heads_opened']} heads opened, "
                     f"{s['heads_closed']} closed, largest opening {s['largest_opening']:+.2f}")
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
