"""generate()'s static rounds (`StaticDraftRound`: fixed shapes, CUDA graphs on CUDA) draft exactly what the dynamic
path drafts.

On CPU the static rounds run the same code eagerly (`drafter.static_rounds = True`), so these tests check what the
graphs replay: the position-indexed cache, the carryover rows taken from the fixed feature buffer with their
validity mask and positions, the prompt written eagerly (left padding left out), and reuse across calls. The drafter's
proposal logits of every round are compared with the dynamic path's (fp32, atol 1e-5) while an oracle chooses
proposals with wrong tokens at fixed places, so rounds accept varying prefixes and hand varying carryover rows on.
"""

import pytest
import torch

from hf_carryover import CarryoverCandidateGenerator
from hf_carryover.generation_carryover import StaticDraftRound

from conftest import (
    ARCHS, DRAFTER_TYPES, VOCAB, build_drafter, build_target, greedy, left_padded_prompt, make_prompt, oracle_choose,
)


def _corrupt(r, j):  # rounds accept 1, all, 0, 3, ... proposals: every carryover size from 0 to the block
    return j == (1, 99, 0, 3)[r % 4]


def _run(target, drafter, ids, n, static, monkeypatch, ref=None, **kwargs):
    """Speculative generate() with static rounds on or off; returns (output, per-round drafter logits, generator)."""
    seen = []
    choose = oracle_choose(ref, VOCAB, _corrupt) if ref is not None else CarryoverCandidateGenerator._choose

    def recording(self, input_ids, logits):
        seen.append(logits.clone())
        return choose(self, input_ids, logits)

    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", recording)
    drafter.static_rounds = static
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=n, do_sample=False, **kwargs)
    monkeypatch.undo()
    return out, seen, drafter.last_candidate_generator


def _assert_same_drafts(a, b):
    assert len(a) == len(b) and len(a) >= 4
    for r, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, r
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"round {r}")


@pytest.mark.parametrize("gate", [None, 1.0], ids=["plain", "gated"])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_static_rounds_draft_what_the_dynamic_path_drafts(arch, drafter_type, gate, monkeypatch):
    target = build_target(arch)
    ids = make_prompt(7)
    ref = greedy(target, ids, 40)
    drafter = build_drafter(target, drafter_type, True, block_size=6, carryover_gate=gate)
    out_d, logits_d, gen_d = _run(target, drafter, ids, 40, False, monkeypatch, ref)
    out_s, logits_s, gen_s = _run(target, drafter, ids, 40, True, monkeypatch, ref)
    assert gen_d.static is None and isinstance(gen_s.static, StaticDraftRound)
    assert torch.equal(out_d, ref) and torch.equal(out_s, ref)
    assert gen_s.rounds == gen_d.rounds
    assert {r["accepted"] for r in gen_s.rounds} >= {0, 1, 3}  # carryover of several sizes was used
    _assert_same_drafts(logits_d, logits_s)


def test_static_rounds_without_carryover(monkeypatch):
    target = build_target("qwen3")
    ids = make_prompt(9)
    ref = greedy(target, ids, 30)
    drafter = build_drafter(target, "dflash", False, block_size=5)
    out_d, logits_d, _ = _run(target, drafter, ids, 30, False, monkeypatch, ref)
    out_s, logits_s, _ = _run(target, drafter, ids, 30, True, monkeypatch, ref)
    assert torch.equal(out_s, ref) and torch.equal(out_d, ref)
    _assert_same_drafts(logits_d, logits_s)


@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_static_rounds_left_padding(drafter_type, monkeypatch):
    """Pad rows are not written: the real prompt starts at position 0, as in the dynamic path's masked cache."""
    pad = VOCAB - 2
    target = build_target("llama", pad_token_id=pad)
    ids, mask = left_padded_prompt(3, 6, pad)
    ref = greedy(target, ids, 30, attention_mask=mask)
    drafter = build_drafter(target, drafter_type, True)
    out_d, logits_d, _ = _run(target, drafter, ids, 30, False, monkeypatch, ref, attention_mask=mask)
    out_s, logits_s, gen = _run(target, drafter, ids, 30, True, monkeypatch, ref, attention_mask=mask)
    assert gen._pad_offset == 3
    assert torch.equal(out_s, ref) and torch.equal(out_d, ref)
    _assert_same_drafts(logits_d, logits_s)


def test_static_rounds_reused_across_calls_and_rebuilt_when_needed(monkeypatch):
    """A second prompt reuses the entry (stale rows of the first must stay invisible); a longer generation, another
    bound target or a cast drafter gets a new one. The drafter's own greedy choices, not an oracle."""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True, block_size=6)
    first = make_prompt(30, seed=7)
    second = make_prompt(5, seed=8)
    out, logits_a, gen = _run(target, drafter, first, 40, True, monkeypatch)
    assert torch.equal(out, greedy(target, first, 40))
    entry = gen.static
    out, logits_b, gen = _run(target, drafter, second, 40, True, monkeypatch)
    assert gen.static is entry  # reused: same capacity bucket, same target, same weights
    assert torch.equal(out, greedy(target, second, 40))
    _, logits_ref, _ = _run(target, drafter, second, 40, False, monkeypatch)
    _assert_same_drafts(logits_ref, logits_b)

    _, _, gen = _run(target, drafter, second, 600, True, monkeypatch)
    assert gen.static is not entry and gen.static.capacity >= 600 + 5
    longer = gen.static
    other = build_target("llama", seed=5)  # same shape, other weights: the graphs must read its head
    _, _, gen = _run(other, drafter, second, 20, True, monkeypatch)
    assert gen.static is not longer
    drafter.double()
    out, _, gen = _run(other.double(), drafter, second, 20, True, monkeypatch)
    assert gen.static.feat.dtype == torch.float64
    assert torch.equal(out, greedy(other, second, 20))


def test_static_rounds_with_context_lookup_and_sampling(monkeypatch):
    """Lookup rounds write the verified rows without drafting; sampled rounds see the same logits, so a seed gives
    the same tokens on both paths."""
    target = build_target("qwen3")
    drafter = build_drafter(target, "markov", True, block_size=6)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # repeated 4-grams: lookup rounds happen
    ref = greedy(target, ids, 40)
    out, _, gen = _run(target, drafter, ids, 40, True, monkeypatch, prompt_lookup_num_tokens=5)
    assert torch.equal(out, ref)
    assert any(r.get("source") == "lookup" for r in gen.rounds)
    outs = []
    for static in (False, True):
        drafter.static_rounds = static
        torch.manual_seed(3)
        outs.append(target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=True))
    assert torch.equal(outs[0], outs[1])


def test_failed_capture_falls_back_to_eager_static_rounds(monkeypatch):
    """A capture that raises (here: CUDA calls on a CPU drafter) warns once and drafts the same rounds eagerly."""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True, block_size=6)
    ids = make_prompt(8)
    ref = greedy(target, ids, 30)
    _, logits_d, _ = _run(target, drafter, ids, 30, False, monkeypatch)
    drafter.static_rounds = True
    target.generate(ids, assistant_model=drafter, max_new_tokens=4)  # builds the drafter's static entry
    entry = drafter.last_candidate_generator.static
    entry.graphs = True  # as on CUDA: the next round tries to capture
    with pytest.warns(UserWarning, match="capture of the drafter's .* round failed"):
        out, logits_s, gen = _run(target, drafter, ids, 30, True, monkeypatch)
    assert gen.static is entry and entry.graphs is False
    assert torch.equal(out, ref)
    _assert_same_drafts(logits_d, logits_s)
