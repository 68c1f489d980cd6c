"""Training loss of the 1-GPU and 2-GPU runs of `trainer/ddp_check.sh` on one plot (PNG).

    python examples/plot_loss_curves.py examples/results/RUN/ddp_check_reference.json --out RUN/ddp_loss.png

The two runs train the same drafter from the same initialisation at equal global batch. If data-parallel training is
right, their curves should fall together, within the noise of different batches. The held-out loss after the last
step is in the legend, and the title carries the target, the commit and the mean gap between the logged losses.
"""

import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", help="ddp_check.json written by trainer/ddp_check.sh")
    p.add_argument("--out", required=True)
    p.add_argument("--skip_first", type=int, default=1, help="logged points left out (the first is far above the rest)")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(Path(args.check).read_text())
    runs = [(k, label) for k, label in (("g1", "1 GPU"), ("g2", "2 GPUs, data-parallel")) if d.get(k)]
    if not runs:
        raise SystemExit(f"{args.check} holds no loss curve (keys g1 / g2): did the check finish a run?")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label in runs:
        pts = d[key][args.skip_first:]
        held = d.get(f"{key}_eval", {}).get("eval_loss")
        ax.plot([e["step"] for e in pts], [e["loss"] for e in pts], marker="o", ms=3,
                label=label + (f" (held-out loss {held:.3f})" if held is not None else ""))
    gap = d.get("agreement", {}).get("mean_abs_loss_gap")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"target {d.get('target', '?')} · commit {str(d.get('commit', '?'))[:10]}"
                 + (f" · mean |gap| {gap:.3f}" if gap is not None else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
