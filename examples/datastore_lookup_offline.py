"""Would copying from the target's own earlier responses help too? Exact offline τ at T=0 of datastore lookup rules.

    python examples/datastore_lookup_offline.py --drafter model_cards/smollm2-135m-instruct-dflash \
        --data_dir runs/data/data/train --limit 16 --out datastore_lookup_cpu.json

Context lookup copies loops from the prompt and response so far (`lookup_hybrid_offline.py`). A datastore does the
same from a corpus: here the target's own greedy responses to the training prompts (disjoint from every evaluation
prompt), as retrieval-based drafting (REST, He et al. 2023) does with a general corpus. Two ways to continue the
context's last n tokens (n = --ds_max_ngram down to --ds_min_ngram) from the corpus:
- `first`: copy what followed the n-gram's first occurrence in the corpus (like context lookup);
- `walk`: walk the corpus n-gram model greedily: repeatedly append the token that most often followed the last n
  tokens (backing off to shorter n), up to the block.
At T=0 the emitted tokens are the target's greedy rollout whatever is proposed, so each rule is replayed exactly on
one rollout per prompt (as in `lookup_hybrid_offline.py`, whose replay conventions this reuses):
- `drafter`, `hybrid` (context lookup where a 3- or 4-gram match exists, else the drafter): the baselines;
- `hybrid_ds_<way>`: context lookup, else the datastore where it matches, else the drafter;
- `best_of_3`: the best of drafter, context lookup and datastore (`first`) in every round: what a tree verifying all
  three would reach at three times the verified rows (a per-round choice; not strictly an upper bound of the
  single-candidate rules, whose rounds start at other anchors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lookup_hybrid_offline import accepted, lookup_proposals, rollouts, walk_rounds  # noqa: E402


class Datastore:
    """n-gram tables over a corpus of token lists: first occurrences (for `first`) and most frequent next tokens
    (for `walk`), for n = min_ngram..max_ngram."""

    def __init__(self, docs: list[list[int]], max_ngram: int = 5, min_ngram: int = 3):
        self.docs, self.max_ngram, self.min_ngram = docs, max_ngram, min_ngram
        self.first: dict[tuple, tuple[int, int]] = {}  # n-gram -> (doc, position after it)
        nxt: dict[tuple, Counter] = defaultdict(Counter)
        for di, doc in enumerate(docs):
            for n in range(min_ngram, max_ngram + 1):
                for s in range(len(doc) - n):
                    key = tuple(doc[s : s + n])
                    self.first.setdefault(key, (di, s + n))
                    nxt[key][doc[s + n]] += 1
        self.next = {k: c.most_common(1)[0][0] for k, c in nxt.items()}

    def propose(self, context: list[int], num: int, way: str) -> tuple[list[int], int]:
        """Up to `num` tokens continuing `context`, and the n-gram size that matched (0: none)."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            key = tuple(context[-n:])
            if len(key) == n and key in self.first:
                break
        else:
            return [], 0
        if way == "first":
            di, p = self.first[key]
            return self.docs[di][p : p + num], n
        out, ctx = [], list(context[-self.max_ngram :])
        while len(out) < num:
            tok = next((self.next[k] for m in range(self.max_ngram, self.min_ngram - 1, -1)
                        if len(k := tuple(ctx[-m:])) == m and k in self.next), None)
            if tok is None:
                break
            out.append(tok)
            ctx.append(tok)
        return out, n


def replay_rules(tokens: list[int], plen: int, props: torch.Tensor, store: Datastore) -> dict[str, list[int]]:
    """Accepted drafts per round for every rule, each rule on its own path through the same rollout."""
    rules = ["drafter", "hybrid", "hybrid_ds_first", "hybrid_ds_walk", "best_of_3"]

    def accept_at(rule, t, room):
        d = props[t - plen, :room].tolist()
        look, n = lookup_proposals(tokens, t, room, min_ngram=3)
        if rule == "drafter":
            return accepted(d, tokens, t)
        if rule == "best_of_3":
            ds, _ = store.propose(tokens[: t + 1], room, "first")
            return max(accepted(d, tokens, t), accepted(look, tokens, t), accepted(ds, tokens, t))
        if n:  # the hybrid rules: context lookup first
            return accepted(look, tokens, t)
        if rule == "hybrid":
            return accepted(d, tokens, t)
        ds, m = store.propose(tokens[: t + 1], room, rule.rsplit("_", 1)[1])  # hybrid_ds_first / hybrid_ds_walk
        return accepted(ds if m else d, tokens, t)

    return {rule: walk_rounds(tokens, plen, props.shape[1], lambda t, room, rule=rule: accept_at(rule, t, room))
            for rule in rules}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="a drafter folder without Carryover")
    p.add_argument("--data_dir", required=True, help="training responses (shard-*.jsonl with prompt_len, input_ids)")
    p.add_argument("--max_docs", type=int, default=0, help="use only the first N responses (0: all)")
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "sharegpt"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--ds_max_ngram", type=int, default=5)
    p.add_argument("--ds_min_ngram", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)

    from evaluate_tau import environment, load_prompts

    from hf_carryover import Drafter
    from hf_carryover.reference import reference_target

    files = sorted(Path(args.data_dir).rglob("shard-*.jsonl"))
    if not files:
        raise SystemExit(f"no shard-*.jsonl under {args.data_dir}")
    docs = [r["input_ids"][r["prompt_len"] :] for f in files for r in map(json.loads, f.read_text().splitlines())]
    docs = docs[: args.max_docs] if args.max_docs else docs
    store = Datastore(docs, args.ds_max_ngram, args.ds_min_ngram)
    print(f"datastore: {len(docs)} responses, {sum(map(len, docs))} tokens, {len(store.first)} n-grams", flush=True)

    target, _ = reference_target(dtype=torch.float32)
    drafter = Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    if drafter.config.carryover:
        raise SystemExit(f"{args.drafter} uses Carryover: its teacher-forced proposals are not its online ones")
    drafter.bind_target(target)
    eos = target.generation_config.eos_token_id
    res = {"command": " ".join(["python"] + sys.argv), "environment": environment(), "drafter": args.drafter,
           "data_dir": args.data_dir, "responses": len(docs), "ds_ngram": [args.ds_min_ngram, args.ds_max_ngram],
           "max_new_tokens": args.max_new_tokens, "datasets": {}}
    for ds in args.datasets:
        prompts = [r["input_ids"] for r in load_prompts(args.prompts_dir, ds, args.limit)]
        engine, rolled = rollouts(target, drafter, prompts, args.max_new_tokens, eos)
        per_rule = defaultdict(list)
        for plen, tokens, props in rolled:
            for rule, rounds in replay_rules(tokens, plen, props, store).items():
                per_rule[rule] += rounds
        row = {"prompts": len(prompts), "engine_tau": statistics.mean(a + 1 for rr in engine.rounds for a in rr)}
        for rule, rounds in per_rule.items():
            row[f"tau_{rule}"] = statistics.mean(a + 1 for a in rounds)
        res["datasets"][ds] = row
        print(ds, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
