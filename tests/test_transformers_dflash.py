"""transformers' own DFlash loop (`speculation_type="dflash"`, >= 5.15) drives our DFlash drafter: exact output,
and the same accepted lengths as our generator with Carryover off — a cross-check of our DFlash semantics
(block layout, KV injection, positions) against an independent implementation of the loop."""

import pytest
import torch
from conftest import build_drafter, build_target
from test_offline_tau import overfit

candidate_generator = pytest.importorskip("transformers.generation.candidate_generator")
DFlashGen = getattr(candidate_generator, "DFlashTokenCandidateGenerator", None)
pytestmark = pytest.mark.skipif(DFlashGen is None, reason="this transformers has no DFlash path")


def test_transformers_dflash_loop_matches_ours(monkeypatch):
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (3 + n,), generator=g).tolist() for n in range(4)]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0].tolist() for p in prompts]
    overfit(drafter, target, [(len(p), r, 40) for p, r in zip(prompts, refs)], steps=60)

    theirs_rounds = []
    monkeypatch.setattr(DFlashGen, "update_candidate_strategy",
                        lambda self, input_ids, scores, num_matches: theirs_rounds.append(int(num_matches)),
                        raising=False)
    for p, ref in zip(prompts, refs):
        ours = target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=40, do_sample=False)
        our_rounds = [r["accepted"] for r in drafter.last_candidate_generator.rounds]
        theirs_rounds.clear()
        theirs = target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=40, do_sample=False,
                                 speculation_type="dflash")
        assert ours[0].tolist() == ref and theirs[0].tolist() == ref
        theirs_draft = theirs_rounds[1:]  # their first update follows the prefill, which drafts nothing
        n = min(len(our_rounds), len(theirs_draft)) - 1  # the last round may differ (budget trimming)
        assert n >= 5 and our_rounds[:n] == theirs_draft[:n], (our_rounds, theirs_draft)
    assert sum(our_rounds) / len(our_rounds) > 1.5


def test_markov_drafter_refused_by_transformers_dflash():
    target = build_target("llama")
    drafter = build_drafter(target, "markov", False)
    with pytest.raises(ValueError, match="'dflash' drafter only"):
        target.generate(torch.tensor([[3, 4, 5]]), assistant_model=drafter, max_new_tokens=8, do_sample=False,
                        speculation_type="dflash")


def test_a_draft_tree_leaves_transformers_dflash_loop_alone():
    """`speculation_type="dflash"` asks for transformers' own loop: a drafter with a draft tree set runs it, not
    ours."""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", False).use_draft_tree([(0,), (1,), (0, 0)], nodes=None)
    prompt = torch.tensor([[3, 4, 5, 9]])
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False)
    drafter.last_candidate_generator = None
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False,
                          speculation_type="dflash")
    assert torch.equal(out, ref) and drafter.last_candidate_generator is None  # no tree record: not our path
