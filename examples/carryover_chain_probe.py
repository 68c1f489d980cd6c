"""Do carryover rows help a Carryover drafter in the rounds training prepares it for, and in the rounds after?

Stage 2 trains the second draft of a chain: draft at a random anchor t *without* carryover, verify, draft again at
t1 = t+a+1 with the rejected rows. In decoding, every round's rows come from a draft that itself had rows. This
probe replays both steps on held-out responses (teacher-forced, greedy target = the recorded tokens) and compares,
at the same anchors, the accepted drafts with the rows against with them withheld:

  step 1 (training's case)   rows from a draft made without rows, at t1
  step 2 (decoding's case)   rows from the step-1 draft made *with* rows, at t2 = t1+a1+1

If rows help at step 1 and not at step 2, the drafter learnt rows of a kind decoding does not hand it, and stage 2
should train longer chains. Accepted drafts per round = τ − 1 at T=0.

    python examples/carryover_chain_probe.py --drafter model_cards/smollm2-135m-instruct-dflash-carryover \\
        --data runs/data/data/eval --limit 64 --num_anchors 64 --out chain.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tau import environment  # noqa: E402


def _paired(with_rows, without):
    """Mean accepted drafts with and without rows over the same anchors, and the paired difference ± its SE."""
    d = (with_rows - without).float()
    n = d.numel()
    se = float(d.std() / math.sqrt(n)) if n > 1 else math.nan
    return {"anchors": n, "accepted_with_rows": float(with_rows.float().mean()),
            "accepted_rows_withheld": float(without.float().mean()), "difference": float(d.mean()), "se": se}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="a Carryover drafter folder")
    p.add_argument("--data", default="runs/data/data/eval", help="response shards (trainer/regenerate.py)")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--num_anchors", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()

    from hf_carryover import Drafter
    from hf_carryover.reference import reference_target
    from hf_carryover.training.data import ResponseCollator, ResponseDataset
    from hf_carryover.training.objectives import (carry_chain, draft_blocks, greedy_proposals, sample_anchors,
                                                  target_pass, verify_all)

    target, tok = reference_target(dtype=torch.float32)
    drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    if not drafter.config.carryover:
        raise SystemExit(f"{args.drafter} is not a Carryover drafter (config carryover=false)")
    drafter.bind_target(target)
    data = ResponseDataset(args.data, max_records=args.limit)
    collate = ResponseCollator(tok.pad_token_id or 0)
    k = drafter.config.num_proposals
    gen = torch.Generator().manual_seed(0)
    acc = {s: {"with": [], "without": []} for s in ("step1", "step2")}
    with torch.no_grad():
        for i in range(0, len(data), args.batch):
            batch = collate([data[x] for x in range(i, min(i + args.batch, len(data)))])
            ids, seq_len, plen = batch["input_ids"], batch["seq_len"], batch["prompt_len"]
            ctx = torch.arange(ids.shape[1])[None] < seq_len[:, None]
            feats, _ = target_pass(target, drafter, ids, ctx, need_logits=False)

            def accepted(anchors, ok, rows=None):  # accepted drafts at `anchors`, drafted with or without rows
                kw = {} if rows is None else dict(carry=rows[0], carry_pos=rows[1], carry_valid=rows[2], k=k)
                h = draft_blocks(drafter, drafter, ids, feats, ctx, anchors, **kw)
                props = greedy_proposals(drafter, h, ids.gather(1, anchors))
                return verify_all(target, drafter, ids, ctx, seq_len, anchors, ok, props)[0]

            t0, ok0 = sample_anchors(plen, seq_len, args.num_anchors, gen)
            # stage 2's chain, two steps: t0 drafted without rows; t1 drafted with t0's rows; t2 gets t1's rows
            c = carry_chain(drafter, target, ids, feats, ctx, seq_len, t0, ok0, chain=2)
            (_, t1, t2), (_, ok1, ok2) = c["anchors"], c["ok"]
            steps = (("step1", ok1, c["accepted"][1], accepted(t1, ok1)),  # training's case
                     ("step2", ok2, accepted(t2, ok2, c["rows"][1]), accepted(t2, ok2)))  # decoding's case
            for s, ok, w, wo in steps:
                acc[s]["with"].append(w[ok])
                acc[s]["without"].append(wo[ok])
            print(f"{min(i + args.batch, len(data))}/{len(data)} responses", flush=True)
    res = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "drafter": args.drafter}
    for s, v in acc.items():
        res[s] = _paired(torch.cat(v["with"]), torch.cat(v["without"]))
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
