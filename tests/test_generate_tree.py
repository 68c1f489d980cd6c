"""Draft trees through `target.generate(assistant_model=drafter)` (CPU, eager, fp32): `drafter.use_draft_tree()` makes
greedy calls verify trees on the engine; output stays the target's greedy output, the recorded rounds are the engine's,
calls the tree path cannot serve fall back to linear blocks with a warning, and bad settings fail clearly."""

import json
import warnings

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs, _prompts, _trained_setup
from test_engine_tree import WIDE

from hf_carryover import Drafter
from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.engine.hf_generate import TreeRounds
from hf_carryover.generation_carryover import CarryoverCandidateGenerator


def _generate(target, drafter, prompt, max_new, **kw):
    x = torch.tensor([prompt])
    y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                        assistant_model=drafter, **kw)
    return y[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lookup", [None, 4])
@pytest.mark.parametrize("nodes", [None, 5])
def test_tree_generate_equals_plain_greedy_and_records_the_engine_rounds(arch, lookup, nodes):
    target = build_target(arch)
    drafter = build_drafter(target, "dflash", True).use_draft_tree(WIDE, nodes=nodes)
    engine = SpeculativeEngine(target, drafter, max_len=128)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    for prompt in _prompts(3, (1, 6, 13)):
        ref = _greedy_refs(target, [prompt], 23)[0]
        assert _generate(target, drafter, prompt, 23, **kw) == ref
        rec = drafter.last_candidate_generator
        assert isinstance(rec, TreeRounds) and rec.tree_nodes == (nodes or len(WIDE)) and rec.lookup_tokens == lookup
        assert engine.generate([prompt], max_new_tokens=23, tree=WIDE, tree_nodes=nodes,
                               prompt_lookup_num_tokens=lookup) == [ref]
        assert [r["accepted"] for r in rec.rounds] == engine.rounds[0]
        assert [r.get("source") == "lookup" for r in rec.rounds] == engine.lookup_rounds[0]


@pytest.mark.parametrize("lookup", [None, 4])
def test_tree_generate_serves_left_padded_batches_row_by_row(lookup):
    """Transformers' assisted decoding takes batch 1 only; tree calls take a left-padded batch, each row the greedy
    continuation of its own prompt, rows that stop at EOS first filled with the pad id, as generate() fills them."""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True).use_draft_tree(WIDE, nodes=5)
    prompts = _prompts(6, (2, 9, 5))
    free = _greedy_refs(target, prompts, 20)
    eos = free[2][6]  # row 2 emits it at step 7; the others stop wherever it occurs
    refs = _greedy_refs(target, prompts, 20, eos=eos)
    width, pad = max(map(len, prompts)), 0
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    y = target.generate(x, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                        eos_token_id=eos, pad_token_id=pad, **({"prompt_lookup_num_tokens": lookup} if lookup else {}))
    longest = max(map(len, refs))
    assert y[:, :width].tolist() == x.tolist() and y.shape[1] == width + longest
    assert y[:, width:].tolist() == [r + [pad] * (longest - len(r)) for r in refs]
    rec = drafter.last_candidate_generator
    assert len(rec.row_rounds) == 3 and rec.rounds == [r for row in rec.row_rounds for r in row]
    assert all(sum(r["accepted"] + 1 for r in rows) <= len(ref) for rows, ref in zip(rec.row_rounds, refs))


def test_tree_generate_with_a_good_drafter_accepts_more_than_linear_blocks():
    target, drafter, prompts, max_new, refs = _trained_setup("dflash", True, steps=40)
    linear, tree = [], []
    for prompt, ref in zip(prompts, refs):
        assert _generate(target, drafter, prompt, max_new) == ref
        linear += [r["accepted"] + 1 for r in drafter.last_candidate_generator.rounds]
    k = drafter.config.num_proposals
    drafter.use_draft_tree([(0,) * d for d in range(1, k + 1)] + [(1,), (2,), (1, 0), (0, 1), (0, 0, 1)], nodes=None)
    for prompt, ref in zip(prompts, refs):
        assert _generate(target, drafter, prompt, max_new) == ref
        tree += [r["accepted"] + 1 for r in drafter.last_candidate_generator.rounds]
    emitted = sum(len(r) for r in refs) - len(refs)  # every token but the prefill's, less a last draftless round's
    assert emitted - len(refs) <= min(sum(tree), sum(linear)) and max(sum(tree), sum(linear)) <= emitted
    assert sum(tree) / len(tree) > sum(linear) / len(linear) + 0.2, (tree, linear)  # τ: more tokens per verification
    drafter.use_draft_tree(None)
    assert _generate(target, drafter, prompts[0], max_new) == refs[0]
    assert isinstance(drafter.last_candidate_generator, CarryoverCandidateGenerator)


def test_engine_is_kept_while_calls_fit_and_rebuilt_when_longer():
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", False).use_draft_tree(WIDE, nodes=4)
    _generate(target, drafter, [5, 9, 3], 20)
    first = drafter.__dict__["_hf_carryover_tree_engine"]
    assert first.max_len == 256
    _generate(target, drafter, [7, 1, 4, 4, 2], 30)
    assert drafter.__dict__["_hf_carryover_tree_engine"] is first
    prompt = _prompts(4, (3,))[0]
    assert _generate(target, drafter, prompt, 260) == _greedy_refs(target, [prompt], 260)[0]
    longer = drafter.__dict__["_hf_carryover_tree_engine"]
    assert longer.max_len == 512
    target.double(), drafter.double()  # a cast model gets new buffers (as a moved one would)
    assert _generate(target, drafter, prompt, 20) == _greedy_refs(target, [prompt], 20)[0]
    assert drafter.__dict__["_hf_carryover_tree_engine"] is not longer


def test_compile_option_compiles_the_engine_round_and_keeps_greedy_output(monkeypatch):
    """use_draft_tree(compile=True): generate()'s engine runs its tree round through torch.compile, the output is still
    plain greedy decoding's, and switching the option gets an engine built for it. torch.compile is replaced by a
    recorder here (a real CPU compile takes ~40 s; `test_engine_tree.py` checks a compiled tree round against eager)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn.__name__) or fn)
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True).use_draft_tree(WIDE, nodes=5)
    prompt = _prompts(5, (6,))[0]
    ref = _greedy_refs(target, [prompt], 12)[0]
    assert _generate(target, drafter, prompt, 12) == ref
    plain = drafter.__dict__["_hf_carryover_tree_engine"]
    assert "compile" not in drafter.last_candidate_generator.mode
    drafter.use_draft_tree(WIDE, nodes=5, compile=True)
    assert _generate(target, drafter, prompt, 12) == ref
    assert drafter.__dict__["_hf_carryover_tree_engine"] is not plain
    assert drafter.last_candidate_generator.mode == "eager +compile" and compiled[-1] == "_tree_round"


def test_compile_options_reach_the_engine_and_are_checked(monkeypatch):
    """use_draft_tree(compile=True, compile_options=...): generate()'s engine compiles with those inductor options (the
    engine's own `compile_options`), a new call with options builds a new engine (frozen weights are baked in), and
    options without compile=True, or a misspelt option, are refused by name. torch.compile is a recorder here."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True)
    prompt = _prompts(5, (6,))[0]
    ref = _greedy_refs(target, [prompt], 12)[0]
    with pytest.raises(ValueError, match="needs compile=True"):
        drafter.use_draft_tree(WIDE, nodes=5, compile_options={"freezing": True})
    drafter.use_draft_tree(WIDE, nodes=5, compile=True, compile_options={"freezing": True})
    assert _generate(target, drafter, prompt, 12) == ref
    first = drafter.__dict__["_hf_carryover_tree_engine"]
    assert first.compile_options == {"freezing": True}
    assert _generate(target, drafter, prompt, 12) == ref
    assert drafter.__dict__["_hf_carryover_tree_engine"] is first  # same settings: the engine (and its graphs) kept
    drafter.use_draft_tree(WIDE, nodes=5, compile=True, compile_options={"freezing": True})
    assert _generate(target, drafter, prompt, 12) == ref
    assert drafter.__dict__["_hf_carryover_tree_engine"] is not first
    drafter.use_draft_tree(WIDE, nodes=5, compile=True)
    assert _generate(target, drafter, prompt, 12) == ref
    assert drafter.__dict__["_hf_carryover_tree_engine"].compile_options == {}
    with pytest.raises(ValueError, match="freezng"):
        drafter.use_draft_tree(WIDE, nodes=5, compile=True, compile_options={"freezng": True})
    assert _generate(target, drafter, prompt, 12) == ref  # the refused call changed nothing


@pytest.mark.parametrize("case", ["sampling", "processor", "streamer", "dict", "short_block", "right_padding"])
def test_calls_the_tree_path_cannot_serve_fall_back_with_a_warning(case):
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True).use_draft_tree(WIDE, nodes=5)
    x = torch.tensor([[5, 9, 3, 7]])
    kw = {"sampling": dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0),
          "processor": dict(do_sample=False, repetition_penalty=1.3),
          "streamer": dict(do_sample=False, streamer=_NullStreamer()),
          "dict": dict(do_sample=False, return_dict_in_generate=True),
          "short_block": dict(do_sample=False, num_assistant_tokens=2),
          "right_padding": dict(do_sample=False, attention_mask=torch.tensor([[1, 1, 1, 0]]))}[case]
    want = {"sampling": "sampling", "processor": "RepetitionPenaltyLogitsProcessor", "streamer": "a streamer",
            "dict": "return_dict_in_generate", "short_block": "num_assistant_tokens=2",
            "right_padding": "left padding only"}[case]
    kw.setdefault("attention_mask", torch.ones_like(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(x, max_new_tokens=12, assistant_model=drafter, **kw)
    assert any("draft tree not used" in str(w.message) and want in str(w.message) for w in caught)
    assert isinstance(drafter.last_candidate_generator, CarryoverCandidateGenerator)  # the linear path ran


class _NullStreamer:
    def put(self, value):
        pass

    def end(self):
        pass


def test_use_draft_tree_loads_the_shipped_file_and_refuses_bad_settings(tmp_path):
    target = build_target("llama")
    build_drafter(target, "dflash", True).save_pretrained(tmp_path)
    (tmp_path / "draft_tree.json").write_text(json.dumps({"paths": [list(p) for p in WIDE]}))
    drafter = Drafter.from_pretrained(tmp_path)
    tree, nodes = drafter.use_draft_tree(nodes=5).draft_tree  # "auto": the folder's draft_tree.json
    assert tree.paths == sorted(WIDE, key=lambda p: (len(p), p)) and nodes == 5
    with pytest.raises(ValueError, match="nodes=63: between 1 and the tree's 11 nodes"):
        drafter.use_draft_tree(tree)  # the default 63 nodes, which this small tree does not have
    with pytest.raises(ValueError, match="depth 5: this drafter proposes 3"):
        drafter.use_draft_tree([(0,) * d for d in range(1, 6)], nodes=None)
    with pytest.raises(ValueError, match="need a DFlash drafter"):
        build_drafter(target, "markov", True).use_draft_tree(WIDE)
    with pytest.raises(FileNotFoundError):
        build_drafter(target, "dflash", True).use_draft_tree(tmp_path / "missing.json")
