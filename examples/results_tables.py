"""Markdown tables for a results folder: τ per drafter/dataset/temperature with the Carryover gain over its
own baseline (from `examples/evaluate_tau.py` summaries) and speed rows (from the `bench_raw.jsonl` files of
`examples/benchmark.py` and `examples/bench_vllm.py`). The README tables are this script's output, so every
number traces to a file.

    python examples/results_tables.py --tau R/tau_engine_dflash.json R/tau_engine_markov.json \
        --bench R/bench_graphs_3prompts_humaneval.jsonl R/bench_graphs_3prompts_mtbench.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def tau_table(paths, baseline: str | None = None) -> str:
    """One table per temperature. Gains: against `baseline` for every other drafter if given, else a `X-carryover`
    drafter against `X-baseline`. Drafters without rows at a temperature are left out of its table."""
    rows = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["results"].values():
            rows[(r["drafter"], r["dataset"], r["temperature"])] = r
    datasets = sorted({d for _, d, _ in rows})
    temps = sorted({t for _, _, t in rows})
    out = []
    for t in temps:
        drafters = sorted({n for n, _, t2 in rows if t2 == t})
        prompts = {d: next((r["prompts"] for (_, d2, t2), r in rows.items() if d2 == d and t2 == t), "?")
                   for d in datasets}
        out += [f"**T = {t:g}** (τ = mean tokens per target forward in draft rounds; prompts per dataset in "
                "brackets)", "",
                "| drafter | " + " | ".join(f"{d} ({prompts[d]})" for d in datasets) + " | mean |",
                "|---|" + "---|" * (len(datasets) + 1)]
        for n in drafters:
            vals = [rows[(n, d, t)]["tau"] if (n, d, t) in rows else None for d in datasets]
            got = [v for v in vals if v is not None]
            mean = sum(got) / len(got) if got else None
            cells = [f"{v:.3f}" if v is not None else "–" for v in vals] + [f"{mean:.3f}" if mean else "–"]
            ref = baseline if baseline else n.replace("-carryover", "-baseline") if n.endswith("-carryover") else None
            # gains on the datasets both have; a run cut by its time box may lack some, and then its mean's gain is
            # over the shared datasets only (said in the cell), not its mean against the baseline's full mean
            both = [i for i, d in enumerate(datasets) if vals[i] is not None and (ref, d, t) in rows] if ref else []
            if ref and ref != n and both:
                base = {i: rows[(ref, datasets[i], t)]["tau"] for i in both}
                gain = sum(vals[i] for i in both) / sum(base.values()) - 1
                note = "" if len(both) == len(datasets) else f" over {', '.join(datasets[i] for i in both)}"
                cells = [f"{c} ({vals[i] / base[i] - 1:+.1%})" if i in base else c for i, c in enumerate(cells[:-1])] \
                    + [f"{cells[-1]} ({gain:+.1%}{note})"]
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def own_ar(method: str) -> str | None:
    """The autoregressive row of the same engine and batch size: engine:x@8, engine_lookup:x@8, engine_tree63:x@8c
    -> engine_ar@8 (engine_ar@8c), vllm_dflash:x@8 -> vllm_ar@8 (speedup is against plain decoding in the same
    engine, DESIGN.md §1)."""
    family, _, batch = method.partition("@")
    family = family.split(":")[0]
    ar = next((a for pre, a in (("engine", "engine_ar"), ("vllm_", "vllm_ar")) if family.startswith(pre)), None)
    return f"{ar}@{batch}" if ar and batch and family != ar else None


def bench_table(paths) -> str:
    """Speed rows of benchmark.py and bench_vllm.py (bench.json or bench_raw.jsonl files); rows with "error" show it
    instead of numbers."""
    recs = []
    for p in map(Path, paths):  # benchmark.py's bench.json (its "results") or raw rows (bench_raw.jsonl)
        text = p.read_text()
        recs += json.loads(text)["results"] if p.suffix == ".json" else [json.loads(x) for x in text.splitlines()
                                                                           if x.strip()]
    # benchmark.py --passes: the single passes ("pass": i) stand behind their median row, which lists them; a run cut
    # before its median rows keeps its passes in the table
    medians = {(r["method"], r["dataset"], r.get("prompts"), r.get("temperature", 0)) for r in recs
               if "tok_per_s_passes" in r}
    recs = [r for r in recs if "pass" not in r
            or (r["method"], r["dataset"], r.get("prompts"), r.get("temperature", 0)) not in medians]

    def ratio(r, base):  # tok/s of r over that of row `base` on the same prompts (dataset and --limit) and at the same
        # temperature (rows without one are greedy); "–" if none
        ref = next((x for x in recs if base and x["method"] == base and x["dataset"] == r["dataset"]
                    and x.get("prompts") == r.get("prompts") and x.get("temperature", 0) == r.get("temperature", 0)
                    and x.get("tok_per_s")), None)
        return f"{r['tok_per_s'] / ref['tok_per_s']:.2f}" if ref and r.get("tok_per_s") else "–"

    out = ["| dataset | T | method | prompts | tok/s | τ | engine mode | × hf_eager | × engine_ar@1 | × own AR "
           "| × vllm_ar |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        batch = r["method"].partition("@")[2]
        tps = f"{r['tok_per_s']:.1f}" if r.get("tok_per_s") else "error: " + str(r.get("error"))[:80].replace("|", "/")
        if r.get("tok_per_s_passes"):  # the median of several passes: their range beside it
            tps += f" ({min(r['tok_per_s_passes']):.0f}–{max(r['tok_per_s_passes']):.0f})"
        elif "pass" in r:
            tps += f" (pass {r['pass']})"
        tau = f"{r['tau']:.3f}" if r.get("tau") else "–"
        sp = [ratio(r, m) for m in ("hf_eager", "engine_ar@1", own_ar(r["method"]), batch and f"vllm_ar@{batch}")]
        out.append(f"| {r['dataset']} | {r.get('temperature', 0):g} | {r['method']} | {r['prompts']} | {tps} | {tau} | "
                   f"{r.get('mode', '–')} | "
                   + " | ".join(sp) + " |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tau", nargs="*", default=[])
    p.add_argument("--bench", nargs="*", default=[])
    p.add_argument("--baseline", help="τ gains of every drafter against this one (default: X-carryover vs X-baseline)")
    args = p.parse_args()
    if args.tau:
        print(tau_table(args.tau, args.baseline))
    if args.bench:
        print(bench_table(args.bench))


if __name__ == "__main__":
    main()
