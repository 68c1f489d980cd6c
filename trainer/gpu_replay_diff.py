"""Round-by-round comparison of the engine's eager and CUDA-graph decoding: where two runs of the same call part, and
whether the target's numbers parted before the tokens did.

`trainer/gpu_engine_check.py` compares whole outputs. This script finds the cause when they differ: every run records,
after each round (`SpeculativeEngine.round_hook`), the round's uniforms, the row state (anchor, its position, tokens
emitted, accepted drafts), the carryover states (the target's tapped hidden states of the verified block, exact
floats) and one float64 sum per cache layer (target and drafter K/V). Two runs are then compared round by round:

  * `first_token_round`: first round after which the row state differs (the tokens parted);
  * `first_noise_round`: first round whose uniforms differ (must be None: both runs draw from the same seed);
  * `first_carry_round` / `first_cache_round`: first round whose target hidden states / caches differ at all, and
    `max_carry_diff` over the rounds before the tokens parted. If these are None while the tokens part, the rounds
    computed the same numbers and still chose differently (control flow); if they part first, kernels rounded
    differently and a draw that sat near a boundary moved.

Pairs per configuration: eager against a second eager engine (eager determinism), the graph engine against the
same call replayed again (replay determinism) and against a fresh graph engine (capture determinism), and eager
against graph. A configuration is `dtype:kind:mode:lookup[:compile]`, e.g. `fp32:dflash:sampled:15` or
`bf16:ar:greedy:0:compile` (kind `ar`: no drafter).

    python trainer/gpu_replay_diff.py --target reference --drafter DRAFTER --prompts_dir assets/prompts \
        --configs fp32:dflash:sampled:15 fp32:dflash:sampled:0 fp32:dflash:greedy:15 --out $OUT/replay_diff.json
    python trainer/gpu_replay_diff.py --device cpu --tiny --out /tmp/replay_diff.json   # plumbing (all eager)

`--deterministic` sets `CUBLAS_WORKSPACE_CONFIG=:4096:8` and `torch.use_deterministic_algorithms(True,
warn_only=True)` before CUDA starts. Results are written to --out after every configuration.
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
from gpu_engine_check import TINY, first_diff, prompt_sets  # noqa: E402

from hf_carryover import Drafter  # noqa: E402
from hf_carryover.engine.engine import SpeculativeEngine  # noqa: E402


def snapshot(st) -> dict:
    """What one round left in the state, copied to the CPU (`.cpu()` alone would alias on a CPU run): exact values,
    so equality means bit-identical."""
    col = int(st.round) - 1

    def cp(t):
        return t.to("cpu", copy=True)

    caches = st.cache.k + st.cache.v
    snap = {"noise": cp(st.noise), "anchor": cp(st.anchor), "anchor_pos": cp(st.anchor_pos), "n_out": cp(st.n_out),
            "accepted": cp(st.accepted[:, col]), "looked": cp(st.looked[:, col]),
            "cache": cp(torch.stack([c.double().sum() for c in caches]))}
    if st.carry is not None:
        snap["carry"] = cp(st.carry.float())
        snap["dcache"] = cp(torch.stack([c.double().sum() for c in st.dcache.keys + st.dcache.values]))
    return snap


def record(engine, prompts, **kw):
    """(outputs, per-round snapshots) of one `generate()` call."""
    snaps = []
    engine.round_hook = lambda st: snaps.append(snapshot(st))
    try:
        out = engine.generate(prompts, **kw)
    finally:
        engine.round_hook = None
    return out, snaps


def compare(a, b) -> dict:
    """Round-by-round comparison of two recorded runs (see the module docstring)."""
    (out_a, sa), (out_b, sb) = a, b
    firsts = {"token": None, "noise": None, "carry": None, "cache": None, "dcache": None}
    max_carry = []
    for r, (x, y) in enumerate(zip(sa, sb)):
        same_state = all(torch.equal(x[f], y[f]) for f in ("anchor", "anchor_pos", "n_out", "accepted", "looked"))
        if firsts["token"] is None and not same_state:
            firsts["token"] = r
        for f in ("noise", "carry", "cache", "dcache"):
            if f in x and firsts[f] is None and not torch.equal(x[f], y[f]):
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
    return res


def main():
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
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    if args.deterministic:  # before the first cuBLAS handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
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
           "deterministic": args.deterministic, "seed": args.seed, "configs": []}
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
            drafter = None
            if kind == "dflash" and args.drafter:
                drafter = Drafter.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
            elif kind == "dflash":
                torch.manual_seed(1)
                drafter = Drafter.from_target(target, drafter_type="dflash", carryover=True, num_hidden_layers=3,
                                              mask_token_id=16).to(args.device).eval()
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
            eager, eager2, graph, graph2 = make(False), make(False), make(True), make(True)
            for i, q in enumerate(prompts):
                e1, e2 = record(eager, q, **kw), record(eager2, q, **kw)
                g1 = record(graph, q, **kw)
                g1_again = record(graph, q, **kw)
                g2 = record(graph2, q, **kw)
                row["graph_mode"] = graph.last_mode
                row["pairs"][f"prompt{i}"] = {"eager_vs_eager": compare(e1, e2), "graph_vs_replay": compare(g1, g1_again),
                                              "graph_vs_fresh_graph": compare(g1, g2), "eager_vs_graph": compare(e1, g1)}
                print(spec, i, json.dumps({k: (v["same_tokens"], v["first_token_round"], v["first_carry_round"])
                                           for k, v in row["pairs"][f"prompt{i}"].items()}), flush=True)
        except Exception as e:  # noqa: BLE001  (record, keep going)
            row["error"] = repr(e)[:500]
        res["configs"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=2))
    print("done", flush=True)


if __name__ == "__main__":
    main()
