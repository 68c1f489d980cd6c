"""Compare two calibrated draft trees (`examples/calibrate_tree.py` outputs), to decide whether a drafter needs its
tree recalibrated after new training:

    python examples/compare_trees.py --calibrated runs/x/tree_new.json --other model_cards/NAME/draft_tree.json

`--calibrated` is a tree calibrated for the drafter as it is now; its prefix counts say how often a round on its
data would accept through each of its nodes. For the first n nodes of each tree (n = 15 ... 511) this prints how many
nodes the two share and the expected tokens per round of each as a static tree under those counts. A path of
`--other` outside the calibrated superset has no count there and is counted as never accepted, so the figure for
`--other` is a lower bound; how many paths that concerns is printed per n. Dynamic trees (`tree_nodes=N`) choose their
N nodes per round from the superset, so a small gap at every n means recalibration would move τ by little.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def compare(calibrated: dict, other: dict, sizes=(15, 31, 63, 127, 255, 511)) -> dict:
    """Per tree size n: shared nodes, expected tokens per round of both trees' first n nodes under the calibrated
    counts, and the other tree's nodes without a count (counted as 0)."""
    mine = [tuple(p) for p in calibrated["paths"]]
    theirs = [tuple(p) for p in other["paths"]]
    count = dict(zip(mine, calibrated["counts"]))
    anchors = calibrated["anchors"]
    rows = {}
    for n in sizes:
        if n > min(len(mine), len(theirs)):
            continue
        rows[n] = {"shared": len(set(mine[:n]) & set(theirs[:n])),
                   "calibrated": 1 + sum(count[q] for q in mine[:n]) / anchors,
                   "other_lower_bound": 1 + sum(count.get(q, 0) for q in theirs[:n]) / anchors,
                   "other_without_count": sum(q not in count for q in theirs[:n])}
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibrated", required=True, help="a tree calibrated for the drafter now (its counts are used)")
    p.add_argument("--other", required=True, help="the tree to compare, e.g. the one a drafter folder ships")
    p.add_argument("--sizes", type=int, nargs="+", default=[15, 31, 63, 127, 255, 511], help="tree sizes n compared")
    p.add_argument("--out", help="write the rows as JSON here too")
    args = p.parse_args(argv)
    rows = compare(json.loads(Path(args.calibrated).read_text()), json.loads(Path(args.other).read_text()), args.sizes)
    print("| nodes | shared | expected tokens a round, calibrated | other (lower bound) "
          "| other's nodes without a count |")
    print("|---|---|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['shared']} | {r['calibrated']:.4f} | {r['other_lower_bound']:.4f} | "
              f"{r['other_without_count']} |")
    if args.out:
        res = {"calibrated": args.calibrated, "other": args.other, "rows": rows,
               "command": " ".join(["python", Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:]))}
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
