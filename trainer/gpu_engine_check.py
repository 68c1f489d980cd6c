"""GPU self-check of the engine's CUDA-graph path on a SmolLM2-shaped *random* target (no weights needed), or on a
real target with a trained drafter, whose drafts are accepted (a random drafter's never are past position 1).

    python trainer/gpu_engine_check.py --out $OUT/gpu_engine_check.json
    python trainer/gpu_engine_check.py --device cpu --tiny --out /tmp/engine_check.json   # plumbing only
    python trainer/gpu_engine_check.py --target reference --drafter model_cards/NAME --prompts_dir assets/prompts \
        --dtypes fp32 --kinds dflash --batch_sizes 1 4 --compile --out /tmp/check_trained.json

For plain AR (no drafter) and a random DFlash drafter with Carryover, at batch 1 and 4:
  * fp32: `SpeculativeEngine(cuda_graphs=True)` gives the eager engine's tokens and rounds, token for token, on
    two prompt sets of different lengths (the second call must reuse the first call's graph: `graphs` is 1);
  * bf16: tokens/s of the eager and the graph engine (warm-up call excluded, CUDA-synchronised wall time);
  * fp32, sampled (T=1, same seed): the graph engine's tokens and rounds equal the eager engine's
    (`graph_sampled_same_tokens`: the graph replays the eager kernels on the same uniforms); with --compile also
    the compiled engine's (`compile_sampled_same_tokens`, informative: fused kernels may move a boundary draw);
  * with --sampled, bf16 tokens/s of sampled calls too (`<engine>_sampled_tok_per_s`).
With --target/--drafter/--prompts_dir the two prompt sets are consecutive prompts of --dataset, and in fp32 at batch 1
the eager engine's tokens are also compared with plain greedy `target.generate` (`plain_greedy_exact`).
With --lookup N every engine call uses context lookup (prompt_lookup_num_tokens=N); the eager reference engine then
drafts in every round (`lookup_skips_drafter=False`) while the graph engines skip the drafter in rounds where every
row looks up (their own captured variant), so exactness also covers that variant (`skipped_drafts` counts them).
With --tree FILE (and --tree_nodes N) every dflash call verifies that draft tree instead of the linear block, so the
same comparisons cover tree rounds (greedy and sampled; plain AR rows are unchanged).
With --continuous, every engine (the eager one too) also decodes both prompt sets in one call through b rows
(continuous batching: a finished row is refilled with the next prompt, `refill.py`; captured refills on the graph
engines) and must give each prompt the tokens and rounds of the fp32 static reference (`<engine>_continuous_exact`);
a second call on the graph engine counts its host syncs (`graph_continuous_syncs`, against its refills and launched
rounds: a refill should add none). Each continuous call runs again with `prefill_ahead=True` (the next prompt's
forward on a side stream beside the rounds): `<engine>_ahead_continuous_exact`, `graph_ahead_continuous_syncs`; with
--prefill_ahead N also with `prefill_ahead=N` (the next N prompts in one forward): `<engine>_ahead<N>_continuous_*`.
With --deterministic, PyTorch's deterministic algorithms (warn only) and a fixed cuBLAS workspace; bf16 rows record
`graph_repeat_same_tokens` (a second identical call on the graph engine) either way.
With --compile_only (fp32, --compile) only the compiled engine is compared with the eager one (greedy; continuous and
plain greedy where asked): 2026-12-05b's and 05d's checks of compiled options ran out of their time boxes before the
first row was written, most of it spent on the graph engine and the sampled extras.
Every row records `mode` (`engine.last_mode`: "cuda_graph", or why it ran eagerly). A row is written to --out after
each stage it finishes (`done`: the last one), with a progress line and the seconds since the start, so a time box
that stops the check keeps what it finished; a failing row records its error instead of stopping the script. On CPU
the graph engine runs eagerly ("eager (no CUDA)"), so only the plumbing is checked there.
"""

import argparse
import functools
import itertools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import smollm2_shaped  # noqa: E402

from hf_carryover import Drafter  # noqa: E402
from hf_carryover.engine.engine import SpeculativeEngine as Engine  # noqa: E402
from hf_carryover.engine.tree import TreeSpec  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=3,
            num_key_value_heads=1, head_dim=16)  # SmolLM2's 3:1 GQA, a few layers


def prompt_sets(b, vocab, seed, loop=False):
    """Two batches of b random prompts (5..74 tokens) whose lengths differ: the graph must not depend on them.
    loop=True repeats each prompt three times, so that context lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    lengths = ([(23 + 17 * i) % 60 + 5 for i in range(b)], [(12 + 29 * i) % 70 + 3 for i in range(b)])
    sets = [[torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lens] for lens in lengths]
    return [[p * 3 for p in ps] for ps in sets] if loop else sets


def check_drafter(target, folder, device):
    """The drafter a check runs: the trained one in `folder` (bound to `target`: a drafter trained for another target
    fails here, by name), or, with no folder, a random Carryover DFlash drafter, seeded so that the fp32 and bf16
    drafters share weights up to rounding."""
    if folder:
        dtype = next(target.parameters()).dtype
        drafter = Drafter.from_pretrained(folder, dtype=dtype).to(device).eval()
        drafter.bind_target(target)
        return drafter
    torch.manual_seed(1)
    return Drafter.from_target(target, drafter_type="dflash", carryover=True, num_hidden_layers=3,
                               mask_token_id=16).to(device).eval()


def first_diff(ref, out):
    """(row, index) of the first token where two batches of outputs differ, or None."""
    for r, (x, y) in enumerate(zip(ref, out)):
        j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None if len(x) == len(y) else min(len(x), len(y)))
        if j is not None:
            return [r, j]
    return None


def draw_boundary(target, prompts, ref, out, temperature=1.0):
    """Where two sampled runs with the same uniforms first part: the target's own distribution there (fp32, eager,
    from the common prefix) and the probability mass between the two tokens in vocabulary order, or None.

    Why: `sampling.inverse_cdf` walks the vocabulary in index order, so a round whose probabilities moved by rounding
    (another kernel, fused or captured) changes a draw only if its uniform lies within about that rounding of a
    boundary between two tokens, and the two picks are then neighbours across that boundary: the mass between them
    is (nearly) zero. A bug that moves draws would part at unrelated tokens."""
    at = first_diff(ref, out)
    if at is None or at[1] >= min(len(ref[at[0]]), len(out[at[0]])):
        return None  # equal, or one run ended first (no second token to compare)
    r, j = at
    a, b = ref[r][j], out[r][j]
    ids = torch.tensor([list(prompts[r]) + list(ref[r][:j])], device=target.device)
    with torch.no_grad():
        probs = (target(ids).logits[0, -1].float() / temperature).softmax(-1)
    lo, hi = min(a, b), max(a, b)
    return {"at": at, "tokens": [a, b], "p": [probs[a].item(), probs[b].item()],
            "mass_between": probs[lo + 1:hi].sum().item(), "cdf_at_boundary": probs[:lo + 1].sum().item()}


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def count_syncs(fn) -> int | None:
    """Host syncs during `fn()` as torch's CUDA sync debug mode reports them (one warning each, e.g. a blocking copy
    or `.tolist()`; compare with the call's launched rounds, each read once). None off CUDA."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def tok_per_s(engine, sets, reps, device, **kw):
    """Tokens/s of `reps` timed `generate()` calls over the two prompt sets in turn (call r with seed r, which only
    sampling reads), CUDA-synchronised wall time."""
    n_tok = 0
    sync(device)
    t0 = time.perf_counter()
    for r in range(reps):
        n_tok += sum(len(o) for o in engine.generate(sets[r % 2], seed=r, **kw))
    sync(device)
    return n_tok / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny target and short runs (CPU smoke test)")
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 4])
    p.add_argument("--max_new_tokens", type=int, default=None, help="default 128 (16 with --tiny)")
    p.add_argument("--reps", type=int, default=3, help="timed generate() calls per measurement")
    p.add_argument("--compile", action="store_true", help="also the graph engine with compile=True (torch.compile'd "
                   "round, then captured): exactness against eager in fp32, tokens/s in bf16")
    p.add_argument("--compile_backend", default="inductor", help="torch.compile backend of --compile ('aot_eager': "
                   "the same tracing without inductor's code generation; the CPU test's quick form)")
    p.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE", help="with --compile (inductor): "
                   "options of the compiled engine, e.g. freezing=True, as benchmark.py --inductor passes them")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="order of the passes (put bf16 first when its timings matter most in a time box)")
    p.add_argument("--kinds", nargs="+", default=["ar", "dflash"], choices=["ar", "dflash"],
                   help="plain AR and/or a random DFlash drafter with Carryover (each compiled shape costs ~1 min)")
    p.add_argument("--sampled", action="store_true", help="bf16 rows: also time sampled calls (T=1) per engine")
    p.add_argument("--target", default=None, help="'reference' (SmolLM2-135M-Instruct) or a model folder instead of "
                   "the random SmolLM2-shaped target")
    p.add_argument("--drafter", default=None, help="a trained drafter folder for kind 'dflash' (any drafter type) "
                   "instead of the random one; needs --target")
    p.add_argument("--prompts_dir", default=None, help="with --target: prompt files (prepare_prompts.py) to draw the "
                   "two prompt sets from")
    p.add_argument("--dataset", default="mtbench", help="the prompt file of --prompts_dir")
    p.add_argument("--lookup", type=int, default=None, help="context lookup of up to N tokens in every engine call")
    p.add_argument("--tree", default=None, help="kind dflash: every engine call verifies this draft tree (a JSON file "
                   "with 'paths', e.g. a drafter folder's draft_tree.json) instead of the linear block")
    p.add_argument("--tree_nodes", type=int, default=None, help="with --tree: the N likeliest nodes a round (dynamic)")
    p.add_argument("--continuous", action="store_true", help="fp32 rows: continuous batching (both prompt sets through "
                   "b rows, refilled) against the static reference, per engine")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"], help="every engine's "
                   "attention (SpeculativeEngine(attention=...); 'auto': Triton's kernel on CUDA where Triton is "
                   "installed)")
    p.add_argument("--engine_options", nargs="+", default=[], metavar="KEY=VALUE", help="SpeculativeEngine arguments "
                   "for every engine (e.g. rope_table=True drafter_attention=sdpa), recorded as engine_options")
    p.add_argument("--compile_only", action="store_true", help="with --compile, fp32: compare only the compiled "
                   "engine with the eager one (greedy tokens and rounds, continuous batching with --continuous, plain "
                   "greedy with --target); no graph engine, no sampled or lookup extras. The quickest check of a "
                   "compiled engine's options where a time box is short")
    p.add_argument("--compile_engine_options", nargs="+", default=[], metavar="KEY=VALUE", help="SpeculativeEngine "
                   "arguments for the compiled engine only (e.g. gemv_rows=64: its GEMMs as generated reductions, "
                   "which only a compiled engine can take), recorded as compile_engine_options")
    p.add_argument("--prefill_ahead", type=int, default=None, metavar="N", help="with --continuous: every continuous "
                   "call also with prefill_ahead=N (the next N waiting prompts in one forward, N >= 2)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True, "
                   "warn_only=True) and CUBLAS_WORKSPACE_CONFIG=:4096:8: does run-to-run or eager/replay variation go?")
    args = p.parse_args()
    if args.deterministic:  # before the first cuBLAS handle is made (CUDA initialises lazily)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.tree_nodes and not args.tree:
        p.error("--tree_nodes chooses nodes of --tree: give the tree too")
    if args.tree and "dflash" not in args.kinds:
        p.error("--tree applies to kind dflash (a drafter proposes the tree's ranks): add it to --kinds")
    if args.drafter and not args.target:
        p.error("--drafter needs --target: a trained drafter is bound to the target it was trained for")
    if bool(args.target) != bool(args.prompts_dir):
        p.error("--target and --prompts_dir go together (random token prompts mean nothing to a real target)")
    if args.tiny and args.target:
        p.error("--tiny shrinks the random target; it does not apply to --target")
    if args.prefill_ahead is not None and (not args.continuous or args.prefill_ahead < 2):
        p.error(f"--prefill_ahead {args.prefill_ahead}: needs --continuous and N >= 2 (1 is prefill_ahead=True, "
                "which --continuous always checks)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from benchmark import parse_engine_options, parse_inductor_options
    from evaluate_tau import environment
    compile_options = parse_inductor_options(args.inductor) or None
    engine_options = parse_engine_options(args.engine_options)
    if "attention" in engine_options:
        p.error("--engine_options attention=...: use --attention")
    compile_engine_options = parse_engine_options(args.compile_engine_options)
    if args.compile_only and (not args.compile or args.dtypes != ["fp32"]):
        p.error("--compile_only checks the compiled engine's exactness: it needs --compile and --dtypes fp32")
    if compile_engine_options and not args.compile:
        p.error("--compile_engine_options are the compiled engine's: they need --compile")
    if compile_options and (not args.compile or args.compile_backend != "inductor"):
        p.error("--inductor sets options of the inductor-compiled engine: it needs --compile (backend inductor)")
    real = None
    if args.prompts_dir:
        from evaluate_tau import load_prompts, load_target
        real = [r["input_ids"] for r in load_prompts(args.prompts_dir, args.dataset, None)]
        if len(real) < 2 * max(args.batch_sizes):
            p.error(f"{args.dataset}: {len(real)} prompts, the largest batch needs {2 * max(args.batch_sizes)}")
    max_new = args.max_new_tokens or (16 if args.tiny else 128)
    shape = TINY if args.tiny else {}
    res = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "commit": environment()["commit"], "tiny": args.tiny,
           "compile_options": args.inductor, "engine_options": engine_options,
           "compile_engine_options": compile_engine_options, "max_new_tokens": max_new,
           "target": args.target or "random SmolLM2-shaped",
           "drafter": args.drafter or "random dflash (Carryover on)",
           "prompts": f"{args.prompts_dir}/{args.dataset}" if real else "random tokens", "lookup": args.lookup,
           "tree": args.tree, "tree_nodes": args.tree_nodes, "attention": args.attention,
           "deterministic": args.deterministic, "continuous": args.continuous, "compile_only": args.compile_only,
           "rows": []}
    lk0 = {"prompt_lookup_num_tokens": args.lookup} if args.lookup else {}  # every engine call
    tree = TreeSpec.load(args.tree) if args.tree else None  # every dflash call (`lk` below)

    started = time.perf_counter()

    def save(row, stage):
        """Write the row as far as it got (`row["done"]`: its last finished stage), so that a time box that stops the
        check mid-row (a cold compile can take minutes) still leaves every comparison it finished, and say so."""
        row["done"] = stage
        if not res["rows"] or res["rows"][-1] is not row:
            res["rows"].append(row)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"[{time.perf_counter() - started:.0f} s] {row.get('dtype')} {row.get('method', '')} "
              f"batch {row.get('batch', '-')}: {stage}", flush=True)

    def record(row):
        save(row, "all")
        print(json.dumps(row), flush=True)

    SpeculativeEngine = functools.partial(Engine, attention=args.attention, **engine_options)

    def engines(target, kind):
        drafter = check_drafter(target, args.drafter, args.device) if kind == "dflash" else None
        longest = max(len(x) for x in real) if real else (240 if args.lookup else 80)
        max_len = longest + max_new + 2 * 16 + (tree.num_nodes if tree is not None else 0)  # a round's tree rows
        out = {"eager": SpeculativeEngine(target, drafter, max_len=max_len, lookup_skips_drafter=False)}
        if not args.compile_only:
            out["graph"] = SpeculativeEngine(target, drafter, max_len=max_len, cuda_graphs=True)
        if args.lookup and not args.compile_only:  # the eager engine skipping the drafter where every row looks
            # up, against drafting always
            out["eager_skip"] = SpeculativeEngine(target, drafter, max_len=max_len)
        if args.compile:
            out["graph_compile"] = SpeculativeEngine(target, drafter, max_len=max_len, cuda_graphs=True,
                                                   compile=args.compile_backend, compile_options=compile_options,
                                                   **compile_engine_options)
        return out

    for dtype_name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        try:
            if args.target:  # load_target: imported with load_prompts (--target comes with --prompts_dir)
                target = load_target(args.target, dtype, args.device)
            else:
                target = smollm2_shaped(dtype, args.device, **shape)
        except Exception as e:  # noqa: BLE001  (record, keep going)
            record({"dtype": dtype_name, "error": repr(e)[:500]})
            continue
        eos = target.config.eos_token_id
        for kind in args.kinds:
            lk = {**lk0, **({"tree": tree, "tree_nodes": args.tree_nodes} if tree is not None and kind == "dflash"
                            else {})}
            for b in args.batch_sizes:
                row = {"dtype": dtype_name, "method": kind, "batch": b}
                try:
                    built = engines(target, kind)
                    eager, graph = built["eager"], built.get("graph")
                    row.update(rope_tabled=eager.rope_tabled, rope_untabled=eager.rope_untabled)
                    sets = ([real[:b], real[b:2 * b]] if real else
                            prompt_sets(b, target.config.vocab_size, seed=b, loop=bool(args.lookup)))
                    if dtype_name == "fp32":  # exactness: both prompt sets, tokens and rounds
                        refs = []  # eager decoding once per set, compared with every other engine
                        for prompts in sets:
                            refs.append((eager.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, **lk),
                                         eager.rounds))
                        save(row, "eager reference")
                        for name, engine in built.items():
                            if name == "eager":
                                continue
                            mismatches, kernel_steps = [], []  # (attention_one_row_keys: steps on the kernel)
                            for i, (prompts, (ref, ref_rounds)) in enumerate(zip(sets, refs)):
                                out = engine.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, **lk)
                                kernel_steps.append(engine.kernel_steps)
                                if out != ref or engine.rounds != ref_rounds:
                                    mismatches.append({"set": i, "first_diff_at": first_diff(ref, out),
                                                       "rounds_equal": engine.rounds == ref_rounds})
                            tag = {"graph": "", "graph_compile": "compile_", "eager_skip": "eager_skip_"}[name]
                            row.update({f"{tag}exact": not mismatches, f"{tag}mismatches": mismatches,
                                        f"{tag}mode": engine.last_mode, f"{tag}graphs": len(engine._graphs),
                                        f"{tag}skipped_drafts": engine.skipped_drafts})
                            one_row_keys = engine.one_row_keys(b)
                            if one_row_keys:  # the one-row switch: each set's plain steps on the kernel
                                row.update({f"{tag}one_row_keys": one_row_keys,
                                            f"{tag}one_row_kernel_steps": kernel_steps})
                            if engine.compile:  # what gemv_rows and fused_linear_rows "auto" (the defaults)
                                row[f"{tag}gemv_rows"] = engine.gemv_rows  # chose for this engine
                                row[f"{tag}fused_linear_rows"] = engine.fused_linear_rows
                                if engine.fused_projections is not None:  # what the frozen pass rewrote, e.g.
                                    # skinny_gemms (skinny_rows): proof that the checked rounds ran the kernel
                                    row[f"{tag}frozen_pass"] = engine.fused_projections.record()
                            if engine._prefills and engine.compile:  # compiled row prefill: one dynamic-width
                                # compile, or per width after a failed one (`refill.py`)
                                row[f"{tag}dynamic_prefill"] = all(pf.dynamic_width
                                                                   for pf in engine._prefills.values())
                            save(row, f"{name} against eager")
                        if args.continuous:  # both sets through b rows: refills, captured on the graph engines
                            want = refs[0][0] + refs[1][0]
                            want_rounds = refs[0][1] + refs[1][1]
                            as_built = {name: engine.prefill_ahead for name, engine in built.items()}
                            aheads = (False, True) + ((args.prefill_ahead,) if args.prefill_ahead else ())
                            for (name, engine), ahead in itertools.product(built.items(), aheads):
                                engine.prefill_ahead = ahead  # next prompt(s)' forward on a side stream
                                tag = name + ("" if ahead is False else "_ahead" if ahead is True else f"_ahead{ahead}")
                                out = engine.generate(sets[0] + sets[1], max_new_tokens=max_new, eos_token_id=eos,
                                                      batch_size=b, **lk)
                                row[f"{tag}_continuous_exact"] = out == want and engine.rounds == want_rounds
                                row[f"{tag}_continuous_first_diff_at"] = first_diff(want, out)
                                row[f"{tag}_continuous_rounds_equal"] = engine.rounds == want_rounds
                                prefills = list(engine._prefills.values())
                                row[f"{tag}_continuous_refill_graphs"] = sum(
                                    g is not None for pf in prefills for g in pf.graphs.values())
                                if name == "graph":  # host syncs of a warm call (graphs captured): a refill queues
                                    # without waiting (`ReadOut`, `stage_rows`, `RowPrefill.ahead`); count what torch
                                    # flags as syncs
                                    row[f"{tag}_continuous_syncs"] = count_syncs(lambda: engine.generate(
                                        sets[0] + sets[1], max_new_tokens=max_new, eos_token_id=eos, batch_size=b,
                                        **lk))
                                    row[f"{tag}_continuous_refills"] = max(len(sets[0] + sets[1]) - b, 0)
                                    row[f"{tag}_continuous_launched"] = engine.last_launched
                                save(row, f"{tag} continuous")
                            for name, engine in built.items():
                                engine.prefill_ahead = as_built[name]  # (for the rest of the row)
                        row["tau"] = eager.tau if kind == "dflash" else None
                        if real and b == 1:  # the engine against plain greedy decoding of the target itself
                            plain = [target.generate(torch.tensor([x], device=args.device), max_new_tokens=max_new,
                                                     do_sample=False, eos_token_id=eos)[0, len(x):].tolist()
                                     for prompts in sets for x in prompts]
                            row["plain_greedy_exact"] = plain == refs[0][0] + refs[1][0]
                            row["plain_greedy_first_diff_at"] = first_diff(plain, refs[0][0] + refs[1][0])
                            save(row, "plain greedy")
                        if args.compile_only:
                            record(row)
                            continue
                        # sampled rounds (T=1): the graph replays the eager round's kernels on the same uniforms, so
                        # the same seed must give the same tokens (part of all_exact)
                        kw = dict(max_new_tokens=max_new, eos_token_id=eos, do_sample=True, temperature=1.0, seed=7,
                                  **lk)
                        ref_s = eager.generate(sets[0], **kw)
                        out_g = graph.generate(sets[0], **kw)
                        row.update({"graph_sampled_same_tokens": out_g == ref_s and graph.rounds == eager.rounds,
                                    "graph_sampled_first_diff_at": first_diff(ref_s, out_g),
                                    "graph_sampled_boundary": draw_boundary(target, sets[0], ref_s, out_g),
                                    "graph_sampled_mode": graph.last_mode,
                                    "graph_sampled_skipped_drafts": graph.skipped_drafts})
                        if args.lookup:  # where a sampled lookup run parts from the eager one: lengths and rounds
                            row["sampled_detail"] = {
                                "lengths": {"eager": [len(x) for x in ref_s], "graph": [len(x) for x in out_g]},
                                "eager_rounds": [list(zip(a, looked)) for a, looked
                                                 in zip(eager.rounds, eager.lookup_rounds)],
                                "graph_rounds": [list(zip(a, looked)) for a, looked
                                                 in zip(graph.rounds, graph.lookup_rounds)]}
                            # control: the same sampled call without lookup (replay equalled eager there before)
                            kw0 = {x: v for x, v in kw.items() if x != "prompt_lookup_num_tokens"}
                            row["nolookup_graph_sampled_same_tokens"] = (graph.generate(sets[0], **kw0)
                                                                         == eager.generate(sets[0], **kw0))
                            # replayed rounds that draft always: tells a graph effect from a skip effect
                            ga = SpeculativeEngine(target, graph.drafter, max_len=graph.max_len, cuda_graphs=True,
                                                   lookup_skips_drafter=False)
                            out_a = ga.generate(sets[0], **kw)
                            row.update({"graph_always_sampled_same_tokens": out_a == ref_s,
                                        "graph_always_sampled_first_diff_at": first_diff(ref_s, out_a),
                                        "graph_always_sampled_boundary": draw_boundary(target, sets[0], ref_s, out_a)})
                        if "eager_skip" in built:  # sampled rounds that skip the drafter, eagerly
                            out_e = built["eager_skip"].generate(sets[0], **kw)
                            row.update({"eager_skip_sampled_same_tokens": out_e == ref_s,
                                        "eager_skip_sampled_first_diff_at": first_diff(ref_s, out_e),
                                        "eager_skip_sampled_skipped_drafts": built["eager_skip"].skipped_drafts})
                        if "graph_compile" in built:  # compiled sampled rounds: same seed, same draws?
                            # Informative, not part of all_exact: fused kernels may move a draw that sits on a
                            # probability boundary, which is still a draw from the same distribution
                            out_s = built["graph_compile"].generate(sets[0], **kw)
                            row.update({"compile_sampled_same_tokens": out_s == ref_s,
                                        "compile_sampled_first_diff_at": first_diff(ref_s, out_s),
                                        "compile_sampled_boundary": draw_boundary(target, sets[0], ref_s, out_s),
                                        "compile_sampled_mode": built["graph_compile"].last_mode})
                    else:  # speed: warm-up call (captures the graph), then timed calls over both prompt sets
                        first = {}
                        for name, engine in built.items():
                            first[name] = engine.generate(sets[0], max_new_tokens=max_new, eos_token_id=eos, **lk)
                            kw = dict(max_new_tokens=max_new, eos_token_id=eos, **lk)
                            row[f"{name}_tok_per_s"] = tok_per_s(engine, sets, args.reps, args.device, **kw)
                            row[f"{name}_mode"] = engine.last_mode
                            if args.sampled:  # T=1: warm-up (captures the sampled graph), then the timed calls
                                kw.update(do_sample=True, temperature=1.0)
                                engine.generate(sets[0], **kw)
                                row[f"{name}_sampled_tok_per_s"] = tok_per_s(engine, sets, args.reps, args.device, **kw)
                                row[f"{name}_sampled_mode"] = engine.last_mode
                        row["speedup"] = row["graph_tok_per_s"] / row["eager_tok_per_s"]
                        row["same_tokens"] = first["eager"] == first["graph"]  # informative: bf16 near-ties
                        # run to run: the same call again on the graph engine (greedy bf16 has varied between passes)
                        row["graph_repeat_same_tokens"] = graph.generate(sets[0], max_new_tokens=max_new,
                                                                         eos_token_id=eos, **lk) == first["graph"]
                        if "graph_compile" in first:
                            row["compile_over_graph"] = row["graph_compile_tok_per_s"] / row["graph_tok_per_s"]
                            row["compile_same_tokens"] = first["eager"] == first["graph_compile"]
                except Exception as e:  # noqa: BLE001  (record, keep going)
                    row["error"] = repr(e)[:500]
                record(row)
        del target
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rows = res["rows"]
    res["all_exact"] = bool(rows) and all(r.get("exact", True) and r.get("compile_exact", True) and "error" not in r
                                          and r.get("eager_skip_exact", True)
                                          and r.get("eager_skip_sampled_same_tokens", True)
                                          and r.get("plain_greedy_exact", True)
                                          and all(v for x, v in r.items() if x.endswith("_continuous_exact"))
                                          and r.get("graph_sampled_same_tokens", True) for r in rows)
    res["graphs_used"] = bool(rows) and all(  # the graph engine's mode; with --compile_only the compiled one's
        r.get("mode", r.get("graph_mode")) == "cuda_graph" if "mode" in r or "graph_mode" in r
        else r.get("compile_mode") == "cuda_graph+compile" for r in rows)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"all_exact={res['all_exact']} graphs_used={res['graphs_used']}", flush=True)


if __name__ == "__main__":
    main()
