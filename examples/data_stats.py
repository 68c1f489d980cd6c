"""Statistics of a set of training responses: how long they are, how many stop at the generation cap, and what share
of a training step's proposal rows are real (the rest are padded anchors and proposals past a response's end).

    python examples/data_stats.py --data runs/regen/regen-T0-s0,runs/regen/regen-T1-s2 --anchors 256 128 \
        --out examples/results/RUN/data_stats.json

Why: the objectives sample up to N anchors per response and draft a block of P proposals at each. A response with
fewer positions than N pads the rest, and an anchor near the end has proposals past it; both are masked out of the
loss (and, since 2026-12-01d, skipped by the LM head). Their share says how much a step's work teaches, and whether
longer responses or fewer anchors would use the GPU better. The share is the exact expectation over the uniform
anchor draw of `sample_anchors`, on sequences cut as `ResponseCollator` cuts them.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_carryover.training.data import ResponseCollator, ResponseDataset  # noqa: E402


def valid_row_share(prompt_len: int, seq_len: int, num_anchors: int, num_proposals: int) -> float:
    """Expected number of valid proposal rows of one sequence (anchors t in [prompt_len, seq_len - 2], proposal j valid
    while t + j < seq_len), over `sample_anchors`' uniform draw of min(n, N) of the n anchor positions."""
    positions = range(prompt_len, seq_len - 1)
    n = len(positions)
    if n <= 0:
        return 0.0
    per_anchor = sum(min(num_proposals, seq_len - 1 - t) for t in positions) / n
    return min(n, num_anchors) * per_anchor


def stats(records, anchors, num_proposals, max_seq_len, cap):
    cut = ResponseCollator(0, max_seq_len)
    lengths, at_cap, rows = [], 0, {n: 0.0 for n in anchors}
    for r in records:
        resp = len(r["input_ids"]) - r["prompt_len"]
        lengths.append(resp)
        at_cap += resp >= cap
        b = cut([r])
        p, s = int(b["prompt_len"][0]), int(b["seq_len"][0])
        for n in anchors:
            rows[n] += valid_row_share(p, s, n, num_proposals)
    total = len(records)
    return {
        "responses": total,
        "response_tokens": sum(lengths),
        "mean_response_tokens": statistics.fmean(lengths),
        "median_response_tokens": statistics.median(lengths),
        f"share_at_cap_{cap}": at_cap / total,
        "valid_row_share": {str(n): rows[n] / (total * n * num_proposals) for n in anchors},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="response folder(s), comma-separated (each reported, then all)")
    p.add_argument("--anchors", type=int, nargs="+", default=[256, 128], help="anchors per response (N)")
    p.add_argument("--block_size", type=int, default=16, help="drafter block; B - 1 proposals per anchor")
    p.add_argument("--max_seq_len", type=int, default=768, help="the training configs' cut")
    p.add_argument("--cap", type=int, default=256, help="the regeneration's max_new_tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.block_size < 2 or min(args.anchors) < 1:
        p.error("--block_size must be >= 2 and --anchors >= 1")
    folders = [f for f in args.data.split(",") if f]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from evaluate_tau import environment

    res = {"command": " ".join(["python"] + [Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])),
           "environment": environment(), "sets": {}}
    every = []
    for f in folders:
        recs = ResponseDataset(f).records
        every += recs
        res["sets"][f] = stats(recs, args.anchors, args.block_size - 1, args.max_seq_len, args.cap)
    if len(folders) > 1:
        res["sets"]["all"] = stats(every, args.anchors, args.block_size - 1, args.max_seq_len, args.cap)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
