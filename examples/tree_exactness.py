"""Tree rounds on the real target: the engine's output with a draft tree equals plain greedy decoding, token for token.

    python examples/tree_exactness.py --drafter model_cards/smollm2-135m-instruct-dflash-carryover \
        --tree model_cards/smollm2-135m-instruct-dflash-carryover/draft_tree.json --nodes 31 63 --limit 4 \
        --out examples/results/RUN/tree_exactness_cpu.json

The unit tests check exactness on tiny random models; this runs the shipped drafter and its calibrated tree on the
reference target (fp32, eager), where trees are deep and accepted paths long, against `target.generate(do_sample=
False)` (transformers' own greedy loop, an independent reference). It records τ of each setting beside the verdict.
With --generate every setting runs through `target.generate(assistant_model=drafter)` instead, one prompt a call
(trees via `drafter.use_draft_tree`, which hands greedy calls to the engine's tree rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--tree", required=True, help="draft-tree JSON (examples/calibrate_tree.py)")
    p.add_argument("--nodes", nargs="+", type=int, default=[31, 63], help="dynamic tree sizes to check")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--lookup", type=int, default=15)
    p.add_argument("--generate", action="store_true", help="run each setting through target.generate(assistant_model"
                   "=drafter), one prompt a call, instead of the batched engine")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from evaluate_tau import environment, load_prompts, load_target
    from transformers import AutoModel

    from hf_carryover.engine.engine import SpeculativeEngine
    from hf_carryover.engine.tree import TreeSpec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target("reference", torch.float32, device)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=torch.float32).to(device).eval()
    tree = TreeSpec.load(args.tree)
    eos = target.generation_config.eos_token_id
    prompts = [r["input_ids"] for d in args.datasets for r in load_prompts(args.prompts_dir, d, args.limit)]
    t0 = time.time()
    refs = [target.generate(torch.tensor([q], device=device), max_new_tokens=args.max_new_tokens, do_sample=False,
                            eos_token_id=eos)[0, len(q):].tolist() for q in prompts]
    width = max(len(q) for q in prompts)
    engine = SpeculativeEngine(target, drafter, max_len=width + args.max_new_tokens + 2 * drafter.config.block_size
                               + max(args.nodes))
    settings = [("linear", {}), ("linear+lookup", {"prompt_lookup_num_tokens": args.lookup})]
    for n in args.nodes:
        settings += [(f"tree{n}", {"tree": tree, "tree_nodes": n}),
                     (f"tree{n}+lookup", {"tree": tree, "tree_nodes": n, "prompt_lookup_num_tokens": args.lookup})]
    res = {"command": " ".join(["python", Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])),
           "environment": environment(), "prompts": len(prompts), "dtype": "float32", "settings": {}}
    res["through"] = "generate()" if args.generate else "engine"

    def through_generate(kw):  # -> (outputs, τ over all rounds)
        drafter.use_draft_tree(kw.get("tree"), kw.get("tree_nodes"))
        outs, taus = [], []
        for q in prompts:
            x = torch.tensor([q], device=device)
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                do_sample=False, eos_token_id=eos, assistant_model=drafter,
                                prompt_lookup_num_tokens=kw.get("prompt_lookup_num_tokens"))
            outs.append(y[0, len(q):].tolist())
            taus += [r["accepted"] + 1 for r in drafter.last_candidate_generator.rounds]
        drafter.use_draft_tree(None)
        return outs, sum(taus) / len(taus)

    for name, kw in settings:
        if args.generate:
            out, tau = through_generate(kw)
        else:
            out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=eos, **kw)
            tau = engine.tau
        same = [o == r for o, r in zip(out, refs)]
        res["settings"][name] = {"identical_to_greedy": sum(same), "of": len(same), "tau": tau}
        print(f"{name}: {sum(same)}/{len(same)} identical to plain greedy, τ {tau:.3f} "
              f"({time.time() - t0:.0f}s)", flush=True)
    res["all_identical"] = all(v["identical_to_greedy"] == v["of"] for v in res["settings"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0 if res["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
