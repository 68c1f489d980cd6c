"""Regenerate training responses with the target:  `python trainer/regenerate.py --prompts P.jsonl --out data/train`.

Input: `{"id", "input_ids"}` lines (chat template applied; `trainer/prepare_prompts.py` writes them). Output:
resumable response shards (`hf_carryover.training.data`). `--num_workers W --worker_index i` takes every W-th
prompt, so W processes can share one GPU (a 135M target decodes launch-bound) without overlapping.

More data from the same prompts: `--temperature 1 --seed S` samples one more response per prompt from the target's
own distribution (a new seed, a new set; give each set its own `--out`); `--start N` skips the first N prompts (e.g.
the ones a greedy set already covers, when the prompt file has grown).
"""

import argparse
import json
from pathlib import Path

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="reference")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--shard_size", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num_workers", type=int, default=1)
    p.add_argument("--worker_index", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (T>0): one response set per seed")
    p.add_argument("--start", type=int, default=0, help="skip the first N prompts of the file")
    args = p.parse_args()
    if args.start < 0 or args.seed < 0:
        p.error("--start and --seed must be >= 0")

    from hf_carryover.training.data import regenerate_responses

    dtype = getattr(torch, args.dtype)
    if args.target == "reference":
        from hf_carryover.reference import reference_target

        target, tok = reference_target(dtype=dtype)
        pad = tok.pad_token_id
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        pad = target.config.pad_token_id
    target = target.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    rows = rows[args.start :]
    rows = rows[: args.limit] if args.limit else rows
    rows = rows[args.worker_index :: args.num_workers]
    prompts = [(r["id"], r["input_ids"]) for r in rows]
    out = Path(args.out) / f"w{args.worker_index}" if args.num_workers > 1 else Path(args.out)
    regenerate_responses(target, prompts, out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         temperature=args.temperature, shard_size=args.shard_size, pad_token_id=pad,
                         seed=args.seed + 1000003 * args.worker_index)  # workers draw different streams
    print(f"worker {args.worker_index}: {len(prompts)} responses in {out}")


if __name__ == "__main__":
    main()
