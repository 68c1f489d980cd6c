"""How much of held-out response text a frequency-ranked draft vocabulary would cover.

Why: the drafter's proposals go through the target's full LM head (49152 rows for SmolLM2), most of a drafter
round on a small CPU. Drafting from only the N most frequent response tokens cuts that matmul N/V-fold, but every
held-out token outside the N costs a rejected draft. This prints the coverage per N.

    python examples/vocab_coverage.py --train runs/data/data/train runs/regen --eval runs/data/data/eval
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path


def response_tokens(root: Path):
    """Response token ids of every record under root: shard-*.jsonl files, or the regen phase's tar parts."""
    for path in sorted(root.rglob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            yield r["input_ids"][r["prompt_len"]:]
    for first in sorted(root.glob("*.tgz.partaa")):
        data = b"".join(p.read_bytes() for p in sorted(root.glob(first.name[:-2] + "*")))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                if member.isfile() and Path(member.name).name.startswith("shard-"):
                    for line in tar.extractfile(member).read().decode().splitlines():
                        r = json.loads(line)
                        yield r["input_ids"][r["prompt_len"]:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="+", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 24576])
    args = p.parse_args()
    counts, n = Counter(), 0
    for root in args.train:
        for toks in response_tokens(Path(root)):
            counts.update(toks)
            n += 1
    ranked = [t for t, _ in counts.most_common()]
    held = [t for toks in response_tokens(Path(args.eval)) for t in toks]
    coverage = {}
    for N in args.sizes:
        top = set(ranked[:N])
        coverage[N] = sum(t in top for t in held) / len(held)
    out = {"command": " ".join(["python"] + sys.argv), "train_responses": n, "distinct_tokens": len(counts),
           "eval_tokens": len(held), "coverage": coverage}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
