"""What a round cost in stored benchmark rows, and how much of a speed ratio between two rows is round cost and how much
τ: reads `bench_raw.jsonl` files (`examples/benchmark.py`), writes a Markdown table.

Why: two speculative rows that decode different bf16 texts (another kernel setting, other weights, another machine
start) differ in τ as well as in what a round costs, and only the second is the code's doing. A row's time per
verification is seconds / (tokens / τ); for a plain decoding row (no τ) it is seconds / tokens, a step. Then, for a pair
A:B of rows of one dataset, tok/s(A) / tok/s(B) = (τ_A / τ_B) × (round_B / round_A) exactly, and the table gives both
factors. At batch b > 1 the figure is per row and round (the rows of a round share its time), so compare rows of one
batch size. Rows that record their launched rounds (`benchmark.py` since 12-04g) are split further: tok/s = (tokens /
row rounds) x batch_fill x b / (ms a launched round), exactly, so a pair of batch-b rows also gets a fill factor (rows
idle in a static batch while its slowest row decodes) and a factor of what one round of the whole batch cost.

    python examples/round_cost.py examples/results/h200-2026-12-04d/engine_call4/bench_raw.jsonl \
        --pair "engine_tree_lookup31:new@1:engine_tree_lookup31:scan@1"
    python examples/round_cost.py pdl/bench_raw.jsonl default/bench_raw.jsonl \
        --pair "0/engine_tree_lookup31:new@1:1/engine_tree_lookup31:new@1"   # one method, two calls' files

With --prompts_dir (the prompt files the rows decoded, `assets/prompts`), plain decoding rows also get the keys their
steps attended to: a prompt of p tokens whose output has n tokens took n - 1 steps (its first token came from the
prefill), step i attending to p + i keys. Why: one-row attention on the Triton kernel costs more per key than SDPA
(`hf_carryover/engine/one_row.py`), so a plain row's speed depends on how long its contexts were.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # evaluate_tau (--prompts_dir)


def load_rows(paths):
    """Every row of the files, each with `file` (its index in `paths`) and `ms_per_verification`; a row that failed or
    holds no tokens is skipped. Rows of several passes stay separate (their `pass` field)."""
    rows = []
    for i, path in enumerate(paths):
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("error") or not r.get("tokens") or not r.get("seconds"):
                continue
            verifications = r["tokens"] / r["tau"] if r.get("tau") else r["tokens"]
            rows.append({**r, "file": i, "verifications": verifications,
                         "ms_per_verification": 1000.0 * r["seconds"] / verifications})
    return rows


def keys_in_use(prompt_lengths: list[int], output_lengths: list[int]) -> tuple[float, int]:
    """(mean over all steps, max) of the keys a plain decoding step attended to, for prompts of `prompt_lengths`
    tokens that produced `output_lengths` tokens each (in the same order): step i of a prompt of p tokens, i = 1 ..
    n - 1, attends to p + i keys."""
    steps = sum(n - 1 for n in output_lengths)
    if len(prompt_lengths) != len(output_lengths) or steps < 1:
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(output_lengths)} outputs ({steps} steps)")
    total = sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompt_lengths, output_lengths))
    return total / steps, max(p + n - 1 for p, n in zip(prompt_lengths, output_lengths))


def keys_table(rows, prompts_dir) -> str:
    """Keys in use of the plain decoding rows that record each prompt's output length (`prompt_tokens`), against the
    first prompts of their dataset in `prompts_dir` (the prompts `benchmark.py --limit` took, in order)."""
    from evaluate_tau import load_prompts

    lines = ["| file | dataset | method | steps' mean keys in use | max |", "|---|---|---|---|---|"]
    for r in rows:
        if r.get("tau") or not isinstance(r.get("prompt_tokens"), list):
            continue
        outputs = r["prompt_tokens"]
        lengths = [len(x["input_ids"]) for x in load_prompts(prompts_dir, r["dataset"], len(outputs))]
        mean, top = keys_in_use(lengths, outputs)
        lines.append(f"| {r['file']} | {r['dataset']} | {r['method']} | {mean:.0f} | {top} |")
    return "\n" + "\n".join(lines) + "\n"


def split_ratio(a: dict, b: dict) -> dict:
    """tok/s(a) / tok/s(b) as (τ factor) × (round factor); a plain decoding row counts τ = 1. Where both rows record
    launched rounds, also as (tokens a row round factor) × (fill factor) × (launched-round factor) (equal batch
    sizes: the batch size cancels)."""
    tau_a, tau_b = a.get("tau") or 1.0, b.get("tau") or 1.0
    split = {"speed": a["tok_per_s"] / b["tok_per_s"], "tau": tau_a / tau_b,
             "round": b["ms_per_verification"] / a["ms_per_verification"]}
    if a.get("launched_rounds") and b.get("launched_rounds"):
        split.update(row_tokens=(a["tokens"] / a["row_rounds"]) / (b["tokens"] / b["row_rounds"]),
                     fill=a["batch_fill"] / b["batch_fill"],
                     launched=b["ms_per_launched_round"] / a["ms_per_launched_round"])
    return split


def table(rows, pairs=()) -> str:
    lines = ["| file | dataset | method | pass | tokens | τ | verifications | ms each | tok/s | batch fill | "
             "ms a launched round |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['tau']:.3f}" if r.get("tau") else "–"
        fill, launched = ((f"{r['batch_fill']:.3f}", f"{r['ms_per_launched_round']:.4f}") if r.get("launched_rounds")
                          else ("–", "–"))
        lines.append(f"| {r['file']} | {r['dataset']} | {r['method']} | {r.get('pass', '–')} | {r['tokens']} | "
                     f"{tau} | {r['verifications']:.1f} | {r['ms_per_verification']:.4f} | {r['tok_per_s']:.1f} | "
                     f"{fill} | {launched} |")
    if pairs:
        lines += ["", "| file | dataset | A | B | tok/s A / B | = τ factor | × round factor | = tokens a row round "
                  "factor | × fill factor | × launched-round factor |", "|---|---|---|---|---|---|---|---|---|---|"]
        for a_name, b_name in pairs:
            (fa, a_method), (fb, b_method) = file_of(a_name), file_of(b_name)
            for ds in dict.fromkeys(r["dataset"] for r in rows):
                # rows of one file (and pass) against each other, or of the two files the pair names
                keys = ([(f, p, f, p) for f, p in sorted({(r["file"], r.get("pass")) for r in rows},
                                                         key=lambda k: (k[0], k[1] or 0))] if fa is None else
                        [(fa, p, fb, p) for p in dict.fromkeys(r.get("pass") for r in rows)])
                for ka, pa, kb, pb in keys:
                    a = next((r for r in rows if (r["file"], r.get("pass")) == (ka, pa) and r["dataset"] == ds
                              and r["method"] == a_method), None)
                    b = next((r for r in rows if (r["file"], r.get("pass")) == (kb, pb) and r["dataset"] == ds
                              and r["method"] == b_method), None)
                    if a and b:
                        s = split_ratio(a, b)
                        more = (" | ".join(f"{s[k]:.3f}" for k in ("row_tokens", "fill", "launched"))
                                if "fill" in s else "– | – | –")
                        where = ka if fa is None else f"{ka}:{kb}"
                        lines.append(f"| {where} | {ds} | {a_name} | {b_name} | {s['speed']:.3f} | {s['tau']:.3f} | "
                                     f"{s['round']:.3f} | {more} |")
    return "\n".join(lines) + "\n"


def emit(text: str, out=None) -> str:
    """Print a Markdown table and, with `out` (a script's --out), write it there too; returns it."""
    sys.stdout.write(text)
    if out:
        Path(out).write_text(text)
    return text


def file_of(name: str):
    """"N/METHOD" -> (N, METHOD): the row of file N (the N-th raw file given, from 0); "METHOD" -> (None, METHOD)."""
    head, sep, rest = name.partition("/")
    return (int(head), rest) if sep and head.isdigit() else (None, name)


def parse_pair(text: str):
    """"A:B" with method names that themselves hold ':' ("engine_tree_lookup31:new@1") -> (A, B): the split is at the
    ':' after the first '@<batch>'. Both sides may name their file ("1/engine_ar@1:0/engine_ar@1"): why, rows that
    differ in a flag of the whole benchmark call (--inductor) come from two calls, hence two files, under one name."""
    at = text.find("@")
    cut = text.find(":", at) if at >= 0 else text.find(":")
    if at < 0 or cut < 0:
        raise ValueError(f"--pair {text!r}: 'METHOD@B:METHOD@B', e.g. engine_tree_lookup31:new@1:engine_ar@1")
    a, b = text[:cut], text[cut + 1:]
    if (file_of(a)[0] is None) != (file_of(b)[0] is None):
        raise ValueError(f"--pair {text!r}: name the file of both sides (N/METHOD@B) or of neither")
    return a, b


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", nargs="+", help="bench_raw.jsonl files")
    p.add_argument("--pair", action="append", default=[], help="A:B, two methods to split the speed ratio of, per "
                   "dataset, file and pass (rows of one file); N/METHOD@B:M/METHOD@B pairs file N's row with file M's")
    p.add_argument("--prompts_dir", help="the prompt files the rows decoded (assets/prompts): plain decoding rows "
                   "also get their steps' keys in use")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    try:
        pairs = [parse_pair(x) for x in args.pair]
    except ValueError as e:
        p.error(str(e))
    for pair in pairs:  # a file index past the files given would pair nothing, silently
        if any((f := file_of(n)[0]) is not None and f >= len(args.raw) for n in pair):
            p.error(f"--pair {':'.join(pair)}: names a file past the {len(args.raw)} given (numbered from 0)")
    rows = load_rows(args.raw)
    return emit(table(rows, pairs) + (keys_table(rows, args.prompts_dir) if args.prompts_dir else ""), args.out)


if __name__ == "__main__":
    main()
