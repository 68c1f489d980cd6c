"""How many graphs Dynamo makes of the engine's compiled rounds, and why it breaks them, per decoding mode.

Why: a compiled round is captured whole in a CUDA graph, so a graph break does not cost host time there, but it
splits the round into pieces that inductor compiles apart and cannot fuse across. On 2026-12-03 the tree round was
found in three pieces and a linear round with its prefill in five (`examples/results/h200-2026-12-03c`). This script
decodes with tiny random models on the CPU, each mode on a fresh target (as a user's first call), with
`compile="aot_eager"` (Dynamo's tracing without inductor's code generation) and the row prefill compiled as on the
GPU, and records Dynamo's counters: graphs traced (the row prefill is two: its forward and its copy-in) and graph breaks
by reason. A tree round is two graphs on purpose, split before its K/V move (`_tree_round`: so that each graph writes
each cache once, in place).

    python examples/compile_census.py --out census.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tiny model builders
sys.path.insert(0, str(ROOT / "examples"))

from test_engine_tree import WIDE  # noqa: E402  (the tests' 11-node tree)

MODES = {  # mode -> (with a drafter, generate() arguments)
    "ar": (False, {}),
    "lookup": (False, {"prompt_lookup_num_tokens": 3}),
    "linear": (True, {}),
    "linear_lookup": (True, {"prompt_lookup_num_tokens": 3}),
    "tree": (True, {"tree": WIDE}),
    "tree_lookup": (True, {"tree": WIDE, "tree_nodes": 5, "prompt_lookup_num_tokens": 3}),
    "tree_sampled": (True, {"tree": WIDE, "tree_nodes": 5, "do_sample": True}),
}


def census(mode: str) -> dict:
    from conftest import build_drafter, build_target
    from torch._dynamo.utils import counters

    from hf_carryover.engine.engine import SpeculativeEngine

    with_drafter, kw = MODES[mode]
    target = build_target("llama", seed=5)  # fresh for every mode: no forward has run on it yet
    drafter = build_drafter(target, "dflash", True) if with_drafter else None
    torch._dynamo.reset()
    counters.clear()
    engine = SpeculativeEngine(target, drafter, max_len=96, compile="aot_eager")
    engine.row_prefill = True  # compiled row prefill, as where rounds are captured
    engine.generate([[3, 5, 7, 9], [11, 13, 3, 5, 7, 9, 2, 4, 6]], max_new_tokens=12, **kw)
    breaks = {reason.split("\n")[0][:120]: n for reason, n in counters["graph_break"].items()}
    return {"mode": mode, "graphs": counters["stats"]["unique_graphs"], "breaks": sum(breaks.values()),
            "reasons": breaks, "last_mode": engine.last_mode}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out")
    args = p.parse_args(argv)
    from evaluate_tau import environment

    rows = []
    for mode in args.modes:
        rows.append(census(mode))
        print(json.dumps(rows[-1]), flush=True)
    res = {"command": " ".join(["examples/compile_census.py", *(argv if argv is not None else sys.argv[1:])]),
           "env": environment(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
