"""Side-by-side decoding speed on the same prompts: tokens/s, τ and speedup against each AR baseline.

    python examples/benchmark.py --drafters dflash=model_cards/A carry=model_cards/B \
        --datasets mtbench humaneval --limit 20 --max_new_tokens 256 --batch_sizes 1 2 4 8 16 --out examples/results/RUN

Methods (each skipped with a recorded reason when it cannot run here):
  hf_eager            transformers generate(), dynamic cache, batch 1
  hf_static_compile   generate() with cache_implementation="static" + torch.compile (CUDA only)
  hf_prompt_lookup    generate(prompt_lookup_num_tokens=10)
  hf_spec:<name>      generate(assistant_model=drafter)   (our HF path)
  hf_own_dflash:<name> generate(assistant_model=drafter, speculation_type="dflash"): transformers' own DFlash
                      loop driving our drafter (DFlash drafters with a target-row mask; no Carryover there)
  engine_ar           hf_carryover.engine without a drafter (static caches; eager, or CUDA graphs with --cuda_graphs)
  engine_ar:<tag>     (--ar_variant TAG KEY=VALUE...) the same with its own engine options, e.g. plain steps on the
                      Triton kernel (attention_min_rows=1), or its own inductor options over --inductor's
                      (compile_options={'coordinate_descent_tuning':True})
  engine:<name>       hf_carryover.engine with the drafter, at every --batch_sizes value (throughput; static
                      batches of b prompts; with --batching continuous, b rows refilled as they finish: @<b>c)
  engine_lookup:<name> (--lookup N) the engine with the drafter and context lookup of up to N tokens; a round in
                      which every row looks up skips the drafter
  engine_lookup_always_draft:<name> (--lookup N) the same, drafting in every round (what the skip saves)
  engine_pld          (--lookup N) the engine without a drafter, prompt-lookup decoding of N tokens a round
  engine_tree<N>:<name> (--tree FILE --tree_nodes N ...) the engine verifying a draft tree each round: the N nodes of
                      FILE's tree (a superset from examples/calibrate_tree.py) the drafter finds likeliest, per row
                      (N = "all": the whole tree, static); DFlash drafters, any --temperature; with --lookup also
                      engine_tree_lookup<N>:<name> (looked-up tokens on the tree's rank-0 chain)
  hf_spec_lookup:<name> (--lookup N) generate(assistant_model=drafter, prompt_lookup_num_tokens=N)
  hf_spec_tree<N>:<name>, hf_spec_tree_lookup<N>:<name> (--tree ...) generate(assistant_model=drafter) after
                      drafter.use_draft_tree(FILE, N): greedy calls verify draft trees on the engine, one prompt a call
  hf_spec_dynamic:<name>, hf_spec_lookup_dynamic:<name> (CUDA only) the same with `drafter.static_rounds = False`: the
                      drafter's part of a round eager on dynamic shapes, as before static rounds (CUDA graphs) existed
Engine rows record `mode`: how the engine ran ("eager", "cuda_graph", or why graphs were not used).
vLLM rows (vllm_ar@b, vllm_dflash:<name>@b) come from examples/bench_vllm.py run with the same --out.
Timing: warm-up excluded, CUDA-synchronised wall time; `--passes N` times every method N times in alternating
order and reports the median pass; `--timing_turn DIR:I:N` makes this process slot I of N that compile side by
side on one GPU and time one at a time (`timing_turns.py`). Every finished measurement is appended to
`<out>/bench_raw.jsonl`; `<out>/bench.json` and `<out>/bench.md` summarise with environment, rewritten after every
row (a time box that cuts the run leaves the summary of the rows that finished).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evaluate_tau  # noqa: E402
from evaluate_tau import INDUCTOR_PREFIX, environment, load_drafters, load_prompts, with_inductor_keys  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _compile_clock():
    """Calls and seconds per torch.compile phase so far (the `dynamo_timed` phases that
    `torch._dynamo.utils.compilation_time_metrics` accumulates per process).

    Why: a compiled engine row cost 105-192 s of a call on the GPUs while its timed pass took 4-12 s
    (`row_wall_s` against `seconds`), and a session's device time goes mostly there. The difference of two
    clocks (`_compile_split`) says which phases a row's warm-up spent it in."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without it: the row keeps its other fields
        return {}
    return {k: (len(v), sum(v)) for k, v in compilation_time_metrics.items()}


def _compile_split(before, after):
    """The phases of `after` that grew since `before`, slowest first: {phase: [calls, seconds]}. Phases nest (a
    frame's compile holds its graph's lowering, which holds its kernels' compilation), so they do not add up. All of
    them: in h100-2026-12-07i an AR row's AOT phase took 113 s around inductor's 51 s, and the 20 slowest phases it
    kept then accounted for about 20 s of the other 62."""
    grown = {k: (n - before.get(k, (0, 0.0))[0], s - before.get(k, (0, 0.0))[1]) for k, (n, s) in after.items()}
    grown = sorted(((k, n, s) for k, (n, s) in grown.items() if n > 0), key=lambda x: -x[2])
    return {k: [n, round(s, 2)] for k, n, s in grown}


def _row_cost(res) -> str:
    """The printed tail of a row's line: its whole wall time and, for engine rows, the warm-up's part of it."""
    if "row_wall_s" not in res:
        return ""
    warm = f", warm-up {res['warmup_s']:.0f} s in {res['warmup_calls']} calls" if "warmup_s" in res else ""
    return f"  (row {res['row_wall_s']:.0f} s{warm})"


def load_target(name, dtype, device):
    if name == "tiny":  # plumbing smoke test (tests/test_benchmark_script.py)
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=95, bos_token_id=0,
                          pad_token_id=0, initializer_range=0.3)
        return LlamaForCausalLM(cfg).to(device, dtype).eval()
    if name == "qwen3-4b-random":  # a Qwen3-4B-shaped target with random weights: timings for a projection only
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=40960, eos_token_id=151645, pad_token_id=151643)
        with torch.device(device):
            return Qwen3ForCausalLM(cfg).to(dtype).eval()
    if name == "smollm2-random":  # the reference target's shapes with random weights: step timings on a machine
        # without the converted target (with --ignore_eos every row decodes the same tokens as any target would);
        # the random SmolLM2 of the GPU checks (trainer/gpu_check.py), with the reference's norm epsilon
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
        from gpu_check import smollm2_shaped

        return smollm2_shaped(dtype, device, rms_norm_eps=1e-5)
    return evaluate_tau.load_target(name, dtype, device)  # "reference" or a model folder


def sampling_kwargs(temperature):
    """generate() arguments for one temperature: greedy at 0; else plain temperature sampling (no top-k/top-p from
    the target's generation_config), the distribution the speculative paths must reproduce."""
    if not temperature:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


def run_hf(target, prompts, max_new, temperature=0.0, static_rounds=None, tree=None, **kw):
    """generate() one prompt at a time. τ: from our generator's recorded rounds (hf_spec), or, for loops that
    record nothing (transformers' own DFlash path), from the number of target forwards: every forward after
    the prefill is one verification round, so τ = (new tokens - 1) / (forwards - 1) (the prefill's token
    excluded, as in our rounds; a round cut by max_new_tokens counts its emitted tokens only).
    tree=(TreeSpec, nodes, compile): the drafter verifies draft trees for this row (`drafter.use_draft_tree`)."""
    n_tok, secs, taus = 0, 0.0, []
    drafter = kw.get("assistant_model")
    if tree is not None:
        drafter.use_draft_tree(*tree)
    own_loop = kw.get("speculation_type") is not None
    calls = [0]
    hook = target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) if own_loop else None
    fwd_tokens = fwd_rounds = 0
    if drafter is not None:
        drafter.static_rounds = static_rounds  # None: static rounds (CUDA graphs) on CUDA; False: the dynamic path
    try:
        for p in prompts:
            x = torch.tensor([p], device=target.device)
            if drafter is not None:
                drafter.last_candidate_generator = None  # never read a previous method's rounds
            calls[0] = 0
            y, dt = _timed(lambda: target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                                   **sampling_kwargs(temperature), **kw))
            new = y.shape[1] - x.shape[1]
            lookup = kw.get("prompt_lookup_num_tokens")
            taken = getattr(drafter.last_candidate_generator, "lookup_tokens", None) if drafter is not None else None
            if drafter is not None and lookup and taken != lookup:
                # a drafter folder saved before context lookup existed carries remote code that ignores the argument
                # (2026-11-30h: such rows measured plain drafting under the lookup label)
                raise SystemExit(f"{drafter.name_or_path}: its remote code ignores prompt_lookup_num_tokens (saved "
                                 "before context lookup existed); copy hf_carryover's generation_carryover.py, "
                                 "modeling_drafter.py and configuration_drafter.py into the folder")
            n_tok += new
            secs += dt
            if own_loop:
                fwd_tokens, fwd_rounds = fwd_tokens + new - 1, fwd_rounds + calls[0] - 1
            elif drafter is not None:
                taus += [r["accepted"] + 1 for r in drafter.last_candidate_generator.rounds]
    finally:
        if hook is not None:
            hook.remove()
        if drafter is not None:
            drafter.static_rounds = None
            drafter.use_draft_tree(None)
    tau = sum(taus) / len(taus) if taus else (fwd_tokens / fwd_rounds if fwd_rounds > 0 else None)
    mode = {}
    if drafter is not None and not own_loop:
        gen = drafter.last_candidate_generator
        st = gen.static
        mode = {"mode": f"tree on the engine ({gen.mode})" if tree is not None else
                "dynamic" if st is None else "static+cuda_graphs" if st.graphs else "static (eager)"}
    return {"tokens": n_tok, "seconds": secs, "tok_per_s": n_tok / secs, "tau": tau,
            **({"tau_from": "target forward count"} if own_loop else {}), **mode}


def make_engine(target, drafter, max_len, profile=False, cuda_graphs=False, compile=False, compile_options=None,
                engine_options=None):
    """The engine for a drafter's rows; a drafter spec's engine keys (evaluate_tau's `ENGINE_KEYS`, e.g.
    `NAME=FOLDER,lookup_min_ngram=2`) are passed on over `engine_options` (--engine_options, every engine), so two
    specs of one folder time two engine settings."""
    from hf_carryover.engine.engine import SpeculativeEngine

    options = {**(engine_options or {}), **(getattr(drafter, "_eval_engine", None) or {})}
    own = options.pop("compile_options", None)  # an --ar_variant's or a spec's (inductor.KEY) inductor options
    if own is not None and not isinstance(own, dict):
        raise SystemExit(f"compile_options={own!r}: expected a dict of inductor options, e.g. "
                         "compile_options={'coordinate_descent_tuning':True}")
    engine, build_s = _timed(lambda: SpeculativeEngine(
        target, drafter, max_len=max_len, profile=profile, cuda_graphs=cuda_graphs, compile=compile,
        compile_options={**(compile_options or {}), **(own or {})}, **options))
    engine.options = {**options, **({"compile_options": own} if own else {})}  # what run_engine records in each row
    engine.build_s = build_s  # reported by the engine's first row (run_engine), then cleared
    return engine


def _parse_pairs(pairs, what: str, example: str, text_ok: bool) -> dict:
    """KEY=VALUE pairs -> {KEY: Python literal}; a value that is no literal is kept as text where `text_ok`, else
    refused by name, as is a pair without "="."""
    import ast

    need = "KEY=VALUE" if text_ok else "KEY=VALUE with a Python literal"
    opts = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} {pair!r}: expected {need}, e.g. {example}")
        try:
            opts[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            if not text_ok:
                raise SystemExit(f"{what} {pair!r}: expected {need}, e.g. {example}") from None
            opts[key] = val
    return opts


def parse_inductor_options(pairs) -> dict:
    """["freezing=True", "triton.cudagraphs=False"] -> {"freezing": True, "triton.cudagraphs": False} (values are
    Python literals); a pair without "=" or with a value that is no literal is refused by name."""
    return _parse_pairs(pairs, "inductor option", "freezing=True", text_ok=False)


def parse_ar_variants(groups) -> dict:
    """[["kernel", "attention_min_rows=1"], ...] (--ar_variant) -> {"kernel": {"attention_min_rows": 1}}: engine AR
    rows with their own engine options, so plain decoding on two settings is timed side by side in one call."""
    variants = {}
    for tag, *pairs in groups:
        if "=" in tag or ":" in tag or "@" in tag or not pairs:
            raise SystemExit(f"--ar_variant {' '.join([tag, *pairs])!r}: expected TAG KEY=VALUE..., e.g. "
                             "kernel attention_min_rows=1")
        if tag in variants:
            raise SystemExit(f"--ar_variant {tag!r} given twice")
        variants[tag] = parse_engine_options(pairs)
    return variants


def parse_engine_options(pairs) -> dict:
    """["attention=triton", "attention_block_n=128"] -> {"attention": "triton", "attention_block_n": 128}: Python
    literals where a value is one, else the text; a pair without "=" is refused by name."""
    return _parse_pairs(pairs, "engine option", "attention=triton", text_ok=True)


_TURN = None  # --timing_turn's TimingTurn (main)
_WARNED_PARTIAL: set = set()  # (prompts, batch) already warned about a partial last static batch


def occupied_rounds(logged: list[int], output: list[int]) -> int:
    """The rounds a prompt's row decoded in: its logged rounds (accepted drafts each, `engine.rounds`), plus a last
    round with room for no draft, which the engine leaves out of the log (as of τ) and which emitted one token. The
    output's first token comes from the prefill, each logged round emitted a + 1."""
    return len(logged) + (len(output) - 1 - sum(a + 1 for a in logged))


def run_engine(engine, prompts, max_new, batch, eos, temperature=0.0, lookup=None, skip_drafter=True, tree=None,
               tree_nodes=None, continuous=False):
    """One engine per (target, drafter) serves every dataset and batch size of a run, so a shape is captured and
    compiled once, not once per dataset (and torch.compile stays far below its recompile limit). `skip_drafter`:
    the engine's `lookup_skips_drafter` for this row (False: the drafter runs in every round, looked up or not).
    continuous=True: all prompts in one call through `batch` rows refilled as they finish (`batch_size`), the way a
    server keeps its batch full; otherwise static batches of `batch` prompts, each lasting as long as its slowest
    row."""
    drafter = engine.drafter
    engine.lookup_skips_drafter = skip_drafter
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    kw = dict(max_new_tokens=max_new, eos_token_id=eos, do_sample=temperature > 0, temperature=temperature or 1.0,
              prompt_lookup_num_tokens=lookup)
    if continuous:
        chunks, kw["batch_size"] = [prompts], batch  # the warm-up below then runs the whole queue once
    if tree is not None:
        kw.update(tree=tree, tree_nodes=tree_nodes)
    from hf_carryover.engine.refill import width_bucket

    def warm_up():  # capture and compile outside the timed loop: per batch shape, and per prompt-width bucket
        seen, calls = set(), 0
        for c in chunks:  # (a captured row prefill graph each, `refill.py`)
            new = {(len(c), width_bucket(len(p), engine.max_len)) for p in c} - seen
            if new:
                engine.generate(c, **kw)
                seen |= new
                calls += 1
        return calls

    clock = _compile_clock()
    warm_calls, warm_s = _timed(warm_up)
    # where the row's untimed cost went: the warm-up calls' wall time (compiles, captures and their decoding), their
    # compile phases, and the engine's build where this row is its first
    warmup = {"warmup_s": round(warm_s, 2), "warmup_calls": warm_calls}
    if getattr(engine, "build_s", None) is not None:  # make_engine's build, on the engine's first row only
        warmup["engine_build_s"], engine.build_s = round(engine.build_s, 2), None
    if engine.compile:
        after = _compile_clock()
        warmup["compile_phases_s"], clock = _compile_split(clock, after), after
    engine.timing = dict.fromkeys(engine.timing, 0)  # the profile covers the timed calls only
    if _TURN is not None:  # --timing_turn: warmed up; time when the other processes have and this slot's turn comes
        _TURN.begin()
    n_tok, secs, acc, modes, looked, skipped, launched, on_kernel = 0, 0.0, [], [], 0, 0, 0, 0
    prompt_rounds, prompt_tokens = [], []  # per prompt, in order: what `examples/batch_fill.py` batches anew
    for i, chunk in enumerate(chunks):
        out, dt = _timed(lambda: engine.generate(chunk, seed=i, **kw))
        n_tok += sum(len(o) for o in out)
        secs += dt
        acc += [a for rows in engine.rounds for a in rows]
        launched += engine.last_launched
        on_kernel += engine.kernel_steps or 0  # (attention_one_row_keys: plain steps on the kernel)
        prompt_rounds += [occupied_rounds(rows, o) for rows, o in zip(engine.rounds, out)]
        prompt_tokens += [len(o) for o in out]
        looked += sum(map(sum, engine.lookup_rounds))
        skipped += engine.skipped_drafts
        modes.append(engine.last_mode)
    res = {"tokens": n_tok, "seconds": secs, "tok_per_s": n_tok / secs,
           "tau": (sum(acc) + len(acc)) / len(acc) if (drafter is not None or lookup) and acc else None,
           "mode": " | ".join(dict.fromkeys(modes)), **warmup}  # one mode unless some shapes could not be captured
    late = _compile_split(clock, _compile_clock()) if engine.compile else None
    if late:  # compiled inside the timed calls (a shape the warm-up missed): their time holds it
        res["timed_compile_phases_s"] = late
    if lookup:
        res.update(lookup=lookup, lookup_round_share=looked / max(len(acc), 1), drafter_skipped_rounds=skipped)
    if launched:
        # rounds the batch ran (plain decoding: steps), against the rows' own rounds: at batch b a static batch lasts
        # as long as its slowest row, so `batch_fill` = row rounds / (b x launched rounds) says how much of each round
        # decoded rows still running, and ms_per_launched_round what one round of the whole batch cost (the calls'
        # prefills and run-ahead rounds included). Together with τ they split a batch-b ratio over AR into round
        # cost, τ and idle rows.
        rows = sum(prompt_rounds)  # every row's rounds (plain decoding: its steps)
        res.update(launched_rounds=launched, row_rounds=rows, batch_fill=rows / (batch * launched),
                   ms_per_launched_round=1000.0 * secs / launched, prompt_rounds=prompt_rounds,
                   prompt_tokens=prompt_tokens)
    if not continuous and len(prompts) % batch:
        # a last batch of fewer rows costs AR nearly a full batch's steps for fewer tokens, while speculative rows
        # shorten it as at batch 1: the ratio over AR reads high (12-02c's 10 prompts at batch 8: 2.02x against
        # 1.27x on two full batches, examples/results/h200-2026-12-02e)
        res["partial_batch_rows"] = len(prompts) % batch
        if (len(prompts), batch) not in _WARNED_PARTIAL:
            _WARNED_PARTIAL.add((len(prompts), batch))
            print(f"warning: {len(prompts)} prompts in static batches of {batch} leave a last batch of "
                  f"{len(prompts) % batch} rows, which flatters speculative rows against AR; use a multiple of "
                  f"{batch} (--limit)", file=sys.stderr)
    res["attention"] = engine.attention  # the target's attention in the engine's rounds ("auto" resolved)
    if engine.attention == "triton":  # the kernel's settings, min_rows included ("auto": one-row calls on SDPA)
        res["attention_settings"] = dict(engine.attention_settings)
        res["attention_key_end"] = engine.attention_key_end
    one_row_keys = engine.one_row_keys(batch)
    if one_row_keys:  # one-row steps on the kernel up to that many keys in use, then on SDPA
        res.update(attention_one_row_keys=one_row_keys, one_row_kernel_steps=on_kernel)
    if engine.compile and engine.compile_options:  # --inductor's options with the row's own over them
        res["compile_options"] = dict(engine.compile_options)
    settings = getattr(engine, "options", None)
    if settings:  # --engine_options and the drafter spec's engine keys (make_engine): the setting a row timed
        res["engine_options"] = dict(settings)
    prefills = list(engine._prefills.values())
    if prefills and engine.compile:  # rows prefilled through the compiled row prefill: over a dynamic width, or per
        res["dynamic_prefill"] = all(p.dynamic_width for p in prefills)  # width (after a failed dynamic compile)
    res["rope_tabled"] = list(engine.rope_tabled)  # the models whose RoPE the row read from tables
    if engine.rope_untabled:  # those "auto" left to compute it, and why
        res["rope_untabled"] = dict(engine.rope_untabled)
    # what the frozen-weight pass did in this row's engine so far, the gated MLPs and the top-R path (until 12-02f
    # fused_gemms summed all engines of the call, until 2026-12-05 it read 0 where every graph came from inductor's
    # caches)
    res.update(engine.kernel_record())
    if engine.profile and engine.timing["rounds"]:
        n = engine.timing["rounds"]
        res["per_round_s"] = {p: engine.timing[p] / n for p in ("draft", "verify", "other")}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="reference", help="'reference' (SmolLM2-135M-Instruct), a model folder, or "
                   "random weights for timings: 'smollm2-random' (the reference's shapes, with --ignore_eos), "
                   "'qwen3-4b-random' (a projection)")
    p.add_argument("--drafters", nargs="*", default=[], metavar="NAME=FOLDER[,KEY=VALUE...]",
                   help="drafters to time (evaluate_tau's specs): KEY a config field, an engine key (ENGINE_KEYS) or "
                   "inductor.KEY, an inductor option of that drafter's engine over --inductor's (needs --compile)")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1])
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; >0: sampling at this temperature "
                   "(engine rows: sampled rounds are captured as CUDA graphs and compiled like greedy ones)")
    p.add_argument("--methods", nargs="*", help="subset of method names (default: all)")
    p.add_argument("--profile", action="store_true", help="engine: time draft/verify/other per round (adds syncs) "
                   "and check the latency model τ·T_ar/(T_draft+T_verify) against the measured speedup")
    p.add_argument("--cuda_graphs", action="store_true", help="engine rows: replay each greedy round as a CUDA "
                   "graph (captured before timing); with --profile the engine stays eager to time its phases")
    p.add_argument("--compile", action="store_true", help="engine rows: torch.compile each round (with --cuda_graphs, "
                   "the compiled round is captured); the mode column says 'cuda_graph+compile'. hf_spec_tree rows: "
                   "drafter.use_draft_tree(..., compile=True)")
    p.add_argument("--random_drafter", action="store_true", help="add a random DFlash drafter built from the target "
                   "(timing projections, e.g. with --target qwen3-4b-random)")
    p.add_argument("--warmup", choices=["longest", "all"], default="longest",
                   help="HF rows' untimed warm-up: the longest prompt, or a whole untimed pass over the prompts (on "
                        "the H200 the first hf_spec row of a run read slower than the second at equal τ; a full pass "
                        "tells a warm-up effect from a real difference)")
    p.add_argument("--lookup", type=int, help="also run context-lookup rows of up to N tokens: hf_spec_lookup "
                   "(generate() with the drafter and prompt_lookup_num_tokens=N), engine_lookup (the engine with the "
                   "drafter) and engine_pld (the engine without a drafter)")
    p.add_argument("--passes", type=int, default=1, help="timed passes per method over the same prompts, in "
                   "alternating order (forward, reverse, ...); rows report the median pass and list all of them")
    p.add_argument("--tree", nargs="+", help="engine_tree rows: a draft-tree JSON (`paths`: rank paths, e.g. from "
                   "examples/calibrate_tree.py) for every DFlash drafter, or NAME=FILE per drafter (others get none)")
    p.add_argument("--tree_nodes", nargs="+", default=["all"], help="engine_tree rows: nodes verified per round, each "
                   "value a row ('all': the whole tree, the same for every round)")
    p.add_argument("--batching", nargs="+", choices=["static", "continuous"], default=["static"],
                   help="engine rows at batch size b: static batches of b prompts (each lasting as long as its slowest "
                   "row), and/or continuous batching: all prompts of a dataset through b rows refilled as rows finish "
                   "(method names end in @<b>c); both share the engine's compiled and captured shapes")
    p.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                   help="with --compile: inductor options for the engine's compiled rounds, e.g. freezing=True (the "
                   "weights compiled in as constants, so q/k/v and gate/up merge into one GEMM each); recorded in "
                   "every engine row as compile_options")
    p.add_argument("--engine_options", nargs="+", default=[], metavar="KEY=VALUE",
                   help="SpeculativeEngine arguments for every engine row, AR included (e.g. attention=triton "
                   "attention_block_n=128); a drafter spec's own engine keys win; recorded as engine_options")
    p.add_argument("--ar_variant", nargs="+", action="append", default=[], metavar=("TAG", "KEY=VALUE"),
                   help="an engine AR row with its own engine options beside engine_ar, named engine_ar:TAG@b, e.g. "
                   "--ar_variant kernel attention_min_rows=1 (plain steps on the Triton kernel; repeatable); "
                   "compile_options={...} adds inductor options over --inductor's for that row")
    p.add_argument("--ignore_eos", action="store_true", help="engine rows decode max_new_tokens per prompt, past any "
                   "EOS, so the caches fill to a known length (e.g. one-row attention timed at 2000 keys in use); "
                   "only engine rows can (select them with --methods); recorded as ignore_eos")
    p.add_argument("--timing_turn", metavar="DIR:I:N", help="slot I of N benchmark processes sharing one GPU and "
                   "directory DIR: this process's one row warms up (compiles) beside the others, then waits until all "
                   "have warmed up and times in slot order, alone (examples/timing_turns.py); recorded as timing_turn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.passes < 1:
        p.error(f"--passes must be at least 1, not {args.passes}")
    global _TURN
    _TURN = None  # (main() may run again in one process: the tests' in-process runs)
    if args.timing_turn:
        from timing_turns import TimingTurn

        try:
            _TURN = TimingTurn(args.timing_turn)
        except ValueError as e:
            p.error(str(e))
        atexit.register(_TURN.end)  # also when this process fails: the group goes on without its row
    compile_options = parse_inductor_options(args.inductor)
    engine_options = parse_engine_options(args.engine_options)
    ar_variants = parse_ar_variants(args.ar_variant)
    if compile_options and not args.compile:
        p.error("--inductor sets options of the compiled rounds: it needs --compile")
    own_inductor = with_inductor_keys(args.drafters)
    if own_inductor and not args.compile:
        p.error(f"{own_inductor}: {INDUCTOR_PREFIX}KEY=VALUE sets options of the compiled rounds: it needs --compile")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = load_target(args.target, dtype, device)
    eos = None if args.ignore_eos else target.generation_config.eos_token_id
    drafters = {}
    if args.random_drafter:
        from hf_carryover import Drafter

        drafters["random-dflash"] = Drafter.from_target(target, drafter_type="dflash", carryover=True,
                                                        mask_token_id=0).to(device, dtype).eval()
    drafters.update(load_drafters(args.drafters, dtype, device))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = open(out_dir / "bench_raw.jsonl", "a")
    rows = []

    prompt_sets = {d: [r["input_ids"] for r in load_prompts(args.prompts_dir, d, args.limit)] for d in args.datasets}
    longest = max(len(p) for ps in prompt_sets.values() for p in ps)
    engines = {}
    trees = {}  # drafter name -> TreeSpec
    if args.tree:
        from hf_carryover.engine.tree import TreeSpec

        for spec in args.tree:
            name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
            for n in ([name] if name else list(drafters)):
                trees[n] = TreeSpec.load(path)
    tree_sizes = [None if n == "all" else int(n) for n in args.tree_nodes]

    def engine_for(name, d, tree=False, options=None):  # built on first use, shared by every dataset and batch size
        # tree rows get an engine of their own: their caches need room for the largest tree asked for ("all": the
        # whole tree; a round writes its verified rows), and on the H200 linear rounds read 8-18 % slower with
        # those longer caches (examples/results/h200-2026-12-01f), so the linear rows keep the length they need
        key = (name, tree)
        if key not in engines:
            k = d.config.block_size if d is not None else (args.lookup or 0) + 1
            extra = max(m or trees[name].num_nodes for m in tree_sizes) if tree else 0
            engines[key] = make_engine(target, d, longest + args.max_new_tokens + 2 * k + extra, args.profile,
                                       args.cuda_graphs, args.compile, compile_options,
                                       {**engine_options, **(options or {})})
        return engines[key]

    T = args.temperature
    hf = lambda pr, **kw: run_hf(target, pr, args.max_new_tokens, temperature=T, **kw)  # noqa: E731
    def eng(name, d, pr, b, lookup=None, skip=True, options=None, **tree_kw):  # one engine per drafter (and one for
        # its tree rows); `options`: an --ar_variant's own engine options
        return run_engine(engine_for(name, d, "tree" in tree_kw, options), pr, args.max_new_tokens, b[0], eos, T,
                          lookup, skip, continuous=b[1], **tree_kw)

    # engine rows per (batch size, continuous?); continuous rows are named "@8c" (their own AR row is engine_ar@8c:
    # results_tables' "own AR" pairs them)
    batches = [(b, mode == "continuous") for mode in args.batching for b in args.batch_sizes]
    at = lambda b: f"@{b[0]}{'c' if b[1] else ''}"  # noqa: E731

    # fastest first: when a time box cuts the run, the engine rows and the HF baselines exist already
    methods = [(f"engine_ar{at(b)}", lambda pr, b=b: eng(None, None, pr, b)) for b in batches]
    methods += [(f"engine_ar:{tag}{at(b)}", lambda pr, tag=tag, o=o, b=b: eng(f"ar:{tag}", None, pr, b, options=o))
                for tag, o in ar_variants.items() for b in batches]
    methods += [(f"engine:{n}{at(b)}", lambda pr, n=n, d=d, b=b: eng(n, d, pr, b))
                for n, d in drafters.items() for b in batches]
    if args.lookup:
        methods += [(f"engine_lookup:{n}{at(b)}", lambda pr, n=n, d=d, b=b: eng(n, d, pr, b, args.lookup))
                    for n, d in drafters.items() for b in batches]
        methods += [(f"engine_lookup_always_draft:{n}{at(b)}",
                     lambda pr, n=n, d=d, b=b: eng(n, d, pr, b, args.lookup, skip=False))
                    for n, d in drafters.items() for b in batches]
        methods += [(f"engine_pld{at(b)}", lambda pr, b=b: eng(None, None, pr, b, args.lookup)) for b in batches]
    if trees:
        tree_drafters = {n: d for n, d in drafters.items() if d.config.drafter_type == "dflash" and n in trees}
        for lk in (None, args.lookup) if args.lookup else (None,):
            kind = "engine_tree_lookup" if lk else "engine_tree"
            methods += [(f"{kind}{'all' if m is None else m}:{n}{at(b)}",
                         lambda pr, n=n, d=d, b=b, m=m, lk=lk: eng(n, d, pr, b, lk, tree=trees[n], tree_nodes=m))
                        for n, d in tree_drafters.items() for m in tree_sizes for b in batches]
    methods += [("hf_eager", lambda pr: hf(pr))]
    methods += [(f"hf_spec:{n}", lambda pr, d=d: hf(pr, assistant_model=d)) for n, d in drafters.items()]
    if args.lookup:  # our generate() path with context lookup (copies loops from the context)
        methods += [(f"hf_spec_lookup:{n}",
                     lambda pr, d=d: hf(pr, assistant_model=d, prompt_lookup_num_tokens=args.lookup))
                    for n, d in drafters.items()]
    if trees:  # generate() verifying draft trees (drafter.use_draft_tree), on the engine, one prompt at a time
        for lk in (None, args.lookup) if args.lookup else (None,):
            kind = "hf_spec_tree_lookup" if lk else "hf_spec_tree"
            methods += [(f"{kind}{'all' if m is None else m}:{n}",
                         lambda pr, d=d, n=n, m=m, lk=lk: hf(pr, assistant_model=d, tree=(trees[n], m, args.compile),
                                                             **({"prompt_lookup_num_tokens": lk} if lk else {})))
                        for n, d in tree_drafters.items() for m in tree_sizes]
    if device == "cuda":  # the same rows with the drafter's part eager on dynamic shapes (before static rounds)
        methods += [(f"hf_spec_dynamic:{n}", lambda pr, d=d: hf(pr, assistant_model=d, static_rounds=False))
                    for n, d in drafters.items()]
        if args.lookup:
            methods += [(f"hf_spec_lookup_dynamic:{n}",
                         lambda pr, d=d: hf(pr, assistant_model=d, static_rounds=False,
                                            prompt_lookup_num_tokens=args.lookup))
                        for n, d in drafters.items()]
    methods += [(f"hf_own_dflash:{n}", lambda pr, d=d: hf(pr, assistant_model=d, speculation_type="dflash"))
                for n, d in drafters.items()
                if d.config.drafter_type == "dflash" and d.config.mask_token_id is not None]
    methods += [("hf_prompt_lookup", lambda pr: hf(pr, prompt_lookup_num_tokens=10))]
    if device == "cuda":
        methods.append(("hf_static_compile", lambda pr: hf(pr, cache_implementation="static")))
    if args.methods:
        def names(row):  # "engine_tree_lookup63:d@1" -> its method, and for tree rows the kind without the size
            base = row.split("@")[0].split(":")[0]
            return {row, base, re.sub(r"(\d+|all)$", "", base) if "_tree" in base else base}

        methods = [m for m in methods if names(m[0]) & set(args.methods)]
    if _TURN is not None and (len(methods) * len(args.datasets) != 1 or args.passes != 1):
        # a second row would compile after this one's turn, beside the timed rows of the others
        p.error(f"--timing_turn times one row per process, in one pass; this one has {len(args.datasets)} "
                f"dataset(s) x {len(methods)} method(s) ({', '.join(n for n, _ in methods)}) and --passes "
                f"{args.passes}: give each row a process of its own")
    if args.ignore_eos and any(not n.startswith("engine") for n, _ in methods):
        # generate() would need a logits processor to go past EOS, which changes what its rows time
        p.error("--ignore_eos applies to engine rows only; select them with --methods (not: "
                f"{', '.join(n for n, _ in methods if not n.startswith('engine'))})")

    def measure(name, fn, dataset, prompts, **extra):
        # the host's 1-minute load average before and after: a batch-1 engine is launch-bound, so a busy host (a
        # compiling job on another GPU of the machine) slows it; the load beside each row lets a reader tell
        load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        res = {"method": name, "dataset": dataset, "prompts": len(prompts), "temperature": T, **fn(prompts), **extra}
        if args.ignore_eos:
            res["ignore_eos"] = True
        if load0 is not None:
            res["host_load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        return res

    def record(res):
        raw.write(json.dumps(res) + "\n")
        raw.flush()
        write_summary()
        print(f"{res['dataset']:10s} {res['method']:28s} {res['tok_per_s']:8.1f} tok/s  τ {res['tau'] or '-'}"
              f"{'  ' + res['mode'] if 'mode' in res else ''}{'  pass %d' % res['pass'] if 'pass' in res else ''}"
              f"{_row_cost(res)}", flush=True)

    def write_summary():
        """bench.json and bench.md from the rows so far (called after every row, so a cut run keeps its summary)."""
        from hf_carryover.engine.engine import predicted_speedup

        for r in rows:  # latency model: predicted from per-round times vs measured, against engine AR at batch 1
            ar = next((x for x in rows if x["method"] == "engine_ar@1" and x["dataset"] == r["dataset"]), None)
            if r.get("tau") and "per_round_s" in r and ar and "per_round_s" in ar and r["method"].endswith("@1"):
                t = r["per_round_s"]
                t_ar = ar["per_round_s"]["verify"] + ar["per_round_s"]["other"]
                r["predicted_speedup_vs_engine_ar"] = predicted_speedup(r["tau"], t["draft"], t["verify"] + t["other"],
                                                                        t_ar)
        for r in rows:  # speedups against each AR baseline of the same dataset
            for base in ("hf_eager", "engine_ar@1"):
                ref = next((x for x in rows if x["method"] == base and x["dataset"] == r["dataset"]), None)
                if ref:
                    r[f"speedup_vs_{base}"] = r["tok_per_s"] / ref["tok_per_s"]
        not_covered = {"vllm": "examples/bench_vllm.py (needs the vLLM bundle, DESIGN.md §12) appends to "
                               "bench_raw.jsonl"}
        if not args.cuda_graphs:
            not_covered["cuda_graphs"] = "engine rows ran eagerly; --cuda_graphs replays greedy rounds as CUDA graphs"
        summary = {"command": " ".join(["python"] + sys.argv), "environment": environment(),
                   "max_new_tokens": args.max_new_tokens, "temperature": T, "warmup": args.warmup,
                   "cuda_graphs": args.cuda_graphs, "compile": args.compile,
                   "compile_options": compile_options, "passes": args.passes,
                   "batching": args.batching, "results": rows,
                   "not_covered": not_covered}
        (out_dir / "bench.json").write_text(json.dumps(summary, indent=2))
        lines = ["| dataset | method | tok/s | τ | × hf_eager | × engine_ar@1 | mode |",
                 "|---|---|---|---|---|---|---|"]

        def ratio(r, base):  # "–" where the run has no such baseline row (not a 0.00 that reads as a measurement)
            x = r.get(f"speedup_vs_{base}")
            return f"{x:.2f}" if x is not None else "–"

        for r in rows:
            tau = f"{r['tau']:.2f}" if r["tau"] else "–"
            lines.append(f"| {r['dataset']} | {r['method']} | {r['tok_per_s']:.1f} | {tau} | "
                         f"{ratio(r, 'hf_eager')} | {ratio(r, 'engine_ar@1')} | {r.get('mode', '–')} |")
        (out_dir / "bench.md").write_text("\n".join(lines) + "\n")
        return lines

    def warm(name, fn, prompts):
        # warm-up, excluded, on the longest prompt: generate()'s static cache keeps the largest size it has seen,
        # so hf_static_compile then compiles once instead of once per longer prompt inside the timed loop (the
        # engine rows warm up per batch shape inside run_engine)
        if not name.startswith("engine"):
            fn(prompts if args.warmup == "all" else [max(prompts, key=len)])

    for dataset in args.datasets:
        prompts = prompt_sets[dataset]
        if args.passes == 1:  # each method warms up and is timed in turn: rows land as they finish
            for name, fn in methods:
                t0 = time.perf_counter()
                warm(name, fn, prompts)
                if _TURN is not None and not name.startswith("engine"):  # (engine rows wait inside run_engine,
                    _TURN.begin()  # after their own warm-up)
                res = measure(name, fn, dataset, prompts)
                if _TURN is not None:  # the timed part is over (engine rows included): the next slot may time
                    _TURN.end()
                    res["timing_turn"] = dict(_TURN.info)
                # the row's whole cost, with the engine's build, compile and graph capture on its first use: what a
                # time-boxed job spends per row (the 2026-11-30g jobs finished only 2-6 rows in 250-270 s)
                res["row_wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(res)
                record(res)
            continue
        # several passes: all methods warm up first, then each pass times every method, in reverse order on odd
        # passes, so that a drift or an order effect (seen on the H200: one drafter's row 1.5x slower in one call
        # than in the next, at equal τ) shows as a spread between passes instead of passing for a difference
        # between methods. Every pass is recorded ("pass": i); the row is the median pass, with all of them listed.
        for name, fn in methods:
            warm(name, fn, prompts)
        passes = {name: [] for name, _ in methods}
        for i in range(args.passes):
            for name, fn in (methods if i % 2 == 0 else methods[::-1]):
                res = measure(name, fn, dataset, prompts, **{"pass": i})
                passes[name].append(res)
                record(res)
        for name, _ in methods:
            runs = sorted(passes[name], key=lambda r: r["tok_per_s"])
            res = {k: v for k, v in runs[(len(runs) - 1) // 2].items() if k != "pass"}  # the median (lower middle)
            res["tok_per_s_passes"] = [r["tok_per_s"] for r in passes[name]]
            rows.append(res)
            record(res)

    print("\n".join(write_summary()))


if __name__ == "__main__":
    main()
