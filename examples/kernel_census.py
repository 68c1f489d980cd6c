"""The kernels inductor generates for one compiled engine round, counted on a machine without a GPU.

Why: a captured round of the 135M target is launch-bound (a plain step is ~320 kernels of a few microseconds each on
the H200, `examples/results/h200-2026-12-03d`), so what a change does to the generated code is worth knowing before a
GPU session. Here inductor's CPU backend is switched to Triton (`cpu_backend="triton"`): its scheduler, fusion and
Triton code generation run as for a GPU, and the kernels are never compiled (a stand-in takes their place, and the
call stops after its first round). The counts are a proxy: the GPU's inductor version, its combo kernels and its
attention differ (here SDPA's math path, several kernels a layer), so they rank changes, they are not GPU launches.

It also counts the buffers the size of a whole KV cache that a round allocates: inductor writes a graph input in place
only for its graph's last write to it; any other write (and, before 2026-12-05, every `scatter_` into an input) became
a copy of the whole cache, scattered, and copied back at the graph's end.

    python examples/kernel_census.py --modes ar linear tree_lookup --batch_sizes 1 8 --out census.json

The target is SmolLM2-135M-shaped with random weights (`trainer/gpu_check.smollm2_shaped`), the drafter has the
shipped Carryover drafter's shape (3 layers, block 16), trees are the shipped `draft_tree.json` (31 nodes a round,
lookup 15).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "trainer"), str(ROOT / "examples")]

TREE = ROOT / "model_cards" / "smollm2-135m-instruct-dflash-carryover" / "draft_tree.json"


class _Stop(Exception):
    pass


class _NoKernel:
    """Stands in for a compiled Triton kernel: launching it does nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def _codegen_only() -> None:
    """Inductor's CPU backend to Triton, with kernels that are generated but never compiled."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as config
    import torch.utils._triton as triton_utils

    try:
        import triton  # noqa: F401  (its code generator's imports)
    except ImportError:
        raise SystemExit("kernel_census needs the triton package (pip install triton): inductor's Triton code "
                         "generator imports it, even without a GPU") from None
    config.cpu_backend = "triton"
    config.compile_threads = 1
    # no code from inductor's caches: their keys do not cover the realization rules below, so a cached graph could
    # hold code generated under other rules (seen: a graph compiled under the CPU's rule, loaded under the GPU's)
    if hasattr(config, "force_disable_caches"):
        config.force_disable_caches = True
    else:  # (older inductor)
        config.fx_graph_cache = False
    _gpu_realization(config)
    config.cpp.weight_prepack = False  # (a C++ backend pass; off so that GEMMs stay `mm` as on the GPU)
    triton_utils.triton_hash_with_backend = lambda: "codegen-only"  # no driver here to hash
    async_compile.AsyncCompile.triton = lambda self, *a, **k: _NoKernel()


_CPU_RULE = None  # inductor's `StorageBox.should_realize_on_reuse`, before `_gpu_realization` replaces it


def _gpu_realization(config) -> None:
    """Inductor's rules for writing a value out instead of recomputing it where it is read, as on a GPU. Why: two of
    them differ on CPU tensors. A value with `exp`, `sigmoid`, `tanh` or a log in it that is read more than once is
    always written out on the CPU, which made SiLU(gate) * up a kernel of its own in every layer: the GEMV rewrite
    reads it once per output column. On a GPU it is recomputed inside the down projection's reduction (2 reads, under
    `realize_reads_threshold`). And the CPU's limit of accumulated reads (`realize_cpu_acc_reads_threshold`, 12) is the
    GPU's 8. Until 2026-12-05 (sixth session) the census counted with the CPU's rules: 30 pointwise kernels a plain
    step more than the GPU's inductor generates."""
    import torch._inductor.ir as ir

    global _CPU_RULE
    _CPU_RULE = _CPU_RULE or ir.StorageBox.should_realize_on_reuse  # inductor's own, kept for the tests' control

    def should_realize_on_reuse(self, users, *, graph_reuse=True):  # StorageBox's rule without its CPU branch
        if users > 1 and isinstance(self.data, (ir.Pointwise, ir.Reduction)):
            if self.has_large_inner_fn():
                return True
            return graph_reuse and self.num_reads() > config.realize_reads_threshold
        return False

    ir.StorageBox.should_realize_on_reuse = should_realize_on_reuse
    if config.realize_acc_reads_threshold is None:
        config.realize_acc_reads_threshold = getattr(config, "_realize_acc_reads_threshold_default", 8)


def census(mode: str, batch: int, inductor: dict, gemv_rows: int = 0, max_len: int = 640,
           gemv_fusion: bool | str = False) -> dict:
    """One round of `mode` at batch `batch`, compiled: its graphs, launches by kind and by graph (in compile order:
    a tree round's verify graph, then the graph after its deliberate split), and whole-cache buffers."""
    from gpu_check import smollm2_shaped

    from hf_carryover import Drafter
    from hf_carryover.engine.engine import SpeculativeEngine
    from hf_carryover.engine.tree import TreeSpec

    torch._dynamo.reset()
    target = smollm2_shaped(torch.float32, "cpu")
    drafter = None if mode == "ar" else Drafter.from_target(
        target, drafter_type="dflash", carryover=True, block_size=16, num_hidden_layers=3,
        target_layer_ids=[1, 8, 14, 20, 27], mask_token_id=0).eval()
    engine = SpeculativeEngine(target, drafter, max_len=max_len, compile=True, compile_options=inductor or None,
                               gemv_rows=gemv_rows, gemv_fusion=gemv_fusion)
    engine.row_prefill = False  # the batched eager prefill: the round is the call's only compile

    def stop(st):
        raise _Stop

    engine.round_hook = stop
    kw = dict(max_new_tokens=16)
    if mode == "tree_lookup":
        kw.update(tree=TreeSpec.load(TREE), tree_nodes=31, prompt_lookup_num_tokens=15)
    prompts = [[5 + (i * 7 + j) % 300 for i in range(40 + j)] for j in range(batch)]
    with written_code() as written:
        try:
            with torch.no_grad():
                engine.generate(prompts, **kw)
        except _Stop:
            pass
    cache = engine._caches[batch][0].k[0]
    per_graph = [count_launches([path], cache.numel()) for path in written]  # each graph's code read once
    launches = sum((c for c, _ in per_graph), Counter())
    return {"mode": mode, "batch": batch, "graphs": len(written), "launches": sum(launches.values()),
            "graph_launches": [sum(c.values()) for c, _ in per_graph],
            "by_kind": dict(launches.most_common()), "whole_cache_buffers": sum(w for _, w in per_graph),
            "cache_shape": list(cache.shape)}


@contextlib.contextmanager
def written_code():
    """Collect the paths of the code inductor writes inside the block (each compiled graph's module, once each)."""
    written = []

    class Paths(logging.Handler):  # inductor logs where it wrote each graph's code
        def emit(self, record):
            for path in re.findall(r"Output code written to: (\S+)", record.getMessage()):
                if path not in written:
                    written.append(path)

    handler = Paths()
    log = logging.getLogger("torch._inductor.codecache.__output_code")
    torch._logging.set_logs(output_code=True)
    log.addHandler(handler)
    log.propagate = False  # (not torch's handler: it would print every graph's code)
    try:
        yield written
    finally:
        log.removeHandler(handler)
        log.propagate = True
        torch._logging.set_logs()


def count_launches(paths, cache_numel: int = 0) -> tuple[Counter, int]:
    """Launches in the `call` functions of inductor's generated modules at `paths`, by kind (`triton_poi` pointwise,
    `triton_per` persistent and `triton_red` looped reductions, extern calls by name), and the buffers they allocate
    of `cache_numel` elements (a whole KV cache)."""
    launches, whole = Counter(), 0
    for path in paths:
        code = Path(path).read_text()
        body = code[code.rfind("def call("):]
        for name in re.findall(r"^\s+(\w+)\.run\(", body, re.M):
            launches["triton_" + name.split("_")[1] if name.startswith("triton_") else name] += 1
        for name in re.findall(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+)", body, re.M):
            launches[name] += 1
        if cache_numel:
            for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", body):
                whole += torch.Size(int(x) for x in shape.split(",") if x.strip()).numel() == cache_numel
    return launches, whole


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["ar", "linear", "tree_lookup"],
                   choices=["ar", "linear", "tree_lookup"])
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--inductor", nargs="*", default=["freezing=True"], metavar="KEY=VALUE",
                   help="inductor options of the compiled round, as the benchmark's --inductor (default freezing=True)")
    p.add_argument("--gemv_rows", type=int, default=0, help="the engine's gemv_rows (GEMMs of at most N rows as "
                   "generated reductions)")
    p.add_argument("--gemv_fusion", nargs="?", const=True, default=False, choices=[True, "norms"],
                   help="the engine's gemv_fusion=True (RMSNorms and SiLU * up inside the reductions; until "
                   "2026-12-05c the default, which --no_gemv_fusion turned off), or --gemv_fusion norms (the norms "
                   "only)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from benchmark import parse_inductor_options
    from evaluate_tau import environment

    inductor = parse_inductor_options(args.inductor)
    _codegen_only()
    rows = []
    for mode in args.modes:
        for b in args.batch_sizes:
            rows.append(census(mode, b, inductor, args.gemv_rows, gemv_fusion=args.gemv_fusion))
            r = rows[-1]
            print(f"{mode} b{b}: {r['graphs']} graph(s), {r['launches']} launches ({r['graph_launches']} by graph) "
                  f"{r['by_kind']}, {r['whole_cache_buffers']} whole-cache buffers", flush=True)
    res = {"command": "python " + " ".join([Path(__file__).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
           "inductor": inductor, "gemv_rows": args.gemv_rows,
           "gemv_fusion": args.gemv_fusion, "env": environment(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
