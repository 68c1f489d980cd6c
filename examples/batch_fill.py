"""How full a batch of b rows stays, from each prompt's own rounds: static batches and continuous batching, any b, no
decoding. Reads the `prompt_rounds` that `examples/benchmark.py` engine rows record (since 12-04g), writes a Markdown
table.

Why: at batch b a speculative row's speed over AR is (tokens a row round) × fill × b / (cost of a round of the batch)
(`examples/round_cost.py`), and the fill depends only on how many rounds each prompt needs: the engine gives a prompt
the same tokens and rounds whichever rows share its batch (tested, `tests/test_engine_continuous.py`). So one batch-1
run gives the fill of every batch size and batching, e.g. of batch 8 over 80 prompts, which a GPU run would pay
minutes of compile and decoding for.

  * static batches: prompts in consecutive groups of b; a batch runs as many rounds as its slowest row;
  * continuous batching (`SpeculativeEngine.generate(prompts, batch_size=b)`): b rows; a row that finishes takes the
    next waiting prompt before the next round (the engine refills between rounds, launching none for it).
fill = (sum of the prompts' rounds) / (b × rounds launched).

With --run_ahead, the engine's default loop (`graphs.run_ahead`: one round always queued ahead of the host's read) is
replayed: a call launches one round after its last row finished, and under continuous batching a refilled row idles
for one round (the refill lands behind the round queued before the host read the flags). Replayed so, the four batch-8
continuous rows of `h100-2026-12-05d` (engine AR and tree 15/23/31 + lookup, 64 MT-Bench prompts, 489-1626 launched
rounds) come out at their measured launched rounds exactly. Without it, the blocking loop (`run_ahead=False`, and
the drafter-skipping variant of linear rounds with lookup, which waits for every round's read).

    python examples/batch_fill.py examples/results/cpu-2026-12-04g/b1_mtbench80/bench_raw.jsonl --batch 8 16 \
        --prompts 16 80 --vs engine_ar@1
    python examples/batch_fill.py examples/results/h100-2026-12-05d/call4/bench_raw.jsonl --batch 8 --run_ahead \
        --prompts 24 32 40 48 56 64 --vs engine_ar@8c
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_cost import emit, load_rows  # noqa: E402


def static_rounds(rounds: list[int], b: int, run_ahead: bool = False) -> int:
    """Rounds launched serving `rounds` (one count per prompt, in order) in static batches of b; with `run_ahead`, one
    more a batch (each batch is a call)."""
    return sum(max(rounds[i : i + b]) + run_ahead for i in range(0, len(rounds), b))


def continuous_rounds(rounds: list[int], b: int, run_ahead: bool = False) -> int:
    """Rounds launched serving the prompts through b rows refilled in order as they finish; with `run_ahead`, a
    refilled row idles one round first, and the call launches one round after the last row finished."""
    ends = [0] * min(b, len(rounds))  # the round after which each row is free
    heapq.heapify(ends)
    last = 0
    for i, r in enumerate(rounds):
        start = heapq.heappop(ends) + (run_ahead and i >= b)  # the row that frees first takes the next prompt
        end = start + r
        last = max(last, end)
        heapq.heappush(ends, end)
    return last + (run_ahead and bool(rounds))


def fill(rounds: list[int], b: int, continuous: bool, run_ahead: bool = False) -> float:
    launched = continuous_rounds(rounds, b, run_ahead) if continuous else static_rounds(rounds, b, run_ahead)
    return sum(rounds) / (b * launched) if launched else 1.0


def load(paths) -> list[dict]:
    """Rows with `prompt_rounds`, each with `file` (its index in `paths`), read as `round_cost.load_rows` reads them
    (failed rows skipped)."""
    return [r for r in load_rows(paths) if r.get("prompt_rounds")]


def measured(r: dict, n: int, b: int, continuous: bool) -> str:
    """The row's own batch fill where it ran as this replay does (all its prompts, b rows, the same batching)."""
    suffix = f"@{b}c" if continuous else f"@{b}"
    whole = n >= len(r["prompt_rounds"])
    return f"{r['batch_fill']:.3f}" if whole and r.get("launched_rounds") and r["method"].endswith(suffix) else "–"


def table(rows, batches, prompts, vs=None, run_ahead=False) -> str:
    lines = ["| file | dataset | method | prompts | b | static fill | continuous fill | measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for n in prompts:
            sub = r["prompt_rounds"][:n]
            for b in batches:
                own = measured(r, n, b, True)
                own = own if own != "–" else measured(r, n, b, False)
                lines.append(f"| {r['file']} | {r['dataset']} | {r['method']} | {len(sub)} | {b} | "
                             f"{fill(sub, b, False, run_ahead):.3f} | {fill(sub, b, True, run_ahead):.3f} | {own} |")
    if vs:
        lines += ["", f"Fill factor against {vs} (same file and dataset; above 1 the batch favours the method):", "",
                  "| file | dataset | method | prompts | b | static | continuous |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            base = next((x for x in rows
                         if x["method"] == vs and (x["file"], x["dataset"]) == (r["file"], r["dataset"])), None)
            if base is None or base is r:
                continue
            for n in prompts:
                a, o = r["prompt_rounds"][:n], base["prompt_rounds"][:n]
                for b in batches:
                    lines.append(f"| {r['file']} | {r['dataset']} | {r['method']} | {len(a)} | {b} | "
                                 f"{fill(a, b, False, run_ahead) / fill(o, b, False, run_ahead):.3f} | "
                                 f"{fill(a, b, True, run_ahead) / fill(o, b, True, run_ahead):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", nargs="+", help="bench_raw.jsonl files with engine rows")
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--prompts", type=int, nargs="+", default=[10 ** 9], help="the first N prompts of each row")
    p.add_argument("--vs", help="a method to divide each row's fill by, e.g. engine_ar@1")
    p.add_argument("--run_ahead", action="store_true", help="replay the engine's run-ahead loop (its default): one "
                   "round more a call, and a refilled row idles one round")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or min(args.prompts) < 1:
        p.error("--batch and --prompts take positive integers")
    rows = load(args.raw)
    if not rows:
        p.error(f"{args.raw}: no engine row records prompt_rounds (benchmark.py rows since 12-04g)")
    return emit(table(rows, args.batch, args.prompts, args.vs, args.run_ahead), args.out)


if __name__ == "__main__":
    main()
