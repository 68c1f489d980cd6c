"""Where a captured fast-engine round spends its time on the GPU, at batch 1 (or `--batch b`): plain decoding against a
drafter round (linear block or draft tree, with or without context lookup).

Why: on the H200 a round of the Carryover drafter with a 31-node tree + lookup costs about 1.7 plain decoding steps
(`h200-2026-12-01h`: τ 3.21 gave 1.90× on HumanEval), where a launch-bound 135M target should verify 32 rows for
about the price of one and the 3-layer drafter should add little. The speed goals of #4 hinge on that difference, so
this script splits it, per mode:
  * `gpu_ms`: one round's GPU time, the captured round replayed back to back (the host never in the way);
  * `synced_ms`: the same with one host sync per round, as the engine's loop does;
  * `generate_ms_per_round`: wall time of `engine.generate()` per round over real prompts (each prompt's width bucket
    captured beforehand), and `prefill_ms` per prompt (the captured row prefill generate() runs, timed alone;
    `eager_prefill_ms`: the eager batched forward it replaced);
  * `host`: where one batch-1 `generate()` call's host time goes, by Python function (cProfile): the 25 costliest
    by cumulative and the 15 by own time. Time blocked in the round's one sync shows as `tolist`; the rest is the
    host's own work (prefill setup, state reset, the first lookup, read-out, mode and attention switching);
  * `kernels`: per round, the number of kernels and their time by kind (GEMM, attention, Triton-fused, index,
    copy, other) and the 60 costliest kernel names, from `torch.profiler` over replays of the captured round;
  * `parts` (with a drafter): the drafter's block forward and the target's forward over 1 and over N+1 rows,
    each compiled and captured alone, so round - parts = what the tree/acceptance/state bookkeeping costs.

    python examples/profile_engine.py --drafter model_cards/smollm2-135m-instruct-dflash-carryover \
        --tree model_cards/smollm2-135m-instruct-dflash-carryover/draft_tree.json --tree_nodes 31 --lookup 15 \
        --prompts_dir assets/prompts --out profile_engine.json
    ... --inductor combo_kernels=True    # the same with an inductor option set (a fresh process compiles anew)
    ... --batch 8 --limit 16             # rounds of 8 rows (static batches of the prompts in order; no prefill
                                         # timing): why a tree round costs more plain steps at batch 8 than at 1

CUDA only (captured rounds); the JSON carries the command, commit, GPU and versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tau import environment, load_drafters, load_prompts  # noqa: E402


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("fmha", "flash", "attention", "attn")):
        return "attention"
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    if n.startswith("triton"):
        return "triton"
    if any(s in n for s in ("scatter", "gather", "index")):
        return "index"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def replay_ms(fn, n: int, sync_each: bool = False, sync=None) -> float:
    """Mean ms per call of `fn` over n calls, after one untimed call; sync_each: a host sync after every call."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
        if sync_each:
            sync()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / n


def host_profile(fn, top: int = 25, top_self: int = 15) -> dict:
    """One call of `fn` under cProfile: its wall time and the Python functions (and built-ins) costliest by
    cumulative and by own time, in ms."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": nc, "cum_ms": 1000 * ct, "self_ms": 1000 * tt}
            for (file, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return {"call_ms": 1000 * wall,
            "by_cumulative": sorted(rows, key=lambda r: -r["cum_ms"])[:top],
            "by_self": sorted(rows, key=lambda r: -r["self_ms"])[:top_self]}


def kernel_profile(fn, n: int, top: int = 60) -> dict:
    """Kernels per call of `fn` (a graph replay) by kind and the `top` costliest by name, from torch.profiler over n
    calls. 60 names cover a round's kernels that cost more than about 1 us (a tree round runs ~120 distinct ones)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kinds, names = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        for table, key in ((kinds, kernel_kind(e.name)), (names, e.name[:120])):
            table[key][0] += 1
            table[key][1] += us
    per = lambda t: {k: {"count": c / n, "ms": us / n / 1000} for k, (c, us) in t.items()}  # noqa: E731
    top = dict(sorted(per(names).items(), key=lambda kv: -kv[1]["ms"])[:top])
    total = {"count": sum(c for c, _ in kinds.values()) / n, "ms": sum(us for _, us in kinds.values()) / n / 1000}
    return {"total": total, "by_kind": per(kinds), "top": top}


@torch.no_grad()
def profile_mode(args, target, drafter, prompts, eos, name, save, tree=None, lookup=None, parts=False) -> dict:
    """One mode's figures (module docstring); `save(res)` stores what is measured so far. Without grad, as the
    engine's own calls run: a compile with grad traces a backward, which the Triton attention op does not have
    (12-03c: the parts failed so and took the round's kernel table with them)."""
    from hf_carryover.engine.engine import SpeculativeEngine

    b = args.batch
    batches = [prompts[i:i + b] for i in range(0, len(prompts), b)]  # static batches, as benchmark.py's rows
    longest = max(len(p) for p in prompts)
    k = drafter.config.num_proposals if drafter is not None else (lookup or 0)
    eng = SpeculativeEngine(target, drafter, max_len=longest + args.max_new_tokens + 2 * k + 2, cuda_graphs=True,
                            compile=True, compile_options=args.compile_options, **args.engine_kw)
    held = {}
    make_state = eng._state

    def keep_state(*a, **kw):  # the DecodeState generate() decodes in (the captured round reads and writes it)
        held["st"] = make_state(*a, **kw)
        return held["st"]

    eng._state = keep_state
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, prompt_lookup_num_tokens=lookup, tree=tree,
              tree_nodes=args.tree_nodes if tree is not None else None)
    t0 = time.perf_counter()
    eng.generate(batches[0], **kw)  # compile + capture
    torch.cuda.synchronize()
    res = {"mode": name, "batch": b, "compile_and_capture_s": time.perf_counter() - t0}
    res.update(eng.kernel_record())  # what the engine's pass did in this mode's compiled graphs, and the round kernels
    for batch in batches[1:]:  # the other prompts' width buckets (a captured row prefill each) outside the timing
        eng.generate(batch, **kw)
    wall, acc, tokens, batch_rounds = 0.0, [], 0, 0
    for batch in batches:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.generate(batch, **kw)
        torch.cuda.synchronize()
        wall += time.perf_counter() - t
        acc += [a for r in eng.rounds for a in r]  # eng.rounds: per row, the tokens accepted in each of its rounds
        batch_rounds += max(len(r) for r in eng.rounds)  # the batch's rounds: its longest row's
        tokens += sum(len(o) for o in out)
    st = held["st"]
    # the prefill generate() runs once per prompt (row by row, captured per width bucket), timed alone, and the
    # eager batched one it replaced
    pre, eager = [], []
    if b == 1:  # batch 1 only: the prefill fills the state's one row
        row_prefill = eng._row_prefill(st, 1, True)
        for p in prompts:
            toks = torch.tensor([p], device=st.anchor.device)
            pos = eng._steps[: len(p)][None]
            staged = torch.zeros(1, eng.max_len, dtype=torch.long, device=st.anchor.device)  # as `st.prompt` holds it
            staged[:, : len(p)] = toks
            pre.append(replay_ms(lambda: row_prefill(0, staged, len(p)), 3))
            with eng.attention_context():  # the target's attention as the engine's calls run it
                eager.append(replay_ms(lambda: eng._target_forward(st.cache, toks, pos), 3))
    # round graphs only: since 2026-12-03 a call's start is a captured graph too (`SpeculativeEngine._start`, keys
    # ("start", ...)), timed apart below; the profile of that day timed the start graph as `gpu_ms` by mistake
    graphs = [g for key, g in eng._graphs.items() if isinstance(g, torch.cuda.CUDAGraph) and key[0] != "start"]
    starts = [g for key, g in eng._graphs.items() if isinstance(g, torch.cuda.CUDAGraph) and key[0] == "start"]
    res.update(last_mode=eng.last_mode, prompts=len(prompts), tokens=tokens, rounds=len(acc),
               tau=(sum(acc) + len(acc)) / len(acc), tok_per_s=tokens / wall,
               generate_ms_per_round=1000 * wall / batch_rounds,  # a round of the batch (its b rows at once)
               prefill_ms=sum(pre) / len(pre) if pre else None,
               eager_prefill_ms=sum(eager) / len(eager) if eager else None,
               batch_rounds=batch_rounds, captured_round_graphs=len(graphs))
    if graphs:  # replays on the finished state run the same kernels (finished rows are masked, not skipped)
        g = graphs[0]
        res["gpu_ms"] = replay_ms(g.replay, args.replays)
        res["synced_ms"] = replay_ms(g.replay, args.replays, sync_each=True, sync=lambda: st.flags.tolist())
        res["kernels"] = kernel_profile(g.replay, args.profile_replays)
    if starts:  # the call's start (rows loaded, first lookup), once per call
        res["start_gpu_ms"] = replay_ms(starts[0].replay, args.replays)
        res["start_kernels"] = kernel_profile(starts[0].replay, args.profile_replays)["total"]
    def one_call():
        eng.generate(batches[0], **kw)
        torch.cuda.synchronize()

    res["host"] = host_profile(one_call)
    print(json.dumps({k: v for k, v in res.items() if k not in ("kernels", "parts", "host")}), flush=True)
    save(res)  # before the parts, which compile three more graphs
    if parts and drafter is not None:
        try:  # a failure here must not cost the figures above (12-03c lost a round's kernel table that way)
            res["parts"] = part_times(args, eng, st, tree)
        except Exception as e:  # noqa: BLE001
            res["parts_error"] = f"{type(e).__name__}: {e}"[:500]
        save(res)
    return res


def part_times(args, eng, st, tree) -> dict:
    """The drafter's block forward and the target's forward over 1 and over N+1 rows, each compiled and captured
    alone on the engine's state (their writes land at or past the finished rows' anchors: masked, as in the engine)."""
    from hf_carryover.engine.graphs import capture_round

    n = (tree.num_nodes if args.tree_nodes is None else args.tree_nodes) + 1 if tree is not None else st.k + 1
    block = st.anchor[:, None].expand(-1, n).contiguous()  # [b, n]
    pos = st.anchor_pos[:, None] + eng._steps[:n]  # [b, n]
    draft = eng._compiled(eng._draft_logits)  # compiled as the engine compiles its rounds
    on = eng.drafter.config.carryover  # as the engine's rounds: no carryover rows for a baseline drafter
    verify = eng._compiled(eng._target_forward)
    fns = {
        "drafter_block": lambda: draft(st.dcache, st.anchor, st.anchor_pos, st.carry if on else None, st.carry_pos,
                                       st.carry_valid if on else st.carry_valid[:, :0]),
        "target_1_row": lambda: verify(st.cache, st.anchor[:, None], st.anchor_pos[:, None]),
        f"target_{n}_rows": lambda: verify(st.cache, block, pos),
    }
    out = {}
    for name, fn in fns.items():
        with eng.attention_context():  # compiled and captured with the attention the engine's rounds use
            g = capture_round(fn, st.tensors() + st.cache.k + st.cache.v)
        kern = kernel_profile(g.replay, 5, top=30)
        out[name] = {"gpu_ms": replay_ms(g.replay, args.replays), "kernels": kern["total"], "by_kind": kern["by_kind"],
                     "top": kern["top"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="reference", help="'reference', a model folder, or 'smollm2-random' (the "
                   "reference's shapes with random weights: a captured round's kernels and times without the converted "
                   "target; its τ and texts mean nothing)")
    p.add_argument("--drafter", help="a drafter folder (remote code)")
    p.add_argument("--tree", help="a draft-tree JSON (rank paths), for the drafter's tree rows")
    p.add_argument("--tree_nodes", type=int, help="nodes verified per tree round (default: the whole tree)")
    p.add_argument("--lookup", type=int, default=15)
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--batch", type=int, default=1, help="rows a round (static batches of --limit prompts in order; "
                   "--limit a multiple of it)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--profile_replays", type=int, default=10)
    p.add_argument("--modes", nargs="+", default=["ar", "lookup", "linear_lookup", "tree_lookup"],
                   choices=["ar", "lookup", "linear", "linear_lookup", "tree", "tree_lookup"])
    p.add_argument("--no_parts", action="store_true", help="skip the separately captured parts")
    p.add_argument("--engine_options", nargs="*", default=[], metavar="KEY=VALUE", help="SpeculativeEngine "
                   "arguments, e.g. attention=triton (benchmark.py's --engine_options)")
    p.add_argument("--inductor", nargs="*", default=[], help="inductor options KEY=VALUE (Python literals) for the "
                   "engine's compiled rounds and parts (its compile_options)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.batch < 1 or args.limit % args.batch:
        p.error(f"--batch {args.batch}: at least 1, and --limit ({args.limit}) a multiple of it (full batches)")
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine.py times captured CUDA rounds: it needs a GPU")
    from benchmark import load_target, parse_engine_options, parse_inductor_options

    # e.g. freezing=True: the engine's compile_options, as benchmark.py --inductor passes them (rounds and parts alike)
    args.compile_options = parse_inductor_options(args.inductor)
    args.engine_kw = parse_engine_options(args.engine_options)
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype, "cuda")
    drafter = None
    if args.drafter:
        drafter = load_drafters([f"d={args.drafter}"], dtype, "cuda")["d"]
    tree = None
    if args.tree:
        from hf_carryover.engine.tree import TreeSpec

        tree = TreeSpec.load(args.tree)
    prompts = [r["input_ids"] for r in load_prompts(args.prompts_dir, args.dataset, args.limit)]
    eos = target.generation_config.eos_token_id
    record = {"command": " ".join(sys.argv), "env": environment(), "inductor": args.inductor,
              "engine_options": args.engine_kw, "modes": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    spec = {"ar": (None, None, None), "lookup": (None, None, args.lookup), "linear": (drafter, None, None),
            "linear_lookup": (drafter, None, args.lookup), "tree": (drafter, tree, None),
            "tree_lookup": (drafter, tree, args.lookup)}

    def save(res):  # every measured figure at once (a time box must not lose finished numbers)
        Path(args.out).write_text(json.dumps({**record, "modes": record["modes"] + [res]}, indent=1))

    for mode in args.modes:
        d, t, look = spec[mode]
        if (d is None and mode not in ("ar", "lookup")) or (mode.startswith("tree") and tree is None):
            continue
        try:
            res = profile_mode(args, target, d, prompts, eos, mode, save, t, look,
                               parts=not args.no_parts and mode == args.modes[-1])
        except Exception as e:  # noqa: BLE001  (keep the modes already measured)
            res = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
            print(f"{mode}: {res['error']}", flush=True)
        record["modes"].append(res)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
