"""Measure τ (mean accepted length per verification round) through `target.generate(assistant_model=...)`.

    python examples/evaluate_tau.py --drafters dflash=model_cards/x carry=model_cards/y \
        --datasets mtbench humaneval sharegpt --temperatures 0 1 --max_new_tokens 256 --workers 8 --out results/tau

Prompts come from `<prompts_dir>/<dataset>.jsonl` (`{"id", "input_ids"}`, chat template applied), written by
`trainer/prepare_prompts.py`, so this script needs no network. Every finished generation is appended to
`<out>/raw-<worker>.jsonl` at once (a crash loses nothing); `<out>/summary.json` aggregates them with the
command, git commit, hardware and versions. Several worker processes share one GPU: a 135M target decodes
launch-bound, so separate processes overlap their kernel launches. T=1 samples from the unmodified
distribution (top-k/top-p off). τ counts draft rounds only (the prefill forward emits one token unaided).

`--engine`: the batched fast engine (`hf_carryover.engine`), all prompts as rows at once, T=0 and T>0.
`--offline` (T=0 only): one batched greedy rollout of the target per prompt, then every drafter is replayed
against it with `hf_carryover.evaluation.offline_tau` (exact: tested equal to the rounds of `generate()`),
a few batched forwards per round instead of one `generate()` call per prompt and drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def load_prompts(prompts_dir, dataset, limit, skip=0):
    """The dataset's prompts after the first `skip` (held-out prompts for tuning: the benchmarks take the first ones),
    at most `limit` of them (0: all)."""
    rows = [json.loads(line) for line in Path(prompts_dir, f"{dataset}.jsonl").read_text().splitlines()][skip:]
    return rows[:limit] if limit else rows


def load_target(name, dtype, device):
    """'reference' (SmolLM2-135M-Instruct, converted once and cached) or a model folder, in eval mode."""
    if name == "reference":
        from hf_carryover.reference import reference_target

        target, _ = reference_target(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return target.to(device).eval()


# spec keys passed to SpeculativeEngine (--engine), not to the drafter's config
ENGINE_KEYS = ("lookup_siblings", "lookup_confidence", "lookup_min_ngram", "attention", "attention_mode",
               "attention_block_n", "attention_warps", "attention_split_n", "attention_block_m", "attention_min_rows",
               "run_ahead", "tree_topk", "drafter_attention", "rope_table", "dynamic_prefill", "prefill_ahead",
               "gemv_rows", "gemv_fusion", "attention_one_row_keys", "draft_topk", "skinny_rows",
               "gated_mlp", "attention_key_end", "fused_linear_rows",
               "lookup_skips_drafter")
# `inductor.KEY=VALUE` in a spec: an inductor option of that drafter's compiled engine (benchmark.py --compile), e.g.
# `pdl=FOLDER,inductor.triton.enable_pdl=true`. Why: options that change every kernel (PDL) are timed on tree rows
# beside the default in one process, as --ar_variant's compile_options does for plain rows.
INDUCTOR_PREFIX = "inductor."


def with_inductor_keys(specs) -> list[str]:
    """The specs among `specs` that set an inductor option (`inductor.KEY=VALUE`): a compiled engine's, so the scripts
    that cannot honour them (no --compile, or no compiled engine at all) refuse them before loading anything."""
    return [d for d in specs if any(k.startswith(INDUCTOR_PREFIX) for k in parse_spec(d)[2])]


def load_drafters(specs, dtype, device):
    """`name=folder[,key=value...]` specs -> {name: drafter} (remote code, as users load them). The optional
    config overrides serve ablations, e.g. `carry-off=FOLDER,carryover=false` runs a Carryover-trained drafter
    without its carryover states."""
    from transformers import AutoModel

    drafters = {}
    for spec in specs:
        name, path, overrides, lookup = parse_spec(spec)
        tree = {k: overrides.pop(k) for k in ("tree", "tree_nodes") if k in overrides}
        engine_kw = {k: overrides.pop(k) for k in ENGINE_KEYS if k in overrides}
        inductor = {k[len(INDUCTOR_PREFIX):]: overrides.pop(k) for k in list(overrides)
                    if k.startswith(INDUCTOR_PREFIX)}
        if inductor:  # benchmark.py's make_engine puts these over --inductor's for this drafter's engines
            engine_kw["compile_options"] = inductor
        drafters[name] = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype,
                                                   **overrides).to(device).eval()
        drafters[name]._eval_lookup = lookup
        drafters[name]._eval_tree = tree
        drafters[name]._eval_engine = engine_kw
    return drafters


def parse_spec(spec: str):
    """`name=folder[,key=value...]` -> (name, folder, config overrides, lookup N or None): `lookup=N` is a generate()
    argument (context lookup, `prompt_lookup_num_tokens=N`), not a config field; so are `tree=FILE` and `tree_nodes=N`
    (verify a draft tree from `examples/calibrate_tree.py`, N nodes per round: in the engine, or through generate()
    with `drafter.use_draft_tree`), which stay in the overrides until `load_drafters` takes them out; so do
    `lookup_siblings=false`, `lookup_confidence=P` and `lookup_min_ngram=N` (`ENGINE_KEYS`, `SpeculativeEngine`
    arguments, --engine only), and `inductor.KEY=VALUE` (benchmark.py --compile only)."""
    name, rest = spec.split("=", 1)
    path, *pairs = rest.split(",")
    overrides = {k: _value(v) for k, v in (p.split("=", 1) for p in pairs)}
    return name, path, overrides, overrides.pop("lookup", None)


def _value(text: str):
    """A spec value: true/false and numbers as JSON reads them, anything else (a path) as given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, (bool, int, float)) else text


def _setup(args):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    return device, load_target(args.target, dtype, device), load_drafters(args.drafters, dtype, device)


def worker(rank, args, jobs):
    import torch

    torch.manual_seed(1234 + rank)
    device, target, drafters = _setup(args)
    for d in drafters.values():  # each spec is its own drafter object: a tree spec's drafter keeps its tree
        if d._eval_tree:  # generate() verifies draft trees (main() allows tree specs at T=0 only: trees are greedy)
            d.use_draft_tree(d._eval_tree["tree"], d._eval_tree.get("tree_nodes"))  # a file: use_draft_tree loads it
    out = open(Path(args.out) / f"raw-{rank}.jsonl", "a")
    for job in jobs[rank:: args.workers]:
        name, dataset, temp, pid, ids = job
        x = torch.tensor([ids], device=device)
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=temp > 0)
        if drafters[name]._eval_lookup:
            kw["prompt_lookup_num_tokens"] = drafters[name]._eval_lookup
        if temp > 0:
            kw.update(temperature=float(temp), top_k=0, top_p=1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            y = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafters[name], **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gen = drafters[name].last_candidate_generator
        rec = {"drafter": name, "dataset": dataset, "temperature": temp, "id": pid,
               "new_tokens": int(y.shape[1] - x.shape[1]), "seconds": dt,
               "accepted": [r["accepted"] for r in gen.rounds], "proposals": [r["proposals"] for r in gen.rounds]}
        if drafters[name]._eval_lookup:  # what the generator itself was given, and how often it looked up
            rec["lookup"] = gen.lookup_tokens
            rec["lookup_rounds"] = sum(r.get("source") == "lookup" for r in gen.rounds)
        if getattr(gen, "tree_nodes", None):  # rounds verified a tree: `accepted` is tokens emitted minus one
            rec.update(tree_nodes=gen.tree_nodes, tree=drafters[name]._eval_tree["tree"])
        out.write(json.dumps(rec) + "\n")
        out.flush()


def offline(args):
    """T=0 τ by exact replay over batched greedy rollouts; writes the same raw records as `worker`."""
    from hf_carryover.evaluation.offline_tau import offline_rounds
    from hf_carryover.training.data import regenerate_responses

    _, target, drafters = _setup(args)
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    out = open(Path(args.out) / "raw-offline.jsonl", "a")
    for dataset in args.datasets:
        rows = load_prompts(args.prompts_dir, dataset, args.limit, args.skip)
        roll_dir = Path(args.out) / f"rollouts-{dataset}"
        regenerate_responses(target, [(r["id"], r["input_ids"]) for r in rows], roll_dir,
                             max_new_tokens=args.max_new_tokens, batch_size=args.engine_batch,
                             pad_token_id=target.generation_config.pad_token_id)
        recs = [json.loads(x) for f in sorted(roll_dir.glob("shard-*.jsonl")) for x in f.read_text().splitlines()]
        for name, drafter in drafters.items():
            drafter.bind_target(target)
            t0 = time.perf_counter()
            rounds = offline_rounds(target, drafter, [(r["prompt_len"], r["input_ids"]) for r in recs],
                                    args.max_new_tokens, eos_token_ids=eos, batch_size=args.engine_batch)
            dt = time.perf_counter() - t0
            for r, rd in zip(recs, rounds):
                out.write(json.dumps({"drafter": name, "dataset": dataset, "temperature": 0.0, "id": r["id"],
                                      "new_tokens": len(r["input_ids"]) - r["prompt_len"], "seconds": dt / len(recs),
                                      "accepted": rd["accepted"], "proposals": rd["proposals"],
                                      "offline": True}) + "\n")
            out.flush()
            print(f"{name} {dataset}: offline replay of {len(recs)} prompts in {dt:.1f}s", flush=True)


def engine_mode(args):
    """τ through the batched engine (`hf_carryover.engine`): all prompts of a dataset as rows advancing
    independently. Greedy rounds equal generate()'s, round for round (tested); at T>0 the
    output follows the target's distribution like generate()'s. Much faster than one generate() per prompt."""
    from hf_carryover.engine.engine import SpeculativeEngine
    from hf_carryover.engine.tree import TreeSpec

    _, target, drafters = _setup(args)
    eos = target.generation_config.eos_token_id
    out = open(Path(args.out) / "raw-engine.jsonl", "a")
    for temp in args.temperatures:  # drafters innermost: a time-boxed run still compares all of them
        for dataset in args.datasets:
            rows = load_prompts(args.prompts_dir, dataset, args.limit, args.skip)
            width = max(len(r["input_ids"]) for r in rows)
            for name, drafter in drafters.items():
                tree = dict(drafter._eval_tree)
                if "tree" in tree:  # a draft tree instead of the linear block (TreeSpec; N nodes per round or all)
                    tree["tree"] = TreeSpec.load(tree["tree"])
                extra = (tree.get("tree_nodes") or tree["tree"].num_nodes) if tree else 0  # rows a round writes
                engine = SpeculativeEngine(target, drafter, **drafter._eval_engine,
                                           max_len=width + args.max_new_tokens + 2 * drafter.config.block_size + extra)
                for i in range(0, len(rows), args.engine_batch):
                    chunk = rows[i : i + args.engine_batch]
                    t0 = time.perf_counter()
                    lookup = drafter._eval_lookup  # context lookup: the engine's twin of generate()'s
                    gens = engine.generate([r["input_ids"] for r in chunk], max_new_tokens=args.max_new_tokens,
                                           do_sample=temp > 0, temperature=temp or 1.0, eos_token_id=eos, seed=i,
                                           prompt_lookup_num_tokens=lookup, **tree)
                    dt = time.perf_counter() - t0
                    for r, g, rounds, looked in zip(chunk, gens, engine.rounds, engine.lookup_rounds):
                        rec = {"drafter": name, "dataset": dataset, "temperature": temp, "id": r["id"],
                               "new_tokens": len(g), "seconds": dt / len(chunk), "accepted": rounds,
                               "proposals": [drafter.config.num_proposals] * len(rounds), "engine": True}
                        if tree:  # rounds verified a tree: `accepted` is tokens emitted minus one
                            rec.update(tree_nodes=tree.get("tree_nodes") or tree["tree"].num_nodes,
                                       tree=drafter._eval_tree["tree"])
                        if lookup:  # as the generate() records: the setting and how many rounds looked up, and
                            # which ones (per round, as `accepted`)
                            rec.update(lookup=lookup, lookup_rounds=sum(looked), looked=looked)
                        rec.update(drafter._eval_engine)  # e.g. lookup_siblings: false
                        out.write(json.dumps(rec) + "\n")
                    out.flush()
                print(f"{name} {dataset} T={temp}: {len(rows)} prompts", flush=True)


def environment():
    import torch
    import transformers

    # HF_CARRYOVER_COMMIT first: the GPU machine's copy of the tree can carry a stale .git (on 2026-11-29 its
    # `git rev-parse HEAD` named an older commit than the code that ran)
    # Without it, a tree whose tracked files differ from HEAD is recorded as "<HEAD>-dirty": the numbers then come from
    # code that no commit holds (on 2026-12-04 a bench run straight on the GPU machine recorded the stale HEAD as if
    # it were the code that ran)
    commit = os.environ.get("HF_CARRYOVER_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            if len(commit) != 40:  # a copied tree without history prints "HEAD"
                commit = None
            elif subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip():
                commit += "-dirty"
        except OSError:
            commit = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"commit": commit, "gpu": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def summarize(out_dir, max_positions=16):
    """τ per (drafter, dataset, temperature) = Σ(accepted+1) / rounds, plus acceptance-by-position curves."""
    groups = defaultdict(list)
    for path in Path(out_dir).glob("raw-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            groups[(r["drafter"], r["dataset"], r["temperature"])].append(r)
    table = {}
    for (name, dataset, temp), recs in sorted(groups.items()):
        acc = [a for r in recs for a in r["accepted"]]
        rounds = len(acc)
        reach = [sum(1 for a in acc if a >= j) / max(rounds, 1) for j in range(1, max_positions + 1)]
        table[f"{name}|{dataset}|T={temp}"] = {
            "drafter": name, "dataset": dataset, "temperature": temp, "prompts": len(recs), "rounds": rounds,
            "tau": (sum(acc) + rounds) / max(rounds, 1),
            "tokens_per_s_hf": None if recs[0].get("offline") or recs[0].get("engine") else
            sum(r["new_tokens"] for r in recs) / max(sum(r["seconds"] for r in recs), 1e-9),
            "p_accept_at_least": reach,
        }
    means = defaultdict(list)
    for row in table.values():
        means[(row["drafter"], row["temperature"])].append(row["tau"])
    mean_tau = {f"{d}|T={t}": sum(v) / len(v) for (d, t), v in means.items()}
    return table, mean_tau


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="reference")
    p.add_argument("--drafters", nargs="+", required=True,
                   help="name=folder[,config_key=value...][,lookup=N] (lookup: context lookup; generate() and "
                   "--engine)")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "sharegpt"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--limit", type=int, default=0, help="first N prompts per dataset (0 = all)")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N prompts (tuning on held-out prompts)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    p.add_argument("--summarize_only", action="store_true")
    p.add_argument("--offline", action="store_true", help="T=0 by exact replay (see module docstring)")
    p.add_argument("--engine", action="store_true", help="batched fast engine instead of generate()")
    p.add_argument("--engine_batch", type=int, default=64, help="rows per batch in --engine and --offline modes")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    command, env = " ".join([sys.executable.split("/")[-1]] + sys.argv), environment()
    run_file = Path(args.out, "run.json")  # who measured, written before measuring: a run cut by a time limit
    if not args.summarize_only:            # is summarised later (--summarize_only) under its own command
        run_file.write_text(json.dumps({"command": command, "environment": env}, indent=2))
    looked = [d for d in args.drafters if parse_spec(d)[3]]
    trees = [d for d in args.drafters if "tree" in parse_spec(d)[2]]
    if trees and not args.summarize_only and (args.offline or (any(t > 0 for t in args.temperatures)
                                                               and not args.engine)):
        raise SystemExit(f"{trees}: draft trees (tree=FILE) run through the engine (--engine, any temperature) or "
                         "generate() (greedy: --temperatures 0); the offline replay verifies linear blocks")
    engine_only = [d for d in args.drafters if set(parse_spec(d)[2]) & set(ENGINE_KEYS)]
    if engine_only and not args.engine and not args.summarize_only:
        given = sorted({k for d in engine_only for k in parse_spec(d)[2]} & set(ENGINE_KEYS))
        raise SystemExit(f"{engine_only}: {'/'.join(given)} (of {'/'.join(ENGINE_KEYS)}) are SpeculativeEngine "
                         "arguments: they need --engine")
    compiled_only = with_inductor_keys(args.drafters)
    if compiled_only and not args.summarize_only:
        raise SystemExit(f"{compiled_only}: {INDUCTOR_PREFIX}KEY=VALUE sets an option of a compiled engine; this "
                         "script's engine is not compiled (examples/benchmark.py --compile takes them)")
    if looked and args.offline:
        raise SystemExit(f"{looked}: context lookup (lookup=N) runs through generate() and the engine; the offline "
                         "replay has no lookup yet (examples/lookup_hybrid_offline.py replays it at T=0)")
    if args.summarize_only:
        pass  # the raw records already written, whichever mode wrote them
    elif args.offline:
        offline(args)
    elif args.engine:
        engine_mode(args)
    else:
        done = set()
        for path in Path(args.out).glob("raw-*.jsonl"):  # resume: skip finished generations
            for line in path.read_text().splitlines():
                r = json.loads(line)
                done.add((r["drafter"], r["dataset"], r["temperature"], r["id"]))
        jobs = []
        for temp in args.temperatures:
            # datasets interleaved prompt by prompt, so that a run cut by a time limit has covered the first
            # prompts of every dataset alike instead of all of one dataset and none of the next
            per_set = {d: load_prompts(args.prompts_dir, d, args.limit, args.skip) for d in args.datasets}
            for i in range(max(map(len, per_set.values()), default=0)):
                for dataset, rows in per_set.items():
                    if i >= len(rows):
                        continue
                    row = rows[i]
                    for spec in args.drafters:
                        name = spec.split("=", 1)[0]
                        if (name, dataset, temp, row["id"]) not in done:
                            jobs.append((name, dataset, temp, row["id"], row["input_ids"]))
        print(f"{len(jobs)} generations to run ({len(done)} already done)", flush=True)
        if args.workers == 1:
            worker(0, args, jobs)
        else:
            import torch.multiprocessing as mp

            mp.spawn(worker, args=(args, jobs), nprocs=args.workers, join=True)
    table, mean_tau = summarize(args.out)
    old = Path(args.out, "summary.json")
    if args.summarize_only:  # keep who measured (and where): re-summarizing measures nothing
        prev = json.loads(run_file.read_text()) if run_file.exists() else (
            json.loads(old.read_text()) if old.exists() else {})
        command, env = prev.get("command", command), prev.get("environment", env)
    summary = {"command": command, "environment": env,
               "max_new_tokens": args.max_new_tokens, "mean_tau": mean_tau, "results": table}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(mean_tau, indent=2))


if __name__ == "__main__":
    main()
