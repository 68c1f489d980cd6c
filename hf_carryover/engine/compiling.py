"""torch.compile for the engine's rounds and row prefills: inductor with combo kernels, and the caller's inductor
options patched around each call (not passed as compile options; see `compile_round`)."""

from __future__ import annotations

import contextlib
import functools

import torch


def check_inductor_options(options: dict) -> None:
    """Refuse a misspelt inductor option by name now, not at the first call's compile (minutes later, mid-call).
    Shared by `SpeculativeEngine(compile_options=...)` and `Drafter.use_draft_tree(compile_options=...)`."""
    import torch._inductor.config as inductor_config

    try:
        with inductor_config.patch(dict(options)):
            pass
    except AttributeError as e:
        raise ValueError(f"compile_options: {e}") from None


def compile_round(fn, backend: str, compile_options: dict, inductor_patch: dict, dynamic: bool | None = False):
    """`fn` compiled with static shapes. `backend` other than "inductor" (e.g. "aot_eager") is used as it is.

    dynamic=None (the row prefill, `refill.py`): static except the sizes its caller marks dynamic
    (`torch._dynamo.maybe_mark_dynamic`), so one compile serves every prompt-width bucket.

    combo_kernels: inductor launches independent kernels (per layer, small RoPE, cache-write and attention-preparation
    kernels) as one. A captured plain decoding step of the 135M target went from 635 kernels and 1.69 ms to 412 and
    1.35 ms on the H200 (examples/profile_engine.py, examples/results/h200-2026-12-02b); at batch 1 the step is
    launch-bound, so fewer kernels is most of the speed.

    With `compile_options`, a backend of the engine's own, and `inductor_patch` (the options, plus the engine's
    projection-fusing pass) set on inductor's global config around each call (the compile happens inside the first):
    passed as compile options, `freezing` neither packed nor merged weights (CPU, torch 2.13). Dynamo keeps compiled
    code per code object (`_round` is shared by every engine) and reuses it for any backend that compares equal, as
    `torch.compile` backends with equal options do: a frozen round (its weights baked in) served later engines, other
    weights and other options alike (tested)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    patches = []  # config set around each call (a compile happens inside the first call of a new shape)
    if dynamic is None:
        # only the marked sizes: without this a recompile for another engine's caches (batch 8 after batch 1) would
        # make their sizes dynamic too ("automatic dynamic shapes"), and every later prefill run on general code
        patches.append(dynamo_config.patch(automatic_dynamic_shapes=False))
    combo = {"combo_kernels": True}
    if backend != "inductor":
        compiled = torch.compile(fn, dynamic=dynamic, backend=backend)
    elif not compile_options:
        compiled = torch.compile(fn, dynamic=dynamic, backend="inductor", options=combo)
    else:
        def own_backend(gm, example_inputs):
            return compile_fx(gm, example_inputs, config_patches=combo)
        compiled = torch.compile(fn, dynamic=dynamic, backend=own_backend)
        patches.append(inductor_config.patch(inductor_patch))
    if not patches:
        return compiled

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            return compiled(*args, **kwargs)
    return run
