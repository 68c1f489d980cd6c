"""The compiled row prefill (`refill.py`) over a dynamic prompt width: one compile for every width bucket, exact
tokens, only the width left dynamic, and a fallback to per-width compiles when the dynamic compile fails.

The compiles here go through recording backends (registered with dynamo, eager underneath); the suite's inductor
test (`test_engine_capture.py::test_compiled_round_equals_eager`) runs the row prefill through inductor at two
widths."""

import pytest
import torch
from conftest import build_drafter, build_target
from torch._dynamo import register_backend

import hf_carryover.engine.refill as refill
from hf_carryover.engine.engine import SpeculativeEngine

COMPILES: list[list] = []  # one entry per compile: the symbolic sizes among its inputs


def _symbols(example_inputs) -> list:
    return [x for x in example_inputs if isinstance(x, torch.SymInt)]


@register_backend
def hf_carryover_test_recorder(gm, example_inputs):
    COMPILES.append(_symbols(example_inputs))
    return gm.forward


@register_backend
def hf_carryover_test_static_only(gm, example_inputs):
    """Refuses any graph with a symbolic size, as a backend that cannot compile dynamic shapes would."""
    if _symbols(example_inputs):
        raise RuntimeError("this backend compiles static shapes only")
    COMPILES.append([])
    return gm.forward


def _setup(monkeypatch):
    monkeypatch.setattr(refill, "WIDTH_ALIGN", 8)  # prompts of 4, 9, 17 tokens: widths 8, 16, 24
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (4, 9, 17)]
    eager = SpeculativeEngine(target, drafter, max_len=96)
    eager.row_prefill = True
    refs = [eager.generate([p], max_new_tokens=12) for p in prompts]
    return target, drafter, prompts, refs


@pytest.mark.parametrize("dynamic", [True, False])
def test_row_prefill_compiles_once_for_every_width(monkeypatch, dynamic):
    """Three prompts in three width buckets: the dynamic prefill adds one compile (the per-width one three), each
    call gives the eager engine's tokens, and the dynamic compile leaves only the width symbolic, also when another
    engine's batch-2 caches recompile it (dynamo's automatic dynamic shapes would make their sizes symbolic too)."""
    target, drafter, prompts, refs = _setup(monkeypatch)
    torch._dynamo.reset()
    COMPILES.clear()
    engine = SpeculativeEngine(target, drafter, max_len=96, compile="hf_carryover_test_recorder",
                               dynamic_prefill=dynamic)
    engine.row_prefill = True
    outs, after = [], []
    for p in prompts:
        outs.append(engine.generate([p], max_new_tokens=12))
        after.append(len(COMPILES))
    assert outs == refs
    prefill_compiles = after[-1] - after[0] + 1  # the first call compiled the round and the first width
    assert prefill_compiles == (1 if dynamic else 3), COMPILES
    assert sum(bool(s) for s in COMPILES) == (1 if dynamic else 0)
    two = SpeculativeEngine(target, drafter, max_len=96, compile="hf_carryover_test_recorder", dynamic_prefill=dynamic)
    two.row_prefill = True
    assert two.generate(prompts[:2], max_new_tokens=12) == refs[0] + refs[1]
    assert all(len(s) <= 1 for s in COMPILES), COMPILES  # the width, nothing else
    assert next(iter(two._prefills.values())).dynamic_width is dynamic


_REDUCTIONS = {"amax", "amin", "max", "min", "sum", "mean", "prod", "argmax", "argmin", "any", "all", "logsumexp"}


@register_backend
def hf_carryover_test_no_symbolic_reduction(gm, example_inputs):
    """Refuses a graph that reduces over a symbolic size, as inductor's GPU code generation did for the row prefill's
    key end ("Dynamic shape on reduction dimension is not supported", h100-2026-12-06e; CPU inductor compiles it)."""
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or name not in _REDUCTIONS or not node.args:
            continue
        x = getattr(node.args[0], "meta", {}).get("example_value")
        if not isinstance(x, torch.Tensor):
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = range(x.dim()) if dim is None else dim if isinstance(dim, (list, tuple)) else [dim]
        if any(isinstance(x.shape[d], torch.SymInt) for d in dims):
            raise RuntimeError(f"{name} over a symbolic size: {node.format_node()}")
    COMPILES.append(_symbols(example_inputs))
    return gm.forward


def test_dynamic_prefill_with_the_key_end_reduces_over_no_symbolic_size(monkeypatch):
    """`attention_key_end` in the dynamic-width row prefill (forced on: on CPU the attention is SDPA, which ignores
    it): the prefill's end of the keys in use must not be a reduction over the width, or the dynamic compile fails
    on the GPU and falls back to per-width compiles."""
    target, drafter, prompts, refs = _setup(monkeypatch)
    torch._dynamo.reset()
    COMPILES.clear()
    engine = SpeculativeEngine(target, drafter, max_len=96, compile="hf_carryover_test_no_symbolic_reduction")
    engine.attention_key_end = True
    engine.row_prefill = True
    assert [engine.generate([p], max_new_tokens=12) for p in prompts] == refs
    assert next(iter(engine._prefills.values())).dynamic_width
    assert sum(bool(s) for s in COMPILES) == 1  # one dynamic compile served all three widths


def test_failed_dynamic_prefill_compiles_per_width(monkeypatch):
    """A backend that refuses symbolic sizes: the prefill warns once, compiles per width from then on, and every
    call still gives the eager engine's tokens."""
    target, drafter, prompts, refs = _setup(monkeypatch)
    torch._dynamo.reset()
    COMPILES.clear()
    engine = SpeculativeEngine(target, drafter, max_len=96, compile="hf_carryover_test_static_only")
    engine.row_prefill = True
    with pytest.warns(UserWarning, match="dynamic prompt width failed; compiling it per width"):
        assert engine.generate([prompts[0]], max_new_tokens=12) == refs[0]
    prefill = next(iter(engine._prefills.values()))
    assert not prefill.dynamic_width
    before = len(COMPILES)
    assert [engine.generate([p], max_new_tokens=12) for p in prompts[1:]] == refs[1:]
    assert len(COMPILES) - before == 2  # one static compile per new width


def test_dynamic_prefill_is_a_bool():
    target = build_target("llama")
    with pytest.raises(ValueError, match="dynamic_prefill='yes': True or False"):
        SpeculativeEngine(target, None, max_len=32, dynamic_prefill="yes")
