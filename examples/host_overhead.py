"""Host time the engine spends per `generate()` call around its rounds, on the reference target's module tree.

Why: on the H200 a batch-1 `generate()` of the captured engine took about 7 ms per call beyond its rounds and its
captured prefill (`examples/profile_engine.py`: `generate_ms_per_round` against `synced_ms`, `h200-2026-12-02f`).
At ~35 tree rounds per prompt that is a tenth of the call. Part of it is Python before and after the rounds; this
script times those parts without a GPU, on a random model with SmolLM2-135M's shapes (397 modules) and a 3-layer
drafter (51):

  * `decoding_wrapper_ms`: `engine._decoding` around an empty method: finding the submodules in training mode,
    switching and restoring them, and switching the target's attention (`engine_attention`);
  * the same with every submodule in training mode (`..._training_ms`), the cost the wrapper pays only then;
  * `attention_switch_ms`: `engine_attention` alone;
  * `eager_ops`: the ATen ops one batch-1 `generate()` call (tree of 31 nodes + lookup 15, as benchmarked) dispatches
    outside its rounds and its prefill forward, split into the call's start (`SpeculativeEngine._begin`: rows loaded,
    first lookup; on CUDA one replayed graph since it was captured) and the rest. Each op is a host-side dispatch and,
    on CUDA, mostly a kernel launch.

    python examples/host_overhead.py --out host_overhead.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from evaluate_tau import environment  # noqa: E402
from gpu_check import smollm2_shaped  # noqa: E402

from hf_carryover.engine.attention import engine_attention  # noqa: E402
from hf_carryover.engine.loop import _decoding  # noqa: E402
from hf_carryover.modeling_drafter import Drafter  # noqa: E402


def per_call_ms(fn, n):
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1000 * (time.perf_counter() - t) / n


def eager_ops(target, drafter, new_tokens=24):
    """{"start": n, "other": m}: ATen ops a batch-1 tree + lookup call dispatches outside rounds and prefill."""
    from collections import Counter
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_carryover.engine import refill
    from hf_carryover.engine.engine import SpeculativeEngine

    where = {"part": "other", "skip": 0}
    counts = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not where["skip"]:
                counts[where["part"]] += 1
            return func(*args, **(kwargs or {}))

    def around(cls, name, part=None):  # ops inside cls.name go to `part`, or are not counted (None)
        inner = getattr(cls, name)

        def run(*a, **k):
            saved = dict(where)
            where.update(part=part or where["part"], skip=where["skip"] + (part is None))
            try:
                return inner(*a, **k)
            finally:
                where.update(saved)
        return mock.patch.object(cls, name, run)

    engine = SpeculativeEngine(target, drafter, max_len=256)
    engine.row_prefill = True  # the captured engine's prefill path (row by row), run eagerly here
    tree = [[0] * d for d in range(1, 16)] + [[0] * d + [r] for d in range(8) for r in (1, 2)]  # 31 rank paths
    prompt = [5 + (i * 7) % 300 for i in range(60)]  # repeats, so the first lookup finds a match
    kw = dict(max_new_tokens=new_tokens, prompt_lookup_num_tokens=15, tree=tree, tree_nodes=31)
    engine.generate([prompt], **kw)
    with around(SpeculativeEngine, "_tree_round"), around(refill.RowPrefill, "_forward"), \
            around(refill.RowPrefill, "_copy_in"), around(SpeculativeEngine, "_begin", "start"), Count():
        engine.generate([prompt], **kw)
    return dict(counts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    target = smollm2_shaped(torch.float32, "cpu")
    drafter = Drafter.from_target(target, drafter_type="dflash", carryover=True, block_size=16, num_hidden_layers=3,
                                  target_layer_ids=[1, 10, 20], mask_token_id=0).eval()

    class Holder:  # what `_decoding` reads from an engine
        def attention_context(self):
            return engine_attention(self.target)

    holder = Holder()
    holder.target, holder.drafter = target, drafter
    wrapped = _decoding(lambda self: None)

    def attention_switch():
        with engine_attention(target):
            pass

    res = {"command": " ".join(["examples/host_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
           "env": environment(), "modules": [sum(1 for _ in m.modules()) for m in (target, drafter)],
           "decoding_wrapper_ms": per_call_ms(lambda: wrapped(holder), args.calls),
           "attention_switch_ms": per_call_ms(attention_switch, args.calls)}
    target.train()
    drafter.train()
    res["decoding_wrapper_training_ms"] = per_call_ms(lambda: wrapped(holder), args.calls)
    target.eval()
    drafter.eval()
    res["eager_ops"] = eager_ops(target, drafter)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
