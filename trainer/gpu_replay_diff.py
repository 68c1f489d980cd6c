"""Round-by-round comparison of the engine's eager and CUDA-graph decoding: where two runs of the same call part, and
whether the target's numbers parted before the tokens did.

`trainer/gpu_engine_check.py` compares whole outputs. This script finds the cause when they differ: every run records,
after each round (`SpeculativeEngine.round_hook`), the round's uniforms, the row state (anchor, its position, tokens
emitted, accepted drafts, the committed sequence), the next round's lookup, the valid carryover rows (the target's
tapped hidden states, exact floats), one float64 sum per cache layer over the committed positions (target and drafter
K/V), and in eager runs each forward's output and the verified block (Python hooks never run in a replayed graph).
Two runs are then compared round by round:

  * `first_token_round`: first round after which the row state differs (the tokens parted);
  * `first_noise_round`: first round whose uniforms differ (must be None: both runs draw from the same seed);
  * `first_{look,carry,cache,dcache}_round`: first round whose lookup / carryover rows / caches differ at all, and
    `max_carry_diff_before_parting`;
  * `first_fwd_{drafter,block,target}_round` (eager pairs): first round whose drafter output, verified block or target
    logits differ, with `first_forward_diff` giving the sizes. A block that changes while the drafter's output did not
    points at the draw; a target output that changes with an unchanged block points at the target's kernels.

Pairs per configuration: eager against a second eager engine (eager determinism), the graph engine against the
same call replayed again (replay determinism) and against a fresh graph engine (capture determinism), and eager
against graph. A configuration is `dtype:kind:mode:lookup[:compile]`, e.g. `fp32:dflash:sampled:15` or
`bf16:ar:greedy:0:compile` (kind `ar`: no drafter).

    python trainer/gpu_replay_diff.py --target reference --drafter DRAFTER --prompts_dir assets/prompts \
        --configs fp32:dflash:sampled:15 fp32:dflash:sampled:0 fp32:dflash:greedy:15 --out $OUT/replay_diff.json
    python trainer/gpu_replay_diff.py --device cpu --tiny --out /tmp/replay_diff.json   # plumbing (all eager)
    python trainer/gpu_replay_diff.py --summarize RESULT.json...                        # a Markdown table

`--determinism all` sets `CUBLAS_WORKSPACE_CONFIG=:4096:8` and `torch.use_deterministic_algorithms(True,
warn_only=True)` before CUDA starts (`cublas`, `algorithms`, `algorithms_nofill`: one part each, to tell which part
matters). Results are written to --out after every configuration.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import smollm2_shaped  # noqa: E402
from gpu_engine_check import TINY, check_drafter, first_diff, prompt_sets  # noqa: E402

from hf_carryover.engine.engine import SpeculativeEngine  # noqa: E402


PAIRS = {"eager_vs_eager": ("eager", "eager2"), "graph_vs_replay": ("graph", "graph_again"),
         "graph_vs_fresh_graph": ("graph", "graph2"), "eager_vs_graph": ("eager", "graph")}


def probe_cumsum(n, vocab, device):
    """Repeat, n times, a float32 cumsum of one vocabulary-sized distribution (one row: on CUDA a decoupled look-back
    scan whose grouping of additions may change from launch to launch), the engine's `running_mass` of it, and 1000
    inverse-CDF draws from one row at a time at fixed uniforms: how many repetitions differ from the first."""
    from hf_carryover.engine.engine import inverse_cdf, running_mass

    g = torch.Generator(device="cpu").manual_seed(0)
    probs = (torch.randn(1, vocab, generator=g) * 3).softmax(-1).to(device)
    u = torch.rand(1000, generator=g).to(device)

    def draws():
        return torch.stack([inverse_cdf(probs, u[i : i + 1]) for i in range(len(u))])

    ref_c, ref_m, ref_t = probs.cumsum(-1), running_mass(probs), draws()
    cums = masses = toks = 0
    for _ in range(n):
        cums += not torch.equal(probs.cumsum(-1), ref_c)
        masses += not torch.equal(running_mass(probs), ref_m)
        toks += int((draws() != ref_t).sum())
    return {"repeats": n, "cumsum_differs": cums, "running_mass_differs": masses, "draws_that_differ": toks,
            "draws": 1000 * n}


def snapshot(st) -> dict:
    """What one round left in the state, copied to the CPU (`.cpu()` alone would alias on a CPU run): exact values,
    so equality means bit-identical."""
    col = int(st.round[0]) - 1

    def cp(t):
        return t.to("cpu", copy=True)

    # caches: sums over committed positions only (past them lie rows of rejected drafts and of earlier calls, which
    # differ between engines with different histories and are never read)
    seen = (torch.arange(st.seq.shape[1], device=st.seq.device)[None] < st.anchor_pos[:, None])  # [b, max_len]

    def sums(caches):
        return cp(torch.stack([(c.double() * seen[:, None, :, None]).sum() for c in caches]))

    snap = {"noise": cp(st.noise), "anchor": cp(st.anchor), "anchor_pos": cp(st.anchor_pos), "n_out": cp(st.n_out),
            "accepted": cp(st.accepted[:, col]), "looked": cp(st.looked[:, col]), "look": cp(st.look),
            "n_look": cp(st.n_look), "seq": cp(torch.where(seen, st.seq, -1)), "cache": sums(st.cache.k + st.cache.v)}
    if st.carry is not None:  # valid rows only
        snap["carry"] = cp(st.carry.float() * st.carry_valid[..., None])
        snap["dcache"] = sums(st.dcache.keys + st.dcache.values)
    return snap


def record(engine, prompts, **kw):
    """(outputs, per-round snapshots) of one `generate()` call. Eagerly run rounds also record what went into and
    came out of each forward (Python hooks never run in a replayed graph): the drafter's hidden states and the block
    of tokens the target verified, so a parting can be traced to the drafter, the proposals or the target."""
    snaps, fwd = [], {"drafter": [], "block": [], "target": []}
    def on_target(module, args, kwargs, out):  # returns None: the output stays as it is
        fwd["block"].append(kwargs["input_ids"].to("cpu", copy=True))
        fwd["target"].append(out.logits.float().to("cpu", copy=True))

    def on_drafter(module, args, out):
        fwd["drafter"].append(out.float().to("cpu", copy=True))

    hooks = []
    if not engine.cuda_graphs:  # a hook's copy to the CPU would break capture
        hooks.append(engine.target.register_forward_hook(on_target, with_kwargs=True))
        if engine.drafter is not None:
            hooks.append(engine.drafter.register_forward_hook(on_drafter))

    def hook(st):
        snap = snapshot(st)
        for name, seen in fwd.items() if hooks else ():  # this round's forwards (eager runs; the prefill's target
            snap[f"fwd_{name}"] = list(seen)  # call is round 0's first "target")
            seen.clear()
        snaps.append(snap)

    engine.round_hook = hook
    try:
        out = engine.generate(prompts, **kw)
    finally:
        engine.round_hook = None
        for h in hooks:
            h.remove()
    return out, snaps


def compare(a, b) -> dict:
    """Round-by-round comparison of two recorded runs (see the module docstring)."""
    (out_a, sa), (out_b, sb) = a, b
    fields = ("noise", "look", "carry", "cache", "dcache", "fwd_drafter", "fwd_block", "fwd_target")
    firsts = {"token": None, **{f: None for f in fields}}
    max_carry = []

    def same(u, v):
        if isinstance(u, list):
            return len(u) == len(v) and all(same(x, y) for x, y in zip(u, v))
        return u.shape == v.shape and torch.equal(u, v)

    for r, (x, y) in enumerate(zip(sa, sb)):
        state = ("anchor", "anchor_pos", "n_out", "accepted", "looked", "seq")
        if firsts["token"] is None and not all(same(x[f], y[f]) for f in state):
            firsts["token"] = r
        for f in fields:
            if f in x and f in y and firsts[f] is None and not same(x[f], y[f]):
                firsts[f] = r
        if "carry" in x and firsts["token"] is None:
            max_carry.append(float((x["carry"] - y["carry"]).abs().max()))
    res = {"same_tokens": out_a == out_b, "first_diff_at": first_diff(out_a, out_b), "rounds": [len(sa), len(sb)],
           **{f"first_{f}_round": v for f, v in firsts.items()},
           "max_carry_diff_before_parting": max(max_carry) if max_carry else None}
    r = firsts["token"]
    if r is not None:  # the round where the tokens parted, in both runs
        res["parting"] = {name: {f: s[r][f].tolist() for f in ("accepted", "looked", "n_out", "anchor")}
                          for name, s in (("a", sa), ("b", sb))}
        res["parting"]["noise"] = sa[r]["noise"].tolist()
        res["parting"]["carry_diff_before"] = (float((sa[r - 1]["carry"] - sb[r - 1]["carry"]).abs().max())
                                               if r > 0 and "carry" in sa[r] else None)
    forwards = [firsts[f] for f in ("fwd_drafter", "fwd_block", "fwd_target") if firsts[f] is not None]
    if forwards:  # the first round whose forwards differ: by how much, and the verified blocks
        r = min(forwards)
        diff = {"round": r, "blocks": [[t.tolist() for t in s[r]["fwd_block"]] for s in (sa, sb)]}
        for f in ("fwd_drafter", "fwd_target"):
            diff[f] = [float((u - v).abs().max()) if u.shape == v.shape else "shapes differ"
                       for u, v in zip(sa[r][f], sb[r][f])]
        res["first_forward_diff"] = diff
    return res


def summarize(paths) -> str:
    """A Markdown table of stored results: per file, configuration and pair, how many prompts kept the same tokens,
    and the rounds where the others parted (tokens / carryover states / verified block)."""
    lines = ["| file | commit | determinism | config | pair | same tokens | "
             "parted at rounds (tokens / carry / block) |",
             "|---|---|---|---|---|---|---|"]
    for path in paths:
        res = json.loads(Path(path).read_text())
        det = res.get("determinism", "all" if res.get("deterministic") else "none")
        head = f"| {Path(path).name} | {res['commit'][:7]} | {det} |"
        for row in res["configs"]:
            prompts = list(row["pairs"].values())
            for pair in prompts[0] if prompts else ():
                got = [x[pair] for x in prompts]
                parted = [f"{g['first_token_round']}/{g['first_carry_round']}/{g.get('first_fwd_block_round')}"
                          for g in got if not g["same_tokens"]]
                lines.append(f"{head} {row['config']} | {pair} | {sum(g['same_tokens'] for g in got)}/{len(got)} | "
                             f"{', '.join(parted) or '-'} |")
            if "error" in row:
                lines.append(f"{head} {row['config']} | error | | {row['error'][:80]} |")
        if "probe_cumsum" in res:
            pr = res["probe_cumsum"]
            lines.append(f"{head} cumsum probe | {pr['repeats']} repeats | cumsum differs {pr['cumsum_differs']}, "
                         f"running_mass differs {pr.get('running_mass_differs', 'n/a')}, draws differ "
                         f"{pr['draws_that_differ']}/{pr['draws']} | |")
    return "\n".join(lines)


def main():
    if sys.argv[1:2] == ["--summarize"]:  # python trainer/gpu_replay_diff.py --summarize FILE...
        print(summarize(sys.argv[2:]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny random target (CPU smoke test)")
    p.add_argument("--target", default=None, help="'reference' or a model folder (default: random SmolLM2-shaped)")
    p.add_argument("--drafter", default=None, help="a trained drafter folder (default: a random Carryover DFlash)")
    p.add_argument("--prompts_dir", default=None)
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--prompts", type=int, default=2, help="prompts, one call each (batch 1)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (16 with --tiny)")
    p.add_argument("--configs", nargs="+", default=["fp32:dflash:sampled:15", "fp32:dflash:sampled:0",
                                                   "fp32:dflash:greedy:15"])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS),
                   help="which comparisons (only the engines they need run)")
    p.add_argument("--determinism", default="none", choices=["none", "cublas", "algorithms", "algorithms_nofill",
                                                              "all"],
                   help="cublas: CUBLAS_WORKSPACE_CONFIG=:4096:8; algorithms: torch.use_deterministic_algorithms(True, "
                        "warn_only=True) (which also fills uninitialised memory); algorithms_nofill: the same without "
                        "that filling; all: cublas + algorithms")
    p.add_argument("--probe_cumsum", type=int, default=0, help="also repeat a vocabulary-sized float32 cumsum and "
                   "inverse-CDF draw N times and count results that differ from the first")
    args = p.parse_args()
    if args.determinism in ("cublas", "all"):  # before the first cuBLAS handle is made
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if args.determinism in ("algorithms", "algorithms_nofill", "all"):
        torch.use_deterministic_algorithms(True, warn_only=True)
        if args.determinism == "algorithms_nofill":
            torch.utils.deterministic.fill_uninitialized_memory = False
    if bool(args.target) != bool(args.prompts_dir):
        p.error("--target and --prompts_dir go together")
    if args.drafter and not args.target:
        p.error("--drafter needs --target")
    real = None
    if args.prompts_dir:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from evaluate_tau import load_prompts, load_target
        real = [r["input_ids"] for r in load_prompts(args.prompts_dir, args.dataset, args.prompts)]
    max_new = args.max_new_tokens or (16 if args.tiny else 128)
    res = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "commit": os.environ.get("HF_CARRYOVER_COMMIT", "unknown"), "target": args.target or "random",
           "drafter": args.drafter or "random dflash (Carryover on)", "max_new_tokens": max_new,
           "determinism": args.determinism, "seed": args.seed, "configs": []}
    if args.probe_cumsum:
        res["probe_cumsum"] = probe_cumsum(args.probe_cumsum, 49152, args.device)
        print("probe_cumsum", res["probe_cumsum"], flush=True)
    targets = {}
    for spec in args.configs:
        dtype_name, kind, mode, lookup, *extra = spec.split(":")
        row = {"config": spec, "pairs": {}}
        try:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            if dtype_name not in targets:
                targets[dtype_name] = (load_target(args.target, dtype, args.device) if args.target else
                                       smollm2_shaped(dtype, args.device, **(TINY if args.tiny else {})))
            target = targets[dtype_name]
            drafter = check_drafter(target, args.drafter, args.device) if kind == "dflash" else None
            prompts = [[x] for x in real] if real else [[q] for q in prompt_sets(1, target.config.vocab_size, 1,
                                                                                 loop=True)[0]]
            max_len = max(len(q[0]) for q in prompts) + max_new + 40
            comp = "compile" in extra
            make = lambda graphs: SpeculativeEngine(target, drafter, max_len=max_len, cuda_graphs=graphs,  # noqa: E731
                                                    compile=comp and graphs)
            kw = dict(max_new_tokens=max_new, eos_token_id=target.config.eos_token_id, seed=args.seed,
                      do_sample=mode == "sampled")
            if int(lookup):
                kw["prompt_lookup_num_tokens"] = int(lookup)
            need = {run for pair in args.pairs for run in PAIRS[pair]}
            engines = {"eager": make(False), "eager2": make(False), "graph": make(True), "graph2": make(True)}
            for i, q in enumerate(prompts):
                runs = {}
                for run in ("eager", "eager2", "graph", "graph_again", "graph2"):  # the second graph call replays
                    if run in need:
                        runs[run] = record(engines["graph" if run == "graph_again" else run], q, **kw)
                row["graph_mode"] = engines["graph"].last_mode if "graph" in need else None
                row["pairs"][f"prompt{i}"] = {pair: compare(runs[PAIRS[pair][0]], runs[PAIRS[pair][1]])
                                              for pair in args.pairs}
                print(spec, i, json.dumps({k: {f: v[f] for f in ("same_tokens", "first_token_round", "first_look_round",
                                                                "first_carry_round", "first_fwd_drafter_round",
                                                                "first_fwd_block_round", "first_fwd_target_round")}
                                           for k, v in row["pairs"][f"prompt{i}"].items()}), flush=True)
        except Exception as e:  # noqa: BLE001  (record, keep going)
            row["error"] = repr(e)[:500]
        res["configs"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=2))
    print("done", flush=True)


if __name__ == "__main__":
    main()
