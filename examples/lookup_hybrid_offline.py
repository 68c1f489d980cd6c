"""Would copying from the context help this drafter? Exact offline τ at T=0 of four drafting rules on the same rollouts.

    python examples/lookup_hybrid_offline.py --drafter model_cards/smollm2-135m-instruct-dflash --limit 8 \
        --out lookup_hybrid_cpu.json

Why: the reference target's greedy responses loop a lot (about a third of their 4-grams repeat earlier 4-grams), and
the block drafter continues such loops poorly (e.g. a 4-token loop repeated 40 times, drafted at a mean run of ~2).
Prompt-lookup decoding proposes exactly those continuations from the context. At T=0 the emitted tokens are the
target's greedy rollout whatever is drafted, so every rule can be replayed exactly on one rollout per prompt:
- `drafter`: the drafter's block (teacher-forced proposals at each anchor equal the online ones for a drafter without
  Carryover; the replayed τ is checked against the engine's own rounds);
- `lookup`: the continuation after the earliest occurrence of the context's last n tokens (n = 4, 3, 2),
  as transformers' prompt-lookup decoding proposes; a round without a match decodes one token;
- `hybrid`: the lookup continuation where a match of at least `--min_ngram` tokens exists, else the drafter's block;
- `hybrid_fill`: as `hybrid`, but a lookup shorter than the block is followed by the drafter's proposals for the slots
  after it (instead of filler that is never accepted): the same verified rows, so it can only accept more;
- `both`: both candidates verified in one target forward (a two-branch tree), the longer accepted one kept: a real
  method at twice the verified rows, so also the upper bound of any rule that picks one of the two.
τ here is tokens per target forward over all rounds (a lookup round without a match counts as a forward for one token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def lookup_proposals(tokens: list[int], t: int, num: int, max_ngram: int = 4,
                     min_ngram: int = 2) -> tuple[list[int], int]:
    """The generate() path's context lookup (`context_lookup`) at anchor t: proposals copied from tokens[:t+1]."""
    from hf_carryover.generation_carryover import context_lookup

    return context_lookup(tokens[: t + 1], num, max_ngram, min_ngram)


def drafter_proposals(target, drafter, tokens: list[int], plen: int) -> torch.Tensor:
    """Greedy block proposals `[L - 1 - plen, P]` at every response anchor plen..L-2, teacher-forced on the rollout."""
    from anchor_bias import proposals_at_every_anchor

    return proposals_at_every_anchor(target, drafter, torch.tensor([tokens]), plen)[0][0]


def accepted(props: list[int], tokens: list[int], t: int) -> int:
    a = 0
    for j, p in enumerate(props):
        if t + 1 + j >= len(tokens) or tokens[t + 1 + j] != p:
            break
        a += 1
    return a


def walk_rounds(tokens: list[int], plen: int, P: int, accept_at) -> list[int]:
    """Accepted drafts per round (target forward) from the anchor at plen (the prefill's token) to the end, where
    `accept_at(t, room)` gives a round's accepted count at anchor t with room for at most `room` proposals."""
    rounds, t, L = [], plen, len(tokens)
    while t < L - 1:
        # tokens still to emit; as generate() and the engine, propose at most one fewer (the verification adds one),
        # and a last step with no room for a proposal is a plain decoding step, not a draft round
        room = min(P, L - 2 - t)
        if room <= 0:
            break
        a = accept_at(t, room)
        rounds.append(a)
        t += a + 1
    return rounds


def replay(tokens: list[int], plen: int, props: torch.Tensor, rule: str, min_ngram: int) -> list[int]:
    """Accepted drafts per round of one rule on the rollout `tokens` (see the module docstring)."""

    def accept_at(t, room):
        d = props[t - plen, :room].tolist()
        look, n = lookup_proposals(tokens, t, room)
        if rule == "drafter":
            return accepted(d, tokens, t)
        if rule == "lookup":
            return accepted(look, tokens, t)
        if rule == "hybrid":
            return accepted(look if n >= min_ngram else d, tokens, t)
        if rule == "hybrid_fill":
            return accepted(look + d[len(look):] if n >= min_ngram else d, tokens, t)
        return max(accepted(d, tokens, t), accepted(look, tokens, t))  # both branches verified

    return walk_rounds(tokens, plen, props.shape[1], accept_at)


def rollouts(target, drafter, prompts: list[list[int]], max_new_tokens: int, eos):
    """Greedy engine rollouts of `prompts` and the drafter's teacher-forced proposals on each: (the engine, whose
    `rounds` are the online rounds, and [(prompt length, prompt + response, proposals)])."""
    from hf_carryover.engine.engine import SpeculativeEngine

    engine = SpeculativeEngine(target, drafter, max_len=max(map(len, prompts)) + max_new_tokens + 40)
    outs = engine.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos)
    return engine, [(len(p), p + o, drafter_proposals(target, drafter, p + o, len(p))) for p, o in zip(prompts, outs)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="a drafter folder without Carryover (its teacher-forced proposals "
                   "are its online ones)")
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "sharegpt"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--min_ngram", type=int, default=3, help="hybrid: smallest lookup match that replaces the drafter")
    p.add_argument("--out")
    args = p.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from evaluate_tau import environment, load_prompts

    from hf_carryover import Drafter
    from hf_carryover.reference import reference_target

    target, _ = reference_target(dtype=torch.float32)
    drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    if drafter.config.carryover:
        raise SystemExit(f"{args.drafter} uses Carryover: its teacher-forced proposals are not its online ones; "
                         "give a drafter without it")
    drafter.bind_target(target)
    eos = target.generation_config.eos_token_id
    rules = ["drafter", "lookup", "hybrid", "hybrid_fill", "both"]
    res = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "drafter": args.drafter,
           "max_new_tokens": args.max_new_tokens, "min_ngram": args.min_ngram, "datasets": {}}
    for ds in args.datasets:
        prompts = [r["input_ids"] for r in load_prompts(args.prompts_dir, ds, args.limit)]
        engine, rolled = rollouts(target, drafter, prompts, args.max_new_tokens, eos)
        per_rule = {r: [] for r in rules}
        for plen, tokens, props in rolled:
            for r in rules:
                per_rule[r] += replay(tokens, plen, props, r, args.min_ngram)
        engine_rounds = [a for rr in engine.rounds for a in rr]
        row = {"prompts": len(prompts), "engine_tau": statistics.mean(a + 1 for a in engine_rounds)}
        for r in rules:
            row[f"tau_{r}"] = statistics.mean(a + 1 for a in per_rule[r])
            row[f"rounds_{r}"] = len(per_rule[r])
        res["datasets"][ds] = row
        print(ds, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
