"""Do two τ runs accept the same drafts, round by round?  E.g. `target.generate()` against the batched engine:

    python examples/compare_rounds.py GEN_DIR/raw.jsonl ENGINE_DIR/raw-engine.jsonl --out cmp.json

Both files are `examples/evaluate_tau.py` raw records (one line per drafter, dataset, temperature and prompt, each
with its `accepted` list). At T=0 in fp32 the two paths must accept the same number of drafts in every round (near
max_new_tokens the engine counts and carries only the drafts generate() would still make, and a verification
without drafts is no round in either), so τ measured through the engine is τ measured through generate().
Prints and stores, per drafter and dataset, how many prompts match round for round and both τ values.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

from hf_carryover.evaluation.offline_tau import tau_from_rounds


def load(path):
    """{(drafter, dataset, temperature, prompt id): accepted list} from a raw jsonl file, gzipped or not (the last
    record of a key wins)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    rows = {}
    for line in text.splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["drafter"], r["dataset"], float(r["temperature"]), str(r["id"]))] = r["accepted"]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="raw jsonl of the first run (e.g. generate())")
    p.add_argument("b", help="raw jsonl of the second run (e.g. the engine)")
    p.add_argument("--out")
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit("no (drafter, dataset, temperature, prompt id) in common: were both runs on the same prompts?")
    groups = defaultdict(lambda: {"prompts": 0, "same_rounds": 0, "a": [], "b": [], "differing_ids": []})
    for key in common:
        g = groups[f"{key[0]}|{key[1]}|T={key[2]}"]
        ra, rb = a[key], b[key]
        g["prompts"] += 1
        same = ra == rb
        g["same_rounds"] += same
        if not same:
            g["differing_ids"].append(key[3])
        g["a"].append(ra)
        g["b"].append(rb)
    summary = {"command": " ".join(["python"] + sys.argv), "a": args.a, "b": args.b, "groups": {}}
    for name, g in groups.items():
        summary["groups"][name] = {"prompts": g["prompts"], "same_rounds": g["same_rounds"],
                                   "tau_a": tau_from_rounds({"accepted": r} for r in g["a"]),
                                   "tau_b": tau_from_rounds({"accepted": r} for r in g["b"]),
                                   "differing_ids": g["differing_ids"]}
        s = summary["groups"][name]
        print(f"{name:40s} {s['same_rounds']}/{s['prompts']} prompts round-for-round equal; "
              f"τ {s['tau_a']:.4f} vs {s['tau_b']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
