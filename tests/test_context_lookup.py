"""Context lookup in the generate() path (`prompt_lookup_num_tokens` with a block drafter).

Rounds whose committed context ends in a 3- or 4-gram seen earlier propose the tokens that followed it, instead of
drafting. It must stay lossless: greedy output equals plain greedy decoding token for token, and sampled output
follows the target's law (the looked-up proposal is handed to the verifier as a point mass).
"""

import pytest
import torch
from test_sampling import ALPHA, N, NEW, PURE, _drafter, _pvalues, _target

from conftest import build_drafter, build_target, greedy
from hf_carryover.generation_carryover import context_lookup

# (7, 1, x) for every token x of the 16-token vocabulary, then (7, 1): whatever the prefill samples as x, the first
# round's context ends in a 3-gram seen earlier, so it looks up [7, 1, ...] instead of drafting
PROMPT_LOOP = torch.tensor([[t for x in range(16) for t in (7, 1, x)] + [7, 1]])


def test_context_lookup_takes_the_earliest_match_of_the_longest_suffix():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    assert context_lookup(seq, 4) == ([9, 1, 2, 3], 3)  # no earlier 4-gram match; the 3-gram's first occurrence
    assert context_lookup(seq + [9], 3) == ([1, 2, 3], 4)  # (1, 2, 3, 9) seen at 0: a 4-gram match wins
    assert context_lookup([5, 6, 7, 5, 6], 4) == ([], 0)  # a 2-gram repeat is below the default minimum of 3
    assert context_lookup([5, 6, 7, 5, 6], 4, min_ngram=2) == ([7, 5, 6], 2)  # from the sequence only


@pytest.mark.parametrize("carryover", [False, True], ids=["nocarry", "carry"])
@pytest.mark.parametrize("drafter_type", ["dflash", "markov"])
def test_greedy_exact_with_lookup(drafter_type, carryover):
    target = build_target("llama")
    ids = torch.tensor([[3, 7, 1, 5, 3, 7, 1, 5, 3, 7, 1]])
    ref = greedy(target, ids, 30)
    drafter = build_drafter(target, drafter_type, carryover, block_size=8)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False,
                          prompt_lookup_num_tokens=6)
    assert torch.equal(out, ref)
    rounds = drafter.last_candidate_generator.rounds
    looked = [r for r in rounds if r.get("source") == "lookup"]
    assert looked and len(looked) < len(rounds) + 1  # the loop in the prompt is looked up at least once
    assert all(1 <= r["proposals"] <= 6 for r in looked)
    # without the knob no round looks up
    target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    assert not any(r.get("source") == "lookup" for r in drafter.last_candidate_generator.rounds)


def _sample_with_lookup(target, drafter, n=N):
    torch.manual_seed(321)
    plain = target.generate(PROMPT_LOOP.repeat(n, 1), max_new_tokens=NEW, do_sample=True, **PURE)
    spec, rounds = [], []
    for _ in range(n):
        out = target.generate(PROMPT_LOOP, assistant_model=drafter, max_new_tokens=NEW, do_sample=True,
                              prompt_lookup_num_tokens=3, **PURE)
        spec.append(out[0, PROMPT_LOOP.shape[1]:].tolist())
        rounds += drafter.last_candidate_generator.rounds
    return spec, plain[:, PROMPT_LOOP.shape[1]:].tolist(), rounds


def test_sampling_with_lookup_follows_the_target():
    target = _target()
    spec, plain, rounds = _sample_with_lookup(target, _drafter(target, "dflash"))
    looked = [r for r in rounds if r.get("source") == "lookup"]
    # lookups happen and the target both keeps and replaces their tokens, so the test exercises both branches
    assert len(looked) > 0.3 * N
    assert any(r["accepted"] > 0 for r in looked) and any(r["accepted"] < r["proposals"] for r in looked)
    pvalues = _pvalues(spec, plain)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_negative_control_detects_a_lookup_handed_over_as_uniform(monkeypatch):
    """The same test rejects a lookup whose proposal the verifier is told was drawn uniformly (it was not), so the
    test above has power: already at 500 samples (p ~ 1e-17 with this seed), a quarter of the test's."""
    from hf_carryover.generation_carryover import CarryoverCandidateGenerator

    original = CarryoverCandidateGenerator._lookup_round

    def uniform(self, input_ids, look, model_outputs):
        candidate, logits = original(self, input_ids, look, model_outputs)
        return candidate, torch.zeros_like(logits)

    monkeypatch.setattr(CarryoverCandidateGenerator, "_lookup_round", uniform)
    target = _target()
    spec, plain, _ = _sample_with_lookup(target, _drafter(target, "dflash"), n=500)
    assert min(_pvalues(spec, plain).values()) < ALPHA


def test_bad_lookup_setting_is_named():
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", False)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=0"):
        target.generate(torch.tensor([[3, 7, 1]]), assistant_model=drafter, max_new_tokens=4,
                        prompt_lookup_num_tokens=0)


def test_lookup_length_is_its_own_knob():
    """num_assistant_tokens limits drafted rounds only: with 2 drafted proposals a round, looked-up rounds still copy up
    to prompt_lookup_num_tokens (within the block), and the output stays plain greedy decoding."""
    target = build_target("llama")
    ids = torch.tensor([[3, 7, 1, 5, 3, 7, 1, 5, 3, 7, 1]])
    ref = greedy(target, ids, 30)
    drafter = build_drafter(target, "dflash", True, block_size=8)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, num_assistant_tokens=2,
                          prompt_lookup_num_tokens=6)
    assert torch.equal(out, ref)
    rounds = drafter.last_candidate_generator.rounds
    assert all(r["proposals"] <= 2 for r in rounds if r.get("source") != "lookup")
    assert max(r["proposals"] for r in rounds if r.get("source") == "lookup") > 2
