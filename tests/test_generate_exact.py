"""Greedy exactness: `target.generate(ids, assistant_model=drafter)` == plain greedy `generate`, token for token.

Speculative decoding with greedy verification is lossless whatever the drafter proposes, so a random drafter,
a drafter that is always wrong and an oracle that is mostly right must all reproduce plain greedy output in
fp32. The oracle and always-wrong drafters replace `CarryoverCandidateGenerator._choose` (the proposal step);
everything else (drafter cache, carryover, EOS/length cropping, acceptance bookkeeping) runs for real.
"""

import pytest
import torch

from hf_carryover import CarryoverCandidateGenerator

from conftest import (
    ARCHS, DRAFTER_TYPES, VOCAB, assert_clear_argmax, build_drafter, build_target, check_round_stats, greedy,
    left_padded_prompt, make_prompt, oracle_choose, speculative,
)

MAX_NEW = 23  # block 4: dflash drafts 3, markov 4 per round; 23 ends inside a block for both


@pytest.mark.parametrize("prompt_len", [1, 5, 17])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("carryover", [False, True], ids=["nocarry", "carry"])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_greedy_exact(drafter_type, carryover, arch, prompt_len):
    target = build_target(arch)
    ids = make_prompt(prompt_len)
    ref = greedy(target, ids, MAX_NEW)
    assert ref.shape[1] == prompt_len + MAX_NEW
    assert_clear_argmax(target, ref, prompt_len)

    drafter = build_drafter(target, drafter_type, carryover)
    out = speculative(target, drafter, ids, MAX_NEW)
    assert torch.equal(out, ref)

    gen = drafter.last_candidate_generator
    assert isinstance(gen, CarryoverCandidateGenerator)
    check_round_stats(gen, drafter.config.num_proposals)
    emitted = 1 + sum(r["accepted"] + 1 for r in gen.rounds)  # prefill token + per-round accepted + bonus
    # at most one trailing verification without drafts (when a single token of budget is left)
    assert emitted in (MAX_NEW, MAX_NEW - 1)
    # the budget cut the last block short: drafting past max_length would be wasted (and, pre-5.23, unsafe)
    assert gen.rounds[-1]["proposals"] < drafter.config.num_proposals


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 8, 12])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_max_new_tokens_mid_block_with_oracle(drafter_type, max_new_tokens, monkeypatch):
    """A perfect drafter emits whole blocks, so the budget must crop the last one (or leave no room at all)."""
    target = build_target("llama")
    ids = make_prompt(5)
    ref = greedy(target, ids, 20)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(ref, VOCAB))
    drafter = build_drafter(target, drafter_type, True)
    out = speculative(target, drafter, ids, max_new_tokens)
    assert torch.equal(out, ref[:, : 5 + max_new_tokens])
    gen = drafter.last_candidate_generator
    n = drafter.config.num_proposals
    assert all(r["accepted"] == r["proposals"] for r in gen.rounds)
    # expected proposals per round: draft min(n, left - 1) while at least 2 tokens are left (prefill emits 1)
    expected, left = [], max_new_tokens - 1
    while left >= 2:
        expected.append(min(n, left - 1))
        left -= expected[-1] + 1
    assert [r["proposals"] for r in gen.rounds] == expected
    if max_new_tokens in (3, 8):  # chosen so that the budget cuts a block short for both drafter types
        assert expected[-1] < n


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("carryover", [False, True], ids=["nocarry", "carry"])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_always_wrong_drafter(drafter_type, carryover, arch, monkeypatch):
    """Every proposal differs from the target's choice: accepted == 0 each round, one token per round."""
    target = build_target(arch)
    ids = make_prompt(5)
    ref = greedy(target, ids, 16)
    original = CarryoverCandidateGenerator._choose

    def wrong(self, input_ids, logits):
        tokens, logits = original(self, input_ids, logits)  # the real drafting path still runs
        start = input_ids.shape[1]
        return (ref[:, start:start + tokens.shape[1]] + 1) % VOCAB, logits

    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", wrong)
    drafter = build_drafter(target, drafter_type, carryover)
    out = speculative(target, drafter, ids, 16)
    assert torch.equal(out, ref)
    gen = drafter.last_candidate_generator
    assert len(gen.rounds) == 14  # 16 tokens = prefill + 14 one-token rounds + 1 draft-less final step
    assert all(r["accepted"] == 0 for r in gen.rounds)
    assert gen.tau == 1.0


def _corrupt(r, j):
    # round 0, 3, 6, ...: all right; 1, 4, ...: position 2 wrong; 2, 5, ...: position 5 wrong
    return (r % 3 == 1 and j == 2) or (r % 3 == 2 and j == 5)


def _expected_accepted(r, proposals):
    wrong = [j for j in range(proposals) if _corrupt(r, j)]
    return wrong[0] if wrong else proposals


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_oracle_drafter(drafter_type, arch, monkeypatch):
    """Mostly-right proposals: acceptance is exactly the length of the correct prefix, tau > 2, output exact."""
    target = build_target(arch)
    ids = make_prompt(5)
    ref = greedy(target, ids, 40)
    assert_clear_argmax(target, ref, 5)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(ref, VOCAB, _corrupt))
    drafter = build_drafter(target, drafter_type, True, block_size=8)
    out = speculative(target, drafter, ids, 40)
    assert torch.equal(out, ref)
    gen = drafter.last_candidate_generator
    check_round_stats(gen, drafter.config.num_proposals)
    assert len(gen.rounds) >= 4
    for r, stats in enumerate(gen.rounds):
        assert stats["accepted"] == _expected_accepted(r, stats["proposals"]), (r, stats)
    assert gen.tau > 2
    assert any(s["accepted"] < s["proposals"] for s in gen.rounds)  # some rejections happened


@pytest.mark.parametrize("carryover", [False, True], ids=["nocarry", "carry"])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_num_assistant_tokens_caps_proposals(drafter_type, carryover, monkeypatch):
    """transformers' `num_assistant_tokens` caps the proposals per round (default: the whole block). With an oracle
    every round proposes exactly the cap and accepts it all, the output stays exact, and a cap below 1 is refused."""
    target = build_target("llama")
    ids = make_prompt(5)
    ref = greedy(target, ids, 40)
    assert_clear_argmax(target, ref, 5)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(ref, VOCAB))
    drafter = build_drafter(target, drafter_type, carryover, block_size=8)
    assert torch.equal(speculative(target, drafter, ids, 40), ref)  # no cap: the whole block
    assert drafter.last_candidate_generator.rounds[0]["proposals"] == drafter.config.num_proposals
    assert torch.equal(speculative(target, drafter, ids, 40, num_assistant_tokens=3), ref)
    rounds = drafter.last_candidate_generator.rounds
    assert all(r["proposals"] == 3 == r["accepted"] for r in rounds[:-1]), rounds  # the last one meets the budget
    assert len(rounds) >= 9
    with pytest.raises(ValueError, match="num_assistant_tokens=0"):
        speculative(target, drafter, ids, 40, num_assistant_tokens=0)


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_num_assistant_tokens_schedule(schedule, monkeypatch):
    """transformers' `num_assistant_tokens_schedule`: +2 proposals after a round that keeps them all, -1 after any
    other (within 1..block), output exact; "heuristic" carries the value into the next call, "heuristic_transient"
    starts again from `num_assistant_tokens`; an unknown schedule is refused."""
    target = build_target("llama")
    ids = make_prompt(5)
    ref = greedy(target, ids, 40)
    assert_clear_argmax(target, ref, 5)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(ref, VOCAB, _corrupt))
    drafter = build_drafter(target, "dflash", True, block_size=8)
    block = drafter.config.num_proposals
    kw = dict(num_assistant_tokens=2, num_assistant_tokens_schedule=schedule)
    assert torch.equal(speculative(target, drafter, ids, 40, **kw), ref)
    rounds = drafter.last_candidate_generator.rounds
    cap = 2
    for i, r in enumerate(rounds):
        # the last round may be cut by the length budget; every other proposes exactly the scheduled number
        assert r["proposals"] == cap or (i == len(rounds) - 1 and r["proposals"] < cap), (i, r, cap)
        cap = min(cap + 2, block) if r["accepted"] >= r["proposals"] else max(1, cap - 1)
    assert len({r["proposals"] for r in rounds}) > 2  # it moved both ways
    assert any(r["accepted"] < r["proposals"] for r in rounds) and any(r["accepted"] == r["proposals"] for r in rounds)
    speculative(target, drafter, ids, 40, **kw)
    first = drafter.last_candidate_generator.rounds[0]["proposals"]
    assert cap != 2 and first == (cap if schedule == "heuristic" else 2), (first, cap)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule='sometimes'"):
        speculative(target, drafter, ids, 40, num_assistant_tokens_schedule="sometimes")


def _eos_setup(arch, prompt_len=5, min_index=6, horizon=40):
    """Pick as EOS a token the target emits greedily for the first time at generated index >= min_index."""
    target = build_target(arch)
    ids = make_prompt(prompt_len)
    free = greedy(target, ids, horizon)[0, prompt_len:].tolist()
    j = next(j for j in range(min_index, horizon) if free[j] not in free[:j])
    eos = free[j]
    target.generation_config.eos_token_id = eos
    ref = greedy(target, ids, horizon)
    # the reference really stops at EOS, before max_new_tokens (so the case cannot silently go away)
    assert ref.shape[1] == prompt_len + j + 1 < prompt_len + horizon
    assert int(ref[0, -1]) == eos
    unused = next(t for t in range(VOCAB) if t not in free)  # a second EOS id that never occurs
    return target, ids, ref, eos, horizon, unused


@pytest.mark.parametrize("eos_as_list", [False, True], ids=["int", "list"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_eos_mid_block(drafter_type, arch, eos_as_list, monkeypatch):
    target, ids, ref, eos, horizon, unused = _eos_setup(arch)
    if eos_as_list:
        target.generation_config.eos_token_id = [unused, eos]
        assert torch.equal(greedy(target, ids, horizon), ref)

    # a real (random) drafter
    drafter = build_drafter(target, drafter_type, True)
    assert torch.equal(speculative(target, drafter, ids, horizon), ref)

    # an oracle drafter: EOS sits inside a proposed block, which must be cut right after it
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(
        torch.cat([ref, ref.new_zeros(1, horizon)], dim=1), VOCAB))
    drafter = build_drafter(target, drafter_type, True, block_size=8)
    out = speculative(target, drafter, ids, horizon)
    assert torch.equal(out, ref)
    gen = drafter.last_candidate_generator
    last = gen.rounds[-1]
    assert last["proposals"] < drafter.config.num_proposals, "EOS did not end the generation inside a block"
    assert last["accepted"] in (last["proposals"], last["proposals"] - 1)  # 5.17 un-accepts a final EOS draft


@pytest.mark.parametrize("mask", ["ones", "none"])
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_attention_mask(drafter_type, mask):
    target = build_target("qwen3")
    ids = make_prompt(9)
    kwargs = {"attention_mask": torch.ones_like(ids) if mask == "ones" else None}
    ref = greedy(target, ids, 20, **kwargs)
    assert torch.equal(ref, greedy(target, ids, 20))
    drafter = build_drafter(target, drafter_type, True)
    assert torch.equal(speculative(target, drafter, ids, 20, **kwargs), ref)
    assert drafter.last_candidate_generator._pad_offset == 0


@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_left_padded_prompt(drafter_type, record_calls):
    """Batch-1 left padding: output equals plain greedy on the same padded input; the drafter hides pad rows."""
    pad = VOCAB - 2
    target = build_target("llama", pad_token_id=pad)
    ids, mask = left_padded_prompt(3, 6, pad)
    ref = greedy(target, ids, 15, attention_mask=mask)
    drafter = build_drafter(target, drafter_type, True)
    out = speculative(target, drafter, ids, 15, attention_mask=mask)
    assert torch.equal(out, ref)
    gen = drafter.last_candidate_generator
    assert gen._pad_offset == 3
    assert gen.cache.valid[0, :3].tolist() == [False] * 3 and bool(gen.cache.valid[0, 3:].all())
    # committed rows in the drafter cache == committed tokens (anchor excluded) after every call
    for c in record_calls[1:]:
        assert c["cache_length"] == c["input_ids"].shape[1] - 1


@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_proposal_rows_layout(drafter_type, monkeypatch):
    """DFlash proposes from block rows 1..B-1 (row k predicts its own token); Markov from rows 0..B-1
    (row k predicts anchor+k+1). The logits handed to `_choose` must come from exactly those rows."""
    from hf_carryover import Drafter

    seen = {"hidden": [], "logits": []}
    draft_hidden, choose = Drafter.draft_hidden, CarryoverCandidateGenerator._choose

    def record_hidden(self, *args, **kwargs):
        out = draft_hidden(self, *args, **kwargs)
        seen["hidden"].append(out)
        return out

    def record_logits(self, input_ids, logits):
        seen["logits"].append(logits.clone())
        return choose(self, input_ids, logits)

    monkeypatch.setattr(Drafter, "draft_hidden", record_hidden)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", record_logits)
    target = build_target("llama")
    drafter = build_drafter(target, drafter_type, True, block_size=5)
    speculative(target, drafter, make_prompt(5), 30)
    first = 1 if drafter_type == "dflash" else 0
    assert drafter.config.num_proposals == 5 - first
    assert len(seen["hidden"]) == len(seen["logits"]) > 3
    for hidden, logits in zip(seen["hidden"], seen["logits"]):
        assert hidden.shape[1] == 5
        n = logits.shape[1]
        expected = drafter.lm_logits(hidden[:, first:first + n]).float()
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
