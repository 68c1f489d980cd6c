"""With `do_sample=True`, speculative sampling must reproduce the target's own sampling distribution.

Setup: a tiny target with a 16-token vocabulary (so every category has a meaningful expected count), a fixed
3-token prompt, 4 new tokens per generation. After the prefill token, the first round drafts 2 tokens (the
length budget), so generated positions 2-3 are proposals that the verifier accepts or replaces, and
position 4 is a bonus token or comes from a second round. The drafter has random weights, so its distribution
differs from the target's and rejections are frequent (asserted).

Statistics: N speculative samples (one `generate()` each: assisted decoding is batch 1) against N plain
samples (one batched `generate()`), both seeded. For every generated position, and for every pair of adjacent
positions (joint), a chi-square two-sample test of homogeneity on the 2 x K contingency table (categories with
fewer than 10 samples in total are pooled into one) must NOT reject at significance alpha = 0.001. A
negative control shows the same test does reject a known-biased sampler (the Markov drafter handing the
verifier its uncorrected distribution), so the test has power.

Two cheaper, sharper checks pin down the drafting half of the contract, whose violations shift the output by
only a few percent TV (too little for N=2000): the logits handed to the verifier are exactly the processed
(and Markov-corrected) distribution of each proposal, and proposals are drawn from that distribution
(goodness of fit, alpha = 0.001).
"""

import collections

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from hf_carryover import CarryoverCandidateGenerator

from conftest import build_drafter, build_target

ALPHA = 0.001
N = 2000
VOCAB16 = 16
PROMPT = torch.tensor([[3, 7, 1]])
NEW = 4
# Pure sampling: no logits processor at all (transformers otherwise adds a top_k=50 warper by default), so the
# drafter's processor-free fast path is the one exercised.
PURE = {"top_k": 0}


def _chi2_pvalue(a, b, min_count=10):
    """p-value of the chi-square test that samples `a` and `b` (lists of hashable categories) share a law."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb))
    common = [k for k in keys if ca[k] + cb[k] >= min_count]
    rare = [k for k in keys if k not in common]
    table = [[ca[k] for k in common], [cb[k] for k in common]]
    if rare:
        table[0].append(sum(ca[k] for k in rare))
        table[1].append(sum(cb[k] for k in rare))
    assert len(table[0]) >= 2, "degenerate distribution: the test would be meaningless"
    return chi2_contingency(np.array(table))[1]


def _pvalues(spec, plain):
    out = {f"pos{j + 1}": _chi2_pvalue([s[j] for s in spec], [s[j] for s in plain]) for j in range(NEW)}
    for j in range(NEW - 1):
        out[f"pos{j + 1}{j + 2}"] = _chi2_pvalue([tuple(s[j:j + 2]) for s in spec],
                                                 [tuple(s[j:j + 2]) for s in plain])
    return out


def _target():
    return build_target("llama", vocab_size=VOCAB16, num_layers=4, initializer_range=0.3)


def _drafter(target, drafter_type):
    d = build_drafter(target, drafter_type, True, block_size=4, target_layer_ids=[0, 1, 2], mask_token_id=None)
    if drafter_type == "markov":
        with torch.no_grad():  # a strong bigram term: omitting it from the returned distribution must show
            d.markov_in.weight.normal_(std=0.3)
    return d


def _sample(target, drafter, n, seed, **gen_kwargs):
    torch.manual_seed(seed)
    plain = target.generate(PROMPT.repeat(n, 1), max_new_tokens=NEW, do_sample=True, **gen_kwargs)
    spec, rounds = [], []
    for _ in range(n):
        out = target.generate(PROMPT, assistant_model=drafter, max_new_tokens=NEW, do_sample=True, **gen_kwargs)
        spec.append(out[0, PROMPT.shape[1]:].tolist())
        rounds += drafter.last_candidate_generator.rounds
    return spec, plain[:, PROMPT.shape[1]:].tolist(), rounds


@pytest.mark.parametrize(
    "drafter_type,gen_kwargs",
    [("dflash", PURE), ("markov", PURE), ("dflash", {"temperature": 0.7, "top_k": 6})],
    ids=["dflash", "markov", "dflash-temp-topk"],
)
def test_sampling_distribution_matches_target(drafter_type, gen_kwargs):
    target = _target()
    drafter = _drafter(target, drafter_type)
    spec, plain, rounds = _sample(target, drafter, N, seed=123, **gen_kwargs)
    assert all(len(s) == NEW for s in spec) and len(plain) == N
    # the drafter really is different from the target: both acceptances and rejections are common
    rejected = sum(r["accepted"] < r["proposals"] for r in rounds)
    accepted = sum(r["accepted"] > 0 for r in rounds)
    assert rejected > 0.2 * len(rounds) and accepted > 0.1 * len(rounds), (rejected, accepted, len(rounds))
    assert any(r["proposals"] >= 2 for r in rounds)
    pvalues = _pvalues(spec, plain)
    assert min(pvalues.values()) > ALPHA, pvalues


def test_negative_control_detects_uncorrected_markov_distribution(monkeypatch):
    """Power check: hand the verifier the Markov drafter's *uncorrected* logits (tokens still drawn from the
    corrected ones) — a plausible bug — and the same chi-square test must reject at alpha."""
    original = CarryoverCandidateGenerator._choose

    def uncorrected(self, input_ids, logits):
        tokens, _ = original(self, input_ids, logits)
        return tokens, logits

    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", uncorrected)
    target = _target()
    spec, plain, _ = _sample(target, _drafter(target, "markov"), 500, seed=321, **PURE)
    assert min(_pvalues(spec, plain).values()) < ALPHA


@pytest.mark.parametrize("drafter_type", ["dflash", "markov"])
def test_greedy_with_temperature_topk_and_processor(drafter_type):
    """Greedy with sampling knobs set (ignored by greedy) plus a real processor: exact, and the processor path runs."""
    target = build_target("llama")
    ids = torch.tensor([[5, 9, 2, 11]])
    kwargs = dict(max_new_tokens=20, do_sample=False, temperature=0.7, top_k=5, repetition_penalty=1.3)
    ref = target.generate(ids, **kwargs)
    assert not torch.equal(ref, target.generate(ids, max_new_tokens=20, do_sample=False))  # penalty matters
    drafter = build_drafter(target, drafter_type, True)
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    assert drafter.last_candidate_generator.logits_processor is not None


@pytest.mark.parametrize("drafter_type", ["dflash", "markov"])
def test_sampled_tokens_stay_in_target_top_k(drafter_type):
    """temperature + top_k sampling: every emitted token is in the target's top-k at its position."""
    target = _target()
    drafter = _drafter(target, drafter_type)
    torch.manual_seed(0)
    ids = torch.tensor([[2, 9, 4, 4, 1]])
    for _ in range(25):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=True,
                              temperature=0.7, top_k=3)
        with torch.no_grad():
            logits = target(out).logits[0, ids.shape[1] - 1:-1]
        top = logits.topk(3, dim=-1).indices
        emitted = out[0, ids.shape[1]:]
        assert bool((top == emitted[:, None]).any(-1).all()), (out, top)


def _record_choose(monkeypatch):
    calls = []
    original = CarryoverCandidateGenerator._choose

    def recording(self, input_ids, logits):
        tokens, returned = original(self, input_ids, logits)
        calls.append((self, input_ids.clone(), logits.clone(), tokens.clone(), returned.clone()))
        return tokens, returned

    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", recording)
    return calls


@pytest.mark.parametrize("gen_kwargs", [PURE, {"temperature": 0.7, "top_k": 6}], ids=["pure", "temp-topk"])
@pytest.mark.parametrize("drafter_type", ["dflash", "markov"])
def test_draft_distribution_handed_to_verifier(drafter_type, gen_kwargs, monkeypatch):
    """The logits returned with the proposals are exactly the distribution each proposal was drawn from:
    row i = processors(prefix_i, drafter logits_i [+ Markov bias of token i-1]), prefix_i = committed + proposals
    before i. (Lossless speculative sampling depends on it; a mismatch shifts the output distribution by a few
    percent TV, which the end-to-end test above would need far more samples to see.)"""
    calls = _record_choose(monkeypatch)
    target = _target()
    drafter = _drafter(target, drafter_type)
    torch.manual_seed(11)
    for _ in range(5):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=12, do_sample=True, **gen_kwargs)
    assert len(calls) > 10
    with torch.no_grad():
        for gen, input_ids, raw, tokens, returned in calls:
            assert (gen.logits_processor is None) == (gen_kwargs is PURE)
            assert tokens.shape[1] == returned.shape[1] == raw.shape[1]
            for i in range(tokens.shape[1]):
                prefix = torch.cat([input_ids, tokens[:, :i]], dim=1)
                row = raw[:, i].clone()
                if drafter_type == "markov":
                    row = row + drafter.markov_bias(prefix[:, -1]).float()
                if gen.logits_processor is not None:
                    row = gen.logits_processor(prefix, row)
                torch.testing.assert_close(returned[:, i], row, atol=1e-5, rtol=1e-5)
                assert torch.isfinite(returned[0, i, tokens[0, i]])  # the proposal has positive probability


def _gof_pvalue(samples, probs, min_expected=5.0):
    """Chi-square goodness of fit of integer `samples` to `probs`, pooling categories expected < min_expected."""
    n = len(samples)
    observed = np.bincount(np.asarray(samples), minlength=len(probs)).astype(float)
    expected = np.asarray(probs, dtype=float) * n
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "sampled a token of probability zero"
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum())[1]


@pytest.mark.parametrize("gen_kwargs", [PURE, {"temperature": 0.7, "top_k": 6}], ids=["pure", "temp-topk"])
@pytest.mark.parametrize("drafter_type", ["dflash", "markov"])
def test_proposals_are_sampled_from_returned_distribution(drafter_type, gen_kwargs):
    """Goodness of fit (alpha = 0.001) of 4000 proposals from `_choose` to softmax(the logits it returns):
    row 0, and row 1 conditional on the most frequent row-0 token (for Markov row 1 depends on it)."""
    target = _target()
    drafter = _drafter(target, drafter_type)
    target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, do_sample=True, **gen_kwargs)
    gen = drafter.last_candidate_generator
    torch.manual_seed(5)
    raw = torch.randn(1, 2, VOCAB16) * 2
    with torch.no_grad():  # as inside generate()
        draws = [gen._choose(PROMPT, raw) for _ in range(4000)]
    first = [int(t[0, 0]) for t, _ in draws]
    assert _gof_pvalue(first, draws[0][1][0, 0].softmax(-1).numpy()) > ALPHA
    mode = max(set(first), key=first.count)
    second = [(int(t[0, 1]), r) for t, r in draws if int(t[0, 0]) == mode]
    assert len(second) > 500
    assert _gof_pvalue([x for x, _ in second], second[0][1][0, 1].softmax(-1).numpy()) > ALPHA
