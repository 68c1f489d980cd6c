"""Per-position acceptance of drafters from `examples/evaluate_tau.py` summaries, as a PNG.

    python examples/plot_acceptance.py RUN/tau0/summary.json [more summaries ...] \
        --out examples/results/RUN/acceptance.png \
        [--temperature 0] [--drafters dflash-baseline dflash-carryover]

One panel per dataset; a line per drafter: P(a round accepts at least j drafts), j = 1..B, pooled over the
dataset's rounds (positions with none are left out: log axis). The title carries the GPU and commit recorded in
the summary.
"""

import argparse
import json
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summary", nargs="+", help="summary.json files of examples/evaluate_tau.py (rows are pooled)")
    p.add_argument("--out", required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--drafters", nargs="*")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [json.loads(Path(f).read_text()) for f in args.summary]
    summary = summaries[0]
    rows = [r for s in summaries for r in s["results"].values() if r["temperature"] == args.temperature
            and (not args.drafters or r["drafter"] in args.drafters)]
    if not rows:
        raise SystemExit(f"No rows at T={args.temperature} for {args.drafters or 'any drafter'} in {args.summary}.")
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False, sharey=True)
    for ax, dataset in zip(axes[0], datasets):
        for r in sorted((r for r in rows if r["dataset"] == dataset), key=lambda r: r["drafter"]):
            curve = r["p_accept_at_least"]  # zeros (e.g. j = B, beyond the B-1 proposals) have no place on a log axis
            pts = [(j, c) for j, c in enumerate(curve, 1) if c > 0]
            ax.plot([j for j, _ in pts], [c for _, c in pts], marker="o", ms=3,
                    label=f"{r['drafter']} (τ {r['tau']:.2f}, {r['prompts']} prompts)")
        ax.set_title(dataset)
        ax.set_xlabel("draft position j")
        ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(accepted ≥ j)")
    env = summary.get("environment", {})
    fig.suptitle(f"T={args.temperature:g} · {env.get('gpu')} · commit {str(env.get('commit'))[:10]}", fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
