"""`SpeculativeEngine(rope_table="auto" | True)`: the target's and the drafter's RoPE read by position from tables of
their rotary modules' own values (`hf_carryover/engine/rope_table.py`); "auto" is the engine's default."""

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs, _prompts
from test_engine_tree import WIDE

from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.engine.rope_table import build_rope_tables, rotary_module, use_rope_tables


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_table_gives_the_rotary_modules_own_values_and_is_put_back(arch):
    """Bitwise the module's cos/sin for any positions and batch shape (in the caller's dtype), clamped past its end;
    the module's own forward is back after the body, also after an error."""
    target = build_target(arch)
    [(rotary, forward)] = build_rope_tables({"target": target, "drafter": None}, 64)
    pos = torch.tensor([[0, 5, 63, 17], [2, 2, 40, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(0, dtype=dtype)
        ref, got = rotary(x, pos), forward(x, pos)
        assert all(torch.equal(a, b) and b.dtype == dtype for a, b in zip(ref, got))
    past_end = forward(torch.empty(0), torch.tensor([[70]]))[0]
    assert torch.equal(past_end, rotary(torch.empty(0), torch.tensor([[63]]))[0])
    with pytest.raises(RuntimeError, match="inside"):
        with use_rope_tables([(rotary, forward)]):
            assert rotary.forward is forward
            raise RuntimeError("inside")
    assert "forward" not in rotary.__dict__ and rotary.forward.__func__ is type(rotary).forward


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_the_table_decodes_plain_greedy_text(arch, monkeypatch):
    """Linear rounds and tree + lookup rounds with the tables equal plain greedy decoding (fp32), and no rotary
    module's forward runs while the engine decodes on them, the target's or the drafter's (they do without); the
    default ("auto") tables both models here."""
    target = build_target(arch, seed=3)
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(2, (3, 8, 12))
    refs = _greedy_refs(target, prompts, 16)
    rotary = rotary_module(target)
    calls = []
    real = type(rotary).forward
    monkeypatch.setattr(type(rotary), "forward", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    table = SpeculativeEngine(target, drafter, max_len=96)
    assert len(table._ropes) == 2 and table.rope_untabled == {} and table.rope_tabled == ["target", "drafter"]
    calls.clear()
    assert table.generate(prompts, max_new_tokens=16) == refs
    assert table.generate(prompts, max_new_tokens=16, tree=WIDE, tree_nodes=5, prompt_lookup_num_tokens=3) == refs
    assert calls == []
    assert SpeculativeEngine(target, drafter, max_len=96, rope_table=False).generate(prompts, max_new_tokens=16) == refs
    assert calls  # without tables the module runs
    assert "forward" not in rotary.__dict__ and "forward" not in rotary_module(drafter).__dict__


def test_compiled_rounds_on_the_table_are_one_graph_each_and_compile_once():
    """With the table, the compiled row prefill and round still trace as one graph each without breaks, and a second
    call with other prompts compiles nothing new (the module's `forward` is the same object on every call, so the
    compiled code's guards hold); tokens equal plain greedy decoding."""
    from torch._dynamo.utils import counters

    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    torch._dynamo.reset()
    counters.clear()
    engine = SpeculativeEngine(target, drafter, max_len=96, compile="aot_eager", rope_table=True)
    engine.row_prefill = True  # the compiled row prefill, as where rounds are captured
    first = [[3, 5, 7, 9], [11, 13, 3, 5, 7, 9, 2, 4, 6]]
    assert engine.generate(first, max_new_tokens=12) == _greedy_refs(target, first, 12)
    graphs = counters["stats"]["unique_graphs"]
    # the row prefill's forward and copy-in, and the round
    assert (graphs, sum(counters["graph_break"].values())) == (3, 0), dict(counters["graph_break"])
    second = [[4, 6, 8, 10], [12, 14, 4, 6, 8, 10, 3, 5, 7]]  # the same width buckets, other tokens
    assert engine.generate(second, max_new_tokens=12) == _greedy_refs(target, second, 12)
    assert counters["stats"]["unique_graphs"] == graphs
    assert engine.last_mode == "eager +compile"


def test_untableable_rope_is_refused_by_name_and_a_shared_module_tabled_once():
    target = build_target("llama")
    rotary = rotary_module(target)
    rotary.rope_type = "dynamic"
    with pytest.raises(ValueError, match="rope_table=True: the target: rope_type='dynamic' changes its frequencies"):
        SpeculativeEngine(target, None, max_len=64, rope_table=True)
    rotary.rope_type = {"full_attention": "default", "sliding_attention": "default"}
    with pytest.raises(ValueError, match="one RoPE per layer type is not supported"):
        SpeculativeEngine(target, None, max_len=64, rope_table=True)
    rotary.rope_type = "default"
    ropes = build_rope_tables({"target": target, "drafter": rotary}, 16)
    assert len(ropes) == 1
    with use_rope_tables(ropes):
        assert rotary.forward is ropes[0][1]
    assert "forward" not in rotary.__dict__


def test_auto_computes_an_untableable_rope_as_usual_and_bad_values_are_refused():
    """The default ("auto") leaves a RoPE it cannot table to its module, says why in `rope_untabled`, and still tables
    the drafter's; the engine then decodes plain greedy text with the target's module running. A value other than
    "auto", True or False is refused by name before anything is touched."""
    target = build_target("llama", seed=4)
    drafter = build_drafter(target, "dflash", True)
    rotary = rotary_module(target)
    rotary.rope_type = "dynamic"  # the module's forward is unchanged: only the check reads rope_type here
    engine = SpeculativeEngine(target, drafter, max_len=96)
    assert engine.rope_untabled == {"target": "rope_type='dynamic' changes its frequencies with the sequence length"}
    assert [r for r, _ in engine._ropes] == [rotary_module(drafter)] and engine.rope_tabled == ["drafter"]
    assert SpeculativeEngine(target, drafter, max_len=96, rope_table=False).rope_tabled == []
    prompts = _prompts(2, (4, 9))
    calls = []
    real = type(rotary).forward
    type(rotary).forward = lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw)
    try:
        assert engine.generate(prompts, max_new_tokens=10) == _greedy_refs(target, prompts, 10)
    finally:
        type(rotary).forward = real
    assert calls
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"rope_table=.*: 'auto', True or False"):
            SpeculativeEngine(target, None, max_len=64, rope_table=bad)
