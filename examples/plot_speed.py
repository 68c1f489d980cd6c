"""Tokens per second of the methods of one or more benchmark runs, side by side, as a PNG.

    python examples/plot_speed.py RUN/vllm_call4/bench_raw.jsonl RUN/engine_call5/bench_raw.jsonl \
        --out examples/results/RUN/speed.png [--methods vllm_ar engine_ar engine_tree_lookup hf_static_compile]

`--methods` takes method kinds (`engine_tree_lookup`: every drafter's and tree size's rows) or method names without
their batch suffix (`engine_tree_lookup31:new`: one drafter's rows, where a run timed several settings).

Reads the rows `examples/benchmark.py` and `examples/bench_vllm.py` append to `bench_raw.jsonl`: with `--passes`, the
summary row of each method (the median pass; the per-pass rows are skipped). A method measured in two files (e.g.
engine AR beside vLLM in one call and beside HF static + compile in the next) is drawn from the first file that has it,
so the figures in the plot are the ones of the file named first; the others are listed on stdout. One panel per batch
size (`@b` in the method name; HF rows are batch 1), a bar group per dataset, each bar labelled with its tok/s and its
ratio to engine AR at the same batch size. The title carries GPU, commit(s) and versions from the `bench.json` beside
each file.
"""

import argparse
import json
import re
from pathlib import Path


def batch_of(method: str) -> int:
    """`engine_tree_lookup31:d@8` -> 8; `engine_ar@8c` (continuous batching) -> 8; HF rows (no suffix) -> 1."""
    m = re.search(r"@(\d+)c?$", method)
    return int(m.group(1)) if m else 1


def ar_of(method: str) -> str:
    """The engine AR row a method's ratio is taken against: the same batch suffix (`engine_tree_lookup31:d@8c` ->
    `engine_ar@8c`, so continuous rows compare with continuous AR); HF rows (no suffix) -> `engine_ar@1`."""
    return "engine_ar@" + (method.rsplit("@", 1)[1] if "@" in method else "1")


def kind_of(method: str) -> str:
    """The method without its batch suffix and drafter name: what `--methods` selects on."""
    base = method.split("@")[0].split(":")[0]
    return re.sub(r"(\d+|all)$", "", base) if "_tree" in base else base


def select_rows(paths, methods=None) -> tuple[list[dict], list[str]]:
    """The summary row of every (dataset, method, temperature), the first file's where several files have one; the
    skipped duplicates as `path: dataset method` lines."""
    rows, seen, skipped = [], {}, []
    for path in paths:
        text = Path(path).read_text()
        file_rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        for r in file_rows:
            if "pass" in r or (methods and not {kind_of(r["method"]), r["method"].split("@")[0]} & set(methods)):
                continue
            key = (r["dataset"], r["method"], r.get("temperature", 0.0))
            if key in seen and seen[key] != path:
                skipped.append(f"{path}: {r['dataset']} {r['method']} (kept {seen[key]})")
                continue
            if key in seen:  # the same file appended twice (a re-run into one folder): its last summary row counts
                rows = [x for x in rows if (x["dataset"], x["method"], x.get("temperature", 0.0)) != key]
            seen[key] = path
            rows.append({**r, "source": str(path)})
    if not rows:
        which = f" for {' '.join(methods)}" if methods else ""
        raise SystemExit(f"No summary rows{which} in {' '.join(map(str, paths))}")
    return rows, skipped


def environment(paths) -> str:
    """'NVIDIA H200 · commit b103102bcb · torch ... · transformers ... · vllm ...' from the bench.json files beside
    `paths`."""
    envs = []
    for p in paths:
        for name in ("bench.json", "bench_vllm.json"):
            f = Path(p).parent / name
            if f.exists():
                envs.append(json.loads(f.read_text()).get("environment", {}))
    gpus = sorted({e.get("gpu") for e in envs if e.get("gpu")})
    commits = sorted({str(e.get("commit"))[:10] for e in envs if e.get("commit")})
    versions = sorted({f"{k} {e[k]}" for e in envs for k in ("torch", "transformers", "vllm") if e.get(k)})
    return " · ".join([", ".join(gpus) or "unknown GPU", "commit " + ", ".join(commits or ["unknown"]), *versions])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", nargs="+", help="bench_raw.jsonl files (the first file's row wins for a repeated method)")
    p.add_argument("--out", required=True)
    p.add_argument("--methods", nargs="*", help="method kinds to draw, e.g. vllm_ar engine_ar engine_tree_lookup, "
                   "or methods without the batch suffix, e.g. engine_tree_lookup31:new (one drafter's rows)")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, skipped = select_rows(args.raw, args.methods)
    rows = [r for r in rows if r.get("temperature", 0.0) == args.temperature]
    for line in skipped:
        print("not drawn (an earlier file has it):", line)
    batches = sorted({batch_of(r["method"]) for r in rows})
    datasets = sorted({r["dataset"] for r in rows})
    kinds = sorted({kind_of(r["method"]) for r in rows})  # one colour per method kind in every panel
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        here = [r for r in rows if batch_of(r["method"]) == b]
        speed = {r["method"]: r["tok_per_s"] for r in here}  # bars slowest first: any dataset's row orders them
        methods = sorted(speed, key=speed.get)
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            labelled = False  # the legend names a method at its first bar, whichever dataset that is
            for j, d in enumerate(datasets):
                r = next((x for x in here if x["method"] == m and x["dataset"] == d), None)
                if r is None:
                    continue
                ar = next((x for x in here if x["dataset"] == d and x["method"] == ar_of(m)), None)
                bar = ax.bar(j + (i - (len(methods) - 1) / 2) * width, r["tok_per_s"], width,
                             color=f"C{kinds.index(kind_of(m))}", label=None if labelled else m)
                labelled = True
                label = f"{r['tok_per_s']:.0f}" + (f"\n{r['tok_per_s'] / ar['tok_per_s']:.2f}×" if ar else "")
                ax.bar_label(bar, [label], fontsize=6)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(f"batch {b}" + ("" if b == 1 else " (throughput)"))
        ax.set_ylabel("tokens/s (labels: × engine AR, same batch)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
        ax.set_ylim(0, 1.4 * max(r["tok_per_s"] for r in here))  # room for the legend above the bars
    fig.suptitle(f"T={args.temperature:g} · {environment(args.raw)}", fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
