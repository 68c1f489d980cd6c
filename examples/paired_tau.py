"""Paired τ difference between two drafters (or one drafter with and without its carryover states) on the same prompts.

    python examples/paired_tau.py --raw OUT/raw-engine.jsonl --pair carry:carry-off --out paired.json

Why: two τ values over a few hundred prompts differ by a percent or two, which is within prompt-to-prompt noise unless
the comparison is paired. Each prompt (dataset, temperature, id) decoded by both drafters gives one difference of
per-prompt τ; the mean and its standard error say whether A beats B. The pooled τ of each side over the matched
prompts (Σ(accepted+1) / rounds, as evaluate_tau.py) is reported beside it. Input: evaluate_tau.py's raw-*.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from hf_carryover.evaluation.offline_tau import tau_from_rounds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_rounds import load as load_raw  # noqa: E402


def load(paths):
    """{drafter: {(dataset, temperature, id): accepted list}} from raw-*.jsonl files, gzipped or not (the last record
    wins)."""
    runs = defaultdict(dict)
    for spec in paths:
        # "PREFIX=path" renames the file's drafters PREFIX<name>: two runs that both call their drafter
        # "dflash-baseline" (an old shipped one and its successor) can then be paired
        prefix, sep, path = str(spec).partition("=")
        if not sep or "/" in prefix or Path(spec).exists():
            prefix, path = "", str(spec)
        for (drafter, *key), accepted in load_raw(path).items():
            runs[prefix + drafter][tuple(key)] = accepted
    return runs


def _tau(acc_lists):
    return tau_from_rounds({"accepted": a} for a in acc_lists)


def paired(a: dict, b: dict) -> dict:
    """Per (dataset, temperature), per temperature and overall: prompts, pooled τ of each side, mean per-prompt τ
    difference A - B and its standard error. Prompts without rounds on either side (no draft round at all) are left
    out."""
    keys = sorted(k for k in a.keys() & b.keys() if a[k] and b[k])
    groups = defaultdict(list)
    for k in keys:
        groups[f"{k[0]}|T={k[1]}"].append(k)
        groups[f"all|T={k[1]}"].append(k)  # a pair measured at two temperatures: each on its own, then pooled
    groups["all"] = keys
    out = {}
    for name, ks in groups.items():
        d = [_tau([a[k]]) - _tau([b[k]]) for k in ks]
        n = len(d)
        mean = sum(d) / n if n else math.nan
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.nan
        out[name] = {"prompts": n, "tau_a": _tau([a[k] for k in ks]), "tau_b": _tau([b[k] for k in ks]),
                     "mean_diff": mean, "se": se, "a_better": sum(x > 0 for x in d), "b_better": sum(x < 0 for x in d)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", nargs="+", required=True, help="evaluate_tau.py raw-*.jsonl files (or .jsonl.gz); "
                   "PREFIX=FILE prefixes that file's drafter names")
    p.add_argument("--pair", nargs="+", required=True, help="A:B drafter names (difference A - B)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = load(args.raw)
    from evaluate_tau import environment  # this folder is on sys.path (compare_rounds is imported from it too)

    res = {"command": " ".join(["python", Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])),
           "environment": environment(), "pairs": {}}
    for spec in args.pair:
        a, _, b = spec.partition(":")
        missing = [n for n in (a, b) if n not in runs]
        if missing:
            raise SystemExit(f"--pair {spec}: no records for {missing} in {args.raw} (drafters there: {sorted(runs)})")
        res["pairs"][spec] = paired(runs[a], runs[b])
        for name, r in res["pairs"][spec].items():
            if name.startswith("all"):
                print(f"{spec} [{name}]: {r['prompts']} prompts, τ {r['tau_a']:.3f} vs {r['tau_b']:.3f}, per-prompt "
                      f"diff {r['mean_diff']:+.4f} ± {r['se']:.4f} (A better on {r['a_better']}, B on {r['b_better']})")
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
