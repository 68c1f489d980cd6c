"""Calibrate a draft tree for a DFlash drafter: which rank paths its target's greedy continuations actually follow.

    python examples/calibrate_tree.py --drafter model_cards/smollm2-135m-instruct-dflash \
        --data data/train/regen-T0-s0 --responses 400 --nodes 512 --out examples/results/RUN/tree_dflash.json

At every position t of recorded greedy responses (the target's own, as `trainer/regenerate.py` writes them) the drafter
drafts the block at anchor t; at depth d the recorded token has some rank among the drafter's top-R tokens. The
rank path (r_1, ..., r_m) up to the first depth where the recorded token is not in the top R is what a tree
containing it would accept. Counting every prefix over all anchors gives, for each node, how often a round
would accept through it; the `--nodes` most frequent prefixes form a tree (a prefix is never rarer than its
extensions) that maximises the expected accepted length among static trees of that size, on this data.

The engine uses the file in two ways (`SpeculativeEngine.generate(tree=..., tree_nodes=N)`): as a static tree (all
its nodes every round) or, with `tree_nodes`, as the superset from which each round keeps the N nodes the drafter
itself finds likeliest (a dynamic tree). Calibrate on training responses, never on evaluation prompts: the
file then says nothing about MT-Bench, HumanEval or the held-out ShareGPT split.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_carryover.training.data import ResponseCollator, ResponseDataset  # noqa: E402
from hf_carryover.training.objectives import block_targets, draft_blocks, target_pass  # noqa: E402


@torch.no_grad()
def rank_paths(target, drafter, batch, ranks: int, depth: int):
    """Per anchor of every response in `batch` (collated): its accepted rank path as a tuple (may be empty)."""
    ids, plen, slen = batch["input_ids"], batch["prompt_len"], batch["seq_len"]
    L = ids.shape[1]
    valid = torch.arange(L, device=ids.device)[None] < slen[:, None]
    feats, _ = target_pass(target, drafter, ids, valid, need_logits=False)
    n = int((slen - plen).max()) - 1  # anchors per row: positions prompt_len .. seq_len-2
    anchors = (plen[:, None] + torch.arange(n, device=ids.device)).clamp(max=L - 1)  # [b, n]
    a_ok = anchors < (slen - 1)[:, None]
    hidden = draft_blocks(drafter, drafter, ids, feats, valid, anchors)  # [b, n, B, d]
    top = drafter.lm_logits(hidden[:, :, drafter.proposal_rows()][:, :, :depth]).topk(ranks, -1).indices  # [b,n,D,R]
    labels, label_ok, _, _ = block_targets(ids, slen, anchors, a_ok, depth)  # [b, n, D]: the training labels' rule
    hit = top == labels[..., None]  # [b, n, D, R]
    found = hit.any(-1) & label_ok
    rank = hit.float().argmax(-1)  # [b, n, D]
    length = found.long().cumprod(-1).sum(-1)  # accepted depth through the top-R tree
    out = []
    for r_row, l_row, ok_row in zip(rank.tolist(), length.tolist(), a_ok.tolist()):
        out += [tuple(rk[:m]) for rk, m, ok in zip(r_row, l_row, ok_row) if ok]
    return out


def calibrate(target, drafter, records, ranks=8, depth=None, batch_size=8, max_seq_len=768, log=print):
    """Prefix counts over all anchors of `records` -> (Counter of rank paths, number of anchors)."""
    depth = depth or drafter.config.num_proposals
    device = next(drafter.parameters()).device
    collate = ResponseCollator(0, max_seq_len)
    counts, anchors, t0 = collections.Counter(), 0, time.time()
    for i in range(0, len(records), batch_size):
        batch = {k: v.to(device) for k, v in collate(records[i : i + batch_size]).items()}
        for path in rank_paths(target, drafter, batch, ranks, depth):
            anchors += 1
            for d in range(1, len(path) + 1):
                counts[path[:d]] += 1
        log(f"calibrate: {min(i + batch_size, len(records))}/{len(records)} responses, {anchors} anchors, "
            f"{time.time() - t0:.0f}s")
    return counts, anchors


def best_tree(counts, nodes):
    """The `nodes` most frequent prefixes (ties: shallower, then lower ranks), which always form a tree."""
    return sorted(counts, key=lambda p: (-counts[p], len(p), p))[:nodes]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="a DFlash drafter folder")
    p.add_argument("--data", required=True,
                   help="folder(s) of recorded greedy responses (shard-*.jsonl), comma-separated")
    p.add_argument("--target", default="reference")
    p.add_argument("--responses", type=int, default=400, help="first N usable responses")
    p.add_argument("--nodes", type=int, default=512, help="nodes of the tree written")
    p.add_argument("--ranks", type=int, default=8, help="top-R tokens per depth considered")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from evaluate_tau import environment, load_target
    from transformers import AutoModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype, device)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=dtype).to(device).eval()
    if drafter.config.drafter_type != "dflash":
        p.error(f"{args.drafter} is a {drafter.config.drafter_type} drafter; draft trees need a DFlash drafter")
    drafter.bind_target(target)
    records = ResponseDataset(args.data, max_records=args.responses).records
    counts, anchors = calibrate(target, drafter, records, args.ranks, batch_size=args.batch_size)
    paths = best_tree(counts, args.nodes)
    # expected tokens per round of the static tree made of the first n paths, on this data: 1 + Σ counts / anchors
    expected = {n: 1 + sum(counts[q] for q in paths[:n]) / anchors
                for n in (15, 31, 63, 127, 255, 511) if n <= len(paths)}
    chain = 1 + sum(counts[(0,) * d] for d in range(1, drafter.config.num_proposals + 1)) / anchors
    res = {"paths": [list(q) for q in paths], "counts": [counts[q] for q in paths], "anchors": anchors,
           "responses": len(records), "ranks": args.ranks, "drafter": args.drafter, "data": args.data,
           "expected_tokens_per_round_static": {"chain": chain, **expected},
           "command": " ".join(["python", Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])),
           "environment": environment()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res))
    print(json.dumps({k: res[k] for k in ("anchors", "responses", "expected_tokens_per_round_static")}))


if __name__ == "__main__":
    main()
