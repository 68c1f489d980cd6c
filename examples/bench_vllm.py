"""vLLM on the same prompts and settings as examples/benchmark.py, rows in the same `bench_raw.jsonl`.

    python examples/bench_vllm.py --target SERVE/target --drafter_export dflash-baseline=SERVE/dflash-baseline \
        --prompts_dir assets/prompts --datasets humaneval mtbench --limit 10 --batch_sizes 1 8 --out R/bench

Why: vLLM is the engine users serve with (DESIGN.md §12). A speedup we report for our engine means little unless
it holds against vLLM on the same GPU, target, prompts, greedy decoding and max_new_tokens, so this script
measures vLLM exactly the way benchmark.py measures our engine and appends to the same file
(`examples/results_tables.py --bench OUT/bench_raw.jsonl` prints both).

Methods, each at every --batch_sizes value b:
  vllm_ar@b              vLLM without speculation
  vllm_dflash:<name>@b   speculative_config {"method": "dflash", "model": <export>, "num_speculative_tokens": k}, the
                         drafter written by `python -m hf_carryover.export` (plain DFlash: the format has no Carryover)
  vllm_ngram_gpu@b       (--ngram N) vLLM's prompt lookup, {"method": "ngram_gpu", "num_speculative_tokens": N} with
                         the n-gram window of our context lookup (4 down to 3 tokens): what a vLLM user gets without
                         a drafter, beside our engine_pld / engine_lookup rows. --ngram_method ngram takes vLLM's CPU
                         matcher instead, which needs numba (the bundle has none)
Inputs: --target is a plain HF folder (`hf_carryover.reference.save_reference_for_serving`: vLLM cannot read the
GGUF); prompts are chat-templated token ids, passed as TokensPrompt dicts (no re-tokenisation, no extra BOS).
Timing: one LLM per method (load, compile and CUDA-graph capture excluded); per (dataset, b) a warm-up generate()
on the first chunk, then wall time of all chunks, each chunk of b prompts submitted in one generate() call, as
engine@b runs them. Prefix caching is off, so the warm-up and earlier runs do not shorten later prefills;
detokenisation is off (our engine returns ids too). generate() returns only when every request is done.
τ: 1 + accepted / drafts from vLLM's spec-decode counters (`LLM.get_metrics()`, which needs
disable_log_stats=False), differenced around the timed calls: tokens per target verification including the
bonus token, as in DESIGN.md §1. `accept_by_pos`: fraction of draft rounds accepting position i.
`same_as_ar`: fraction of prompts whose output equals vllm_ar's at the same b (greedy speculation is lossless;
bf16 batch numerics may still flip a near-tie). A method that fails writes rows with "error" and the run goes on.
Needs vLLM 0.26 (the bundle of `shared/tools/make_vllm_bundle.sh`); VLLM_USE_FLASHINFER_SAMPLER=0 is set here
because the bundle has no flashinfer. vLLM spawns processes, so everything runs under `if __name__ == "__main__"`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tau import environment, load_prompts  # noqa: E402

DRAFTS, ACCEPTED, DRAFT_TOKENS = (f"vllm:spec_decode_num_{n}" for n in ("drafts", "accepted_tokens", "draft_tokens"))
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict:
    """Sum vLLM's spec-decode counters over their label sets (one per engine): {name: int, PER_POS: [int]}."""
    out = {DRAFTS: 0, ACCEPTED: 0, DRAFT_TOKENS: 0, PER_POS: []}
    for m in metrics:
        if m.name in (DRAFTS, ACCEPTED, DRAFT_TOKENS):
            out[m.name] += m.value
        elif m.name == PER_POS:
            acc = out[PER_POS]
            acc += [0] * (len(m.values) - len(acc))
            for i, v in enumerate(m.values):
                acc[i] += v
    return out


def tau_between(before: dict, after: dict) -> dict:
    """τ and acceptance by position from two `spec_counters` snapshots; τ None (with why) if nothing was drafted."""
    drafts = after[DRAFTS] - before[DRAFTS]
    if drafts <= 0:
        return {"tau": None, "tau_note": "vLLM counted no draft rounds"}
    prev = before[PER_POS] + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    return {"tau": 1 + (after[ACCEPTED] - before[ACCEPTED]) / drafts, "tau_from": "vllm spec_decode counters",
            "drafts": drafts, "draft_tokens": after[DRAFT_TOKENS] - before[DRAFT_TOKENS],
            "accept_by_pos": [round((a - b) / drafts, 4) for a, b in zip(after[PER_POS], prev)]}


def snapshot(llm):
    """`spec_counters` now, or the error as a string: a metrics failure must not cost the throughput row."""
    try:
        return spec_counters(llm.get_metrics())
    except Exception as e:  # noqa: BLE001
        return f"LLM.get_metrics() failed: {e!r}"


def measure(llm, prompts, batch: int, params, spec: bool):
    """Warm-up on the first chunk (excluded), then every chunk of `batch` prompts timed. -> (result, outputs)."""
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    gen = lambda chunk: llm.generate([{"prompt_token_ids": p} for p in chunk], params, use_tqdm=False)  # noqa: E731
    gen(chunks[0])
    before = snapshot(llm) if spec else None
    outputs, secs = [], 0.0
    for chunk in chunks:
        t0 = time.perf_counter()
        done = gen(chunk)
        secs += time.perf_counter() - t0
        outputs += [list(r.outputs[0].token_ids) for r in done]
    n_tok = sum(len(o) for o in outputs)
    res = {"tokens": n_tok, "seconds": secs, "tok_per_s": n_tok / secs, "tau": None, "batch": batch}
    if spec:
        after = snapshot(llm)
        bad = next((x for x in (before, after) if isinstance(x, str)), None)
        res.update({"tau": None, "tau_note": bad} if bad else tau_between(before, after))
    return res, outputs


def write_row(raw, row: dict) -> None:
    raw.write(json.dumps(row) + "\n")
    raw.flush()
    tps = f"{row['tok_per_s']:8.1f} tok/s" if row.get("tok_per_s") else "  failed: " + row.get("error", "")[:200]
    print(f"{row['dataset']:10s} {row['method']:32s} {tps}  τ {row.get('tau') or '-'}", flush=True)


def run_method(raw, name: str, build, datasets: dict, batch_sizes, params, spec: bool, ar_outputs: dict,
               extra: dict | None = None):
    """Build one LLM, measure every (dataset, b), free it. A failure becomes an error row; the rest still runs.
    `extra` goes into every row of the method."""
    extra = extra or {}
    llm = None
    try:
        llm = build()
    except Exception as e:  # noqa: BLE001  (any startup failure: write it down, go on with the next method)
        for ds, prompts in datasets.items():
            for b in batch_sizes:
                write_row(raw, {**error_row(f"{name}@{b}", ds, prompts, b, f"startup: {e!r}"), **extra})
        free_gpu()
        return
    try:
        for ds, prompts in datasets.items():
            for b in batch_sizes:
                try:
                    res, outs = measure(llm, prompts, b, params, spec)
                except Exception as e:  # noqa: BLE001
                    write_row(raw, {**error_row(f"{name}@{b}", ds, prompts, b, repr(e)), **extra})
                    continue
                if not spec:
                    ar_outputs[(ds, b)] = outs
                elif (ds, b) in ar_outputs:
                    res["same_as_ar"] = sum(o == a for o, a in zip(outs, ar_outputs[(ds, b)])) / len(outs)
                write_row(raw, {"method": f"{name}@{b}", "dataset": ds, "prompts": len(prompts), **res, **extra})
    finally:
        del llm
        free_gpu()


def error_row(method, dataset, prompts, batch, error):
    return {"method": method, "dataset": dataset, "prompts": len(prompts), "tokens": None, "seconds": None,
            "tok_per_s": None, "tau": None, "batch": batch, "error": error}


def free_gpu():
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001  (best effort: the next LLM reports its own failure if memory is short)
        pass
    import torch

    torch.cuda.empty_cache()  # a no-op where this process never touched CUDA (vLLM's engine runs in a child)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="plain HF folder (save_reference_for_serving)")
    p.add_argument("--drafter_export", nargs="*", default=[], help="[NAME=]DIR of `python -m hf_carryover.export`")
    p.add_argument("--prompts_dir", default="assets/prompts")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--num_speculative_tokens", type=int, default=15, help="k; DFlash block_size 16 proposes 15")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.3, help="a 135M target needs little KV cache")
    p.add_argument("--ngram", type=int, help="also vLLM's n-gram prompt lookup proposing up to N tokens")
    p.add_argument("--ngram_method", default="ngram_gpu", choices=["ngram_gpu", "ngram"])
    p.add_argument("--no_ar", action="store_true", help="skip vllm_ar (e.g. measured already)")
    p.add_argument("--llm_kwargs", default="{}", help="extra LLM(...) kwargs as JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    import vllm
    from vllm import LLM, SamplingParams

    datasets = {d: [r["input_ids"] for r in load_prompts(args.prompts_dir, d, args.limit)] for d in args.datasets}
    k = args.num_speculative_tokens
    longest = max(len(q) for prompts in datasets.values() for q in prompts)
    base = dict(model=args.target, dtype="bfloat16", seed=0, gpu_memory_utilization=args.gpu_memory_utilization,
                max_model_len=longest + args.max_new_tokens + max(k, args.ngram or 0) + 16,
                max_num_seqs=max(args.batch_sizes),
                enable_prefix_caching=False, disable_log_stats=False, **json.loads(args.llm_kwargs))
    greedy = dict(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=False)
    try:
        params = SamplingParams(**greedy, detokenize=False)
    except (TypeError, ValueError):  # a vLLM without the switch: detokenising costs a little, nothing else changes
        params = SamplingParams(**greedy)
    methods = [] if args.no_ar else [("vllm_ar", None)]
    for spec in args.drafter_export:
        name, _, path = spec.rpartition("=")
        cfg = Path(path, "config.json")  # a missing folder fails at vLLM startup, as an error row
        block = json.loads(cfg.read_text()).get("block_size") if cfg.exists() else None
        if block and k != block - 1:  # vLLM builds 1 + k query rows and never checks: an untrained block length
            raise SystemExit(f"--num_speculative_tokens {k} does not fit {path}: its block_size {block} proposes "
                             f"{block - 1} tokens")
        methods.append((f"vllm_dflash:{name or Path(path).name}", path))
    specs = {name: {"method": "dflash", "model": path, "num_speculative_tokens": k} for name, path in methods if path}
    if args.ngram:  # same window as hf_carryover's context lookup: the last 4, then 3, committed tokens
        name = f"vllm_{args.ngram_method}"
        methods.append((name, args.ngram_method))
        specs[name] = {"method": args.ngram_method, "num_speculative_tokens": args.ngram, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 3}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ar_outputs = {}
    with open(out / "bench_raw.jsonl", "a") as raw:
        for name, _ in methods:
            sc = specs.get(name)
            build = lambda sc=sc: LLM(**base, speculative_config=sc)  # noqa: E731
            run_method(raw, name, build, datasets, args.batch_sizes, params, sc is not None, ar_outputs,
                       {"engine": "vllm", **({"num_speculative_tokens": sc["num_speculative_tokens"]} if sc else {})})
    summary = {"command": " ".join(["python"] + sys.argv), "environment": {**environment(), "vllm": vllm.__version__},
               "llm_kwargs": base, "max_new_tokens": args.max_new_tokens,
               "num_speculative_tokens": k, "methods": dict(methods), "speculative_configs": specs}
    (out / "bench_vllm.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
