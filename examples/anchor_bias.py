"""Why training's held-out "accept run" overstates τ: it averages over random anchors, while speculative rounds
start where the drafter has just failed (each new anchor is the target's correction).

For each prompt: the engine decodes greedily and records its rounds; then, on the same tokens, the
training-time parallel drafter forward proposes at *every* anchor. Prints the mean leading run of correct
proposals at all anchors and at the anchors where rounds started (for a drafter without Carryover the latter
must equal the engine's mean accepted count, up to rounds cut by max_new_tokens: a consistency check).

    python examples/anchor_bias.py --drafter DRAFTER_FOLDER --prompts assets/prompts/sharegpt.jsonl --limit 8
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default="assets/prompts/sharegpt.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=128)
    args = p.parse_args()

    from hf_carryover import Drafter
    from hf_carryover.engine.engine import SpeculativeEngine
    from hf_carryover.reference import reference_target
    from hf_carryover.training.objectives import block_targets, draft_blocks, greedy_proposals, target_pass

    target, _ = reference_target(dtype=torch.float32)
    drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    drafter.bind_target(target)
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    engine = SpeculativeEngine(target, drafter, max_len=max(len(r["input_ids"]) for r in rows) + args.max_new_tokens + 40)
    outs = engine.generate([r["input_ids"] for r in rows], max_new_tokens=args.max_new_tokens,
                           eos_token_id=target.generation_config.eos_token_id)
    run_all, run_rounds, accepted = [], [], []
    for r, out, rounds in zip(rows, outs, engine.rounds):
        plen = len(r["input_ids"])
        ids = torch.tensor([r["input_ids"] + out])  # [1, L]: prompt + the target's greedy response
        L = ids.shape[1]
        valid = torch.ones(1, L, dtype=torch.bool)
        anchors = torch.arange(plen, L - 1)[None]  # every response position that has a next token
        with torch.no_grad():
            feats, _ = target_pass(target, drafter, ids, valid, need_logits=False)
            hidden = draft_blocks(drafter, drafter, ids, feats, valid, anchors)
            props = greedy_proposals(drafter, hidden, ids.gather(1, anchors))  # [1, N, P]
        labels, ok, _, _ = block_targets(ids, torch.tensor([L]), anchors, torch.ones_like(anchors, dtype=torch.bool),
                                         drafter.config.num_proposals)
        run = torch.cumprod(((props == labels) & ok).long(), -1).sum(-1)[0]  # [N] leading correct proposals
        starts, t = [], plen
        for a in rounds:
            starts.append(t - plen)
            t += a + 1
        run_all += run.tolist()
        run_rounds += run[torch.tensor([s for s in starts if s < run.numel()])].tolist()
        accepted += rounds
    print(json.dumps({"drafter": args.drafter, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
                      "engine_mean_accepted": statistics.mean(accepted),
                      "teacher_forced_run_all_anchors": statistics.mean(run_all),
                      "teacher_forced_run_at_round_anchors": statistics.mean(run_rounds)}, indent=2))


if __name__ == "__main__":
    main()
