"""Did repeated passes of a benchmark row decode the same text? Reads `benchmark.py`'s `bench_raw.jsonl` files and,
for every (method, dataset, temperature) timed in two or more passes, compares the tokens each pass decoded.

Why: a row's passes run the same prompts through the same compiled engine, so at T=0 they should decode the same
tokens; where they do not, some kernel is not run-to-run deterministic, and a speed ratio then compares different
texts (and τ moves with them). The token count per pass is what the raw rows keep, so equal counts are necessary,
not sufficient, for equal texts.

    python examples/pass_determinism.py examples/results/h200-2026-12-0*/*/bench_raw.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def passes_by_row(paths: list[str]) -> dict:
    """{(file, method, dataset, temperature): [tokens of pass 0, pass 1, ...]} for rows with a `pass` field (a file
    may hold T=0 and T=1 rows of one method: their passes are not each other's)."""
    rows = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "pass" in r:
                    key = (path, r["method"], r["dataset"], r.get("temperature", 0.0))
                    rows[key].append((r["pass"], r["tokens"]))
    return {k: [t for _, t in sorted(v)] for k, v in rows.items() if len(v) > 1}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="bench_raw.jsonl files")
    args = p.parse_args(argv)
    rows = passes_by_row(args.files)
    summary = defaultdict(lambda: [0, 0])  # method kind -> [rows, rows whose passes differ]
    for (path, method, dataset, temperature), tokens in sorted(rows.items()):
        differ = len(set(tokens)) > 1
        kind = method.split("@")[0].split(":")[0]
        summary[kind][0] += 1
        summary[kind][1] += differ
        print(f"{'DIFFER' if differ else 'same  '}  {path}  {method}  {dataset}  T={temperature:g}  "
              f"tokens per pass {tokens}")
    print("\nrows timed in 2+ passes, and how many decoded different token counts:")
    for kind, (n, d) in sorted(summary.items()):
        print(f"  {kind}: {n} rows, {d} differ")
    return {k: tuple(v) for k, v in summary.items()}


if __name__ == "__main__":
    main()
