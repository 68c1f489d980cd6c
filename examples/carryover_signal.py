"""How much could Carryover tell the drafter? An upper-bound probe on recorded target responses.

After a round rejects proposal a+1, the next anchor is the target's correction x* at t+a+1 and the next block
predicts t+a+2, t+a+3, ... The rejected verify rows j = a+1..k were computed on the *wrong* tokens d_j, yet the
target's own next-token guess at row j (for position t+j+1) may still be the true token there, e.g. after a
synonym or a one-token slip. This script measures, at random anchors of held-out responses (teacher-forced, as
training sees them):
  * `first_rejected_row_right`: P(target argmax at row a+1 == recorded token at t+a+2) — a carryover row that
    names exactly what the next block's first proposal must be;
  * `drafter_right`: P(the drafter's first proposal at the shifted anchor t+a+1, drafted *without* carryover,
    is right) — what the drafter manages on its own;
  * `headroom`: P(row right and drafter wrong) — rounds a drafter that learnt to read the rows could gain;
  * `later_rows_right[i]`: P(row a+1+i right about position t+a+2+i), for the later rejected rows.
A small headroom means the rejected states carry little the drafter lacks (at this drafter's quality); a large
one with a Carryover drafter that ignores the rows (carry == carry-off τ) means training has not taught it.
`by_accepted` splits the rejections by a, the drafts accepted before the rejection: the Carryover paper's gains
come from drafters at τ 3-6, whose rejections mostly follow long accepted runs; if the rows hold more after long
runs (near misses), a weak drafter's few long runs show it first.

    python examples/carryover_signal.py --drafter model_cards/smollm2-135m-instruct-dflash \\
        --data runs/data/data/eval --limit 16 --num_anchors 64 --out signal.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tau import environment, load_target  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--data", default="runs/data/data/eval", help="response shards (trainer/regenerate.py)")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--num_anchors", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--target", default="reference", help="'reference' or a model folder")
    p.add_argument("--out")
    args = p.parse_args(argv)

    from hf_carryover import Drafter
    from hf_carryover.training.data import ResponseCollator, ResponseDataset
    from hf_carryover.training.objectives import (draft_blocks, greedy_proposals, sample_anchors, target_pass,
                                                  verify_all)

    target = load_target(args.target, torch.float32, "cpu")
    drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    drafter.bind_target(target)
    data = ResponseDataset(args.data, max_records=args.limit)
    collate = ResponseCollator(target.config.pad_token_id or 0)
    k = drafter.config.num_proposals
    n = {"rejections": 0, "row_right": 0, "drafter_right": 0, "headroom": 0}
    buckets = {"a=0": (0, 1), "a=1": (1, 2), "a=2": (2, 3), "a>=3": (3, k + 1)}  # [lo, hi) of accepted drafts
    by_a = {b: dict.fromkeys(n, 0) for b in buckets}
    later_hit, later_n = torch.zeros(k), torch.zeros(k)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(0, len(data), args.batch):
            batch = collate([data[j] for j in range(i, min(i + args.batch, len(data)))])
            ids, seq_len, plen = batch["input_ids"], batch["seq_len"], batch["prompt_len"]
            L = ids.shape[1]
            ctx = torch.arange(L)[None] < seq_len[:, None]
            feats, _ = target_pass(target, drafter, ids, ctx, need_logits=False)
            anchors, a_ok = sample_anchors(plen, seq_len, args.num_anchors, gen)
            h = draft_blocks(drafter, drafter, ids, feats, ctx, anchors)
            props = greedy_proposals(drafter, h, ids.gather(1, anchors))
            acc, _, row_arg = verify_all(target, drafter, ids, ctx, seq_len, anchors, a_ok, props, return_argmax=True)
            anchors2 = anchors + acc + 1  # the correction's position: the next round's anchor
            ok = a_ok & (acc < k) & (anchors2 + 1 < seq_len[:, None])
            a2 = torch.where(ok, anchors2, anchors)
            h2 = draft_blocks(drafter, drafter, ids, feats, ctx, a2)  # the next draft, without carryover
            d2 = greedy_proposals(drafter, h2, ids.gather(1, a2))[..., 0]
            for off in range(k):  # row a+1+off about position t+a+2+off
                j = acc + 1 + off
                pos = anchors + j + 1
                valid = ok & (j <= k) & (pos < seq_len[:, None])
                pred = row_arg.gather(2, j.clamp(max=k)[..., None])[..., 0]
                hit = (pred == ids.gather(1, pos.clamp(max=L - 1))) & valid
                if off == 0:  # row a+1 about t+a+2: what the next block's first proposal must be
                    row_right, truth = hit, ids.gather(1, pos.clamp(max=L - 1))
                later_hit[off] += float(hit.sum())
                later_n[off] += float(valid.sum())
            dr_right = (d2 == truth) & ok
            n["rejections"] += int(ok.sum())
            n["row_right"] += int(row_right.sum())
            n["drafter_right"] += int(dr_right.sum())
            n["headroom"] += int((row_right & ~dr_right).sum())
            for b, (lo, hi) in buckets.items():
                m = ok & (acc >= lo) & (acc < hi)
                for key, x in (("rejections", m), ("row_right", row_right & m), ("drafter_right", dr_right & m),
                               ("headroom", row_right & ~dr_right & m)):
                    by_a[b][key] += int(x.sum())
            print(f"{min(i + args.batch, len(data))}/{len(data)} responses, {n['rejections']} rejections", flush=True)
    r = max(n["rejections"], 1)
    res = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "drafter": args.drafter,
           "target": args.target,
           "rejections": n["rejections"], "first_rejected_row_right": n["row_right"] / r,
           "drafter_right": n["drafter_right"] / r, "headroom": n["headroom"] / r,
           "later_rows_right": [round(float(h / max(c, 1)), 4) for h, c in zip(later_hit, later_n)][:8],
           "by_accepted": {b: {"rejections": c["rejections"],
                               **{f"{key}_rate": round(c[key] / max(c["rejections"], 1), 4)
                                  for key in ("row_right", "drafter_right", "headroom")}} for b, c in by_a.items()}}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
