"""One JSON for a results folder from the training runs' own logs: steps, runtime, schedule fits, held-out metrics.

    python examples/training_summary.py --run dflash-stage1=R/trainlog_dflash-stage1.json:R/eval_dflash-stage1.json \
        --run dflash-baseline=... --meta '{"hardware": "..."}' --out examples/results/RUN/training.json

Why: the README's training table must trace to files written by the trainer (`train_log.json` is
`trainer.state.log_history`; `eval_metrics.json` is the final held-out evaluation), not to numbers copied by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summarize(log: list, evals: dict) -> dict:
    train = [e for e in log if "train_acc_per_pos" in e]
    end = next((e for e in reversed(log) if "train_runtime" in e), {})
    return {
        "steps": end.get("step", train[-1]["step"] if train else None),
        "train_runtime_s": end.get("train_runtime"),
        "epoch": end.get("epoch"),
        "peak_learning_rate": max((e.get("learning_rate", 0.0) for e in log), default=None),
        "schedule_fits": [e for e in log if "schedule_fitted_to_steps" in e],
        "stopped_early": [e for e in log if "stopped_early_at_step" in e],
        "eval": evals,
        "train_log_tail": train[-3:],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="NAME=TRAIN_LOG_JSON[:EVAL_METRICS_JSON]")
    p.add_argument("--meta", default="{}", help="JSON object merged into the top level (hardware, commands, data)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = {}
    for spec in args.run:
        name, _, files = spec.partition("=")
        log_path, _, eval_path = files.partition(":")
        evals = json.loads(Path(eval_path).read_text()) if eval_path else {}
        runs[name] = summarize(json.loads(Path(log_path).read_text()), evals)
    out = {**json.loads(args.meta), "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, r in runs.items():
        print(f"{name:18s} steps {r['steps']}  epoch {r['epoch']}  held-out accept run "
              f"{r['eval'].get('eval_accept_run')}  pos-1 acc {(r['eval'].get('eval_acc_per_pos') or [None])[0]}")


if __name__ == "__main__":
    main()
