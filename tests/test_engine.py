"""Fast engine (eager reference, CPU): exact greedy output, the same rounds as generate(), lossless sampling."""

import copy

import pytest
import torch
from conftest import build_drafter, build_target
from test_offline_tau import overfit
from test_sampling import ALPHA, NEW, PROMPT, VOCAB16, _drafter, _pvalues, _target

from hf_carryover.engine import engine as engine_mod
from hf_carryover.engine.engine import SpeculativeEngine


def _greedy_refs(target, prompts, max_new, eos=None):
    kw = {} if eos is None else {"eos_token_id": eos}
    return [target.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, **kw)[0, len(p):].tolist()
            for p in prompts]


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 90, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("typ", ["dflash", "markov", None])
@pytest.mark.parametrize("carryover", [False, True])
def test_greedy_batch_equals_plain_greedy(arch, typ, carryover):
    if typ is None and carryover:
        pytest.skip("plain AR has no carryover")
    target = build_target(arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (1, 6, 13, 4)]
    refs = _greedy_refs(target, prompts, 23)  # 23: ends inside a block
    drafter = build_drafter(target, typ, carryover) if typ else None
    engine = SpeculativeEngine(target, drafter, max_len=96)
    assert engine.generate(prompts, max_new_tokens=23) == refs


def test_max_len_rounds_up_to_aligned_caches_and_still_bounds_the_call():
    target = build_target("llama")
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", True), max_len=70)
    assert engine.max_len == engine_mod.MAX_LEN_ALIGN * 2  # 70 -> 128: room is only ever added
    prompts = [[5, 9, 3]]
    out = engine.generate(prompts, max_new_tokens=100)  # 3 + 100 + a block: past 70, within 128
    assert out == _greedy_refs(target, prompts, 100)
    target_cache, drafter_cache = engine._caches[1]
    assert target_cache.k[0].shape[2] == drafter_cache.keys[0].shape[2] == 128
    with pytest.raises(ValueError, match="max_len=128 is too small"):
        engine.generate(prompts, max_new_tokens=125)


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_eos_mid_block_per_row(typ):
    target = build_target("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (3, 7, 5)]
    free = _greedy_refs(target, prompts, 30)
    eos = free[1][9]  # a token row 1 emits at step 10: it must stop there, the others wherever it occurs
    refs = _greedy_refs(target, prompts, 30, eos=eos)
    assert len(refs[1]) <= 10 < 30
    engine = SpeculativeEngine(target, build_drafter(target, typ, True), max_len=96)
    assert engine.generate(prompts, max_new_tokens=30, eos_token_id=eos) == refs


_TRAINED = {}  # (typ, carryover, steps) -> (the setup as trained, the global RNG state it left)


def _trained_setup(typ, carryover, steps):
    """A drafter overfit on the target's own greedy continuations of 4 prompts (so it is often right).

    Training is deterministic (seeded models, seeded anchor draws), and it is most of a test's time, so each
    (typ, carryover, steps) is trained once per session; every call gets its own deep copy of the trained objects
    (tests mutate them) and the global RNG state that training left, i.e. exactly what a fresh run returns."""
    key = (typ, carryover, steps)
    if key not in _TRAINED:
        target = build_target("llama", seed=5)
        drafter = build_drafter(target, typ, carryover)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 90, (3 + n,), generator=g).tolist() for n in range(4)]
        max_new = 40
        refs = _greedy_refs(target, prompts, max_new)
        overfit(drafter, target, [(len(p), p + r, max_new) for p, r in zip(prompts, refs)], steps=steps)
        _TRAINED[key] = ((target, drafter, prompts, max_new, refs), torch.get_rng_state())
    setup, rng = _TRAINED[key]
    torch.set_rng_state(rng)
    return copy.deepcopy(setup)  # one memo: the copied drafter keeps pointing at the copied target's parts


@pytest.mark.parametrize("typ", ["dflash", "markov"])
@pytest.mark.parametrize("carryover", [False, True])
def test_rounds_equal_generate_with_a_good_drafter(typ, carryover):
    """With a drafter that is often right, the engine's rounds are generate()'s, round for round: near
    max_new_tokens generate() drafts only what can still be emitted, and the engine counts (and carries) only those
    drafts of its fixed k; a last verification without drafts is no round in either."""
    target, drafter, prompts, max_new, refs = _trained_setup(typ, carryover, steps=60)
    online = []
    for p in prompts:
        target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
        online.append([r["accepted"] for r in drafter.last_candidate_generator.rounds])
    engine = SpeculativeEngine(target, drafter, max_len=128)
    assert engine.generate(prompts, max_new_tokens=max_new) == refs
    assert engine.rounds == online
    assert engine.tau > 2.0, engine.tau


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_rounds_equal_generate_when_a_drafted_eos_is_accepted(typ):
    """Rows that end at an EOS the drafter drafted and the target accepts: transformers counts such a fully
    accepted draft as one draft less (the target emits the EOS itself); the engine's rounds must count the same."""
    target, drafter, prompts, max_new, refs = _trained_setup(typ, True, steps=60)
    drafter.record_carryover = True
    # as EOS: a token that several rows emit (first time) well inside the budget
    first = [{t: j for j, t in reversed(list(enumerate(r)))} for r in refs]
    eos = max({t for f in first for t in f}, key=lambda t: sum(4 <= f.get(t, -1) < max_new - 8 for f in first))
    refs = _greedy_refs(target, prompts, max_new, eos=eos)
    online, eos_accepted = [], 0
    for p in prompts:
        target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=max_new, do_sample=False,
                        eos_token_id=eos)
        rounds = drafter.last_candidate_generator.rounds
        online.append([r["accepted"] for r in rounds])
        last = rounds[-1]
        eos_accepted += last["tokens"][-1] == eos and last["accepted"] == len(last["tokens"]) - 1
    assert eos_accepted, "no row ended on an accepted drafted EOS: the case under test did not occur"
    engine = SpeculativeEngine(target, drafter, max_len=128)
    assert engine.generate(prompts, max_new_tokens=max_new, eos_token_id=eos) == refs
    assert engine.rounds == online


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_rounds_equal_generate_after_a_drafted_eos(typ):
    """A draft that contains EOS mid-sequence (rejected there): generate() crops the draft after the EOS, so it
    verifies and carries fewer rows. The engine must do the same, or a Carryover drafter's next round differs
    (seen on the real target: one ShareGPT prompt of the 2026-11-30b cross-check)."""
    target, drafter, prompts, max_new, refs = _trained_setup(typ, True, steps=25)
    drafter.record_carryover = True
    candidates = {}  # token -> how many mid-sequence drafts it appears in after the accepted prefix
    for p in prompts:
        target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
        for r in drafter.last_candidate_generator.rounds[:-1]:
            for t in set(r["tokens"][r["accepted"] + 1 :]):
                candidates[t] = candidates.get(t, 0) + 1
    assert candidates, "the drafter's drafts were never rejected"
    emitted = {t for r in refs for t in r}  # prefer an EOS the target never emits: then no row stops early
    eos = max(candidates, key=lambda t: (t not in emitted, candidates[t]))
    refs = _greedy_refs(target, prompts, max_new, eos=eos)
    online, online_rows = [], []
    for p in prompts:
        target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=max_new, do_sample=False,
                        eos_token_id=eos)
        gen = drafter.last_candidate_generator
        online.append([r["accepted"] for r in gen.rounds])
        online_rows.append([0 if c["features"] is None else c["features"].shape[1] for c in gen.rounds_carryover])
    engine = SpeculativeEngine(target, drafter, max_len=128)
    carried = []  # per engine round: carryover rows each batch row hands its drafter
    draft = engine._draft

    def spy(*args):
        carried.append(args[5].sum(1).tolist())  # carry_valid [b, k]
        return draft(*args)

    engine._draft = spy
    assert engine.generate(prompts, max_new_tokens=max_new, eos_token_id=eos) == refs
    assert engine.rounds == online
    for r in range(len(prompts)):  # the same carryover rows, round by round (each row's own rounds)
        assert [c[r] for c in carried[: len(online_rows[r])]] == online_rows[r], r


@pytest.mark.parametrize("typ", ["dflash", "markov", None])
def test_sampling_matches_target_distribution(typ):
    """Chi-square two-sample tests at alpha = 0.001 (per position and adjacent pairs), as in test_sampling.py:
    engine samples (one batch of N rows, so rows advance independently) against the target's own sampling.
    typ None: plain AR sampling through the engine (no drafts, every token from the bonus slot)."""
    n = 2000
    target = _target()
    drafter = _drafter(target, typ) if typ else None
    torch.manual_seed(11)
    plain = target.generate(PROMPT.repeat(n, 1), max_new_tokens=NEW, do_sample=True, top_k=0)[:, PROMPT.shape[1]:]
    engine = SpeculativeEngine(target, drafter, max_len=32)
    spec = engine.generate([PROMPT[0].tolist()] * n, max_new_tokens=NEW, do_sample=True, seed=12)
    assert all(len(s) == NEW for s in spec)
    if drafter is not None:
        rejected = sum(a < drafter.config.num_proposals for rows in engine.rounds for a in rows)
        assert rejected > n // 4, "rejections must be frequent for the test to mean anything"
    pvals = _pvalues([tuple(s) for s in spec], [tuple(s) for s in plain.tolist()])
    assert min(pvals.values()) > ALPHA, pvals
    assert max(max(s) for s in spec) < VOCAB16


def test_inverse_cdf_draws():
    """The engine's categorical draw from given uniforms: u=0 gives the first token with mass, u just below 1 the
    last one, zero-mass tokens are never chosen (even at the edges, where u*total rounds up to total), rows are
    independent, and many uniforms reproduce the probabilities."""
    from hf_carryover.engine.engine import inverse_cdf

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 2]
    assert inverse_cdf(probs, torch.stack([below_one, below_one])).tolist() == [4, 2]
    assert inverse_cdf(probs * 7, torch.tensor([0.25, 0.5])).tolist() == [3, 2]  # unnormalised mass is fine
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    draws = inverse_cdf(probs[:1].expand(len(u), -1), u)
    freq = torch.bincount(draws, minlength=6).float() / len(u)
    assert freq[[0, 2, 5]].sum() == 0 and torch.allclose(freq, probs[0], atol=0.005)


def test_running_mass_is_a_cumsum_with_exact_steps_at_zero_mass():
    """The draw's running sum (two scans of short rows, so CUDA adds in a fixed order): equal to cumsum up to float
    rounding, for a vocabulary that is not a multiple of the chunk; a zero-mass token's sum equals its predecessor's
    exactly, also where a chunk starts, and the sum never decreases."""
    from hf_carryover.engine.engine import running_mass

    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(3, 1000, generator=g) * 3).softmax(-1)
    probs[:, [0, 255, 256, 512, 999]] = 0.0  # zero mass at chunk edges (chunk 256) and at both ends
    for p in (probs, probs[:1]):
        cdf = running_mass(p)
        assert cdf.shape == p.shape and torch.allclose(cdf, p.double().cumsum(-1).float(), atol=1e-6)
        assert (cdf[:, 1:] >= cdf[:, :-1]).all()
        assert (cdf[:, 256] == cdf[:, 255]).all() and (cdf[:, 255] == cdf[:, 254]).all() and (cdf[:, 0] == 0).all()
        assert (cdf[:, 512] == cdf[:, 511]).all() and (cdf[:, 999] == cdf[:, 998]).all()
    assert torch.equal(running_mass(probs[:, :200]), probs[:, :200].cumsum(-1))  # one chunk: the plain scan


def test_running_mass_never_scans_one_long_row(monkeypatch):
    """The property that makes seeded sampling repeat on CUDA: no scan whose tensor is a single row along the scanned
    dim (CUDA runs those as a look-back scan whose float sums vary between launches), even for one row of a 49152-token
    vocabulary; the draw is unchanged by how many rows are drawn at once."""
    from hf_carryover.engine.engine import inverse_cdf, running_mass

    scans, cumsum = [], torch.Tensor.cumsum

    def spy(self, dim, *args, **kwargs):
        scans.append((self.numel(), self.shape[dim]))
        return cumsum(self, dim, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cumsum", spy)
    probs = (torch.randn(2, 49152, generator=torch.Generator().manual_seed(1)) * 3).softmax(-1)
    running_mass(probs[:1])
    assert scans and all(numel > length for numel, length in scans), scans
    u = torch.tensor([0.3, 0.9])
    assert inverse_cdf(probs, u).tolist() == [inverse_cdf(probs[i : i + 1], u[i : i + 1]).item() for i in range(2)]


def test_engine_decodes_in_eval_mode_and_leaves_the_callers_modes():
    """A target in training mode with dropout still decodes greedily (the engine switches to eval mode for the call),
    and afterwards every submodule of target and drafter has the mode it had before, mixed modes included."""
    target = build_target("llama", seed=3)
    drafter = build_drafter(target, "dflash", True)
    prompts = [[5, 9, 3, 7], [11, 4]]
    ref = _greedy_refs(target, prompts, 12)
    target.config.attention_dropout = 0.5
    for layer in target.model.layers:
        layer.self_attn.attention_dropout = 0.5
    target.train()
    drafter.train()
    drafter.fc.eval()  # a submodule the caller keeps in eval mode
    with torch.no_grad():  # dropout at 0.5 really changes the output in training mode, so the test can fail
        x = torch.tensor([prompts[0]])
        assert not torch.equal(target(x).logits, target(x).logits)
    eng = SpeculativeEngine(target, drafter, max_len=64)
    assert eng.generate(prompts, max_new_tokens=12) == ref
    assert target.training and all(m.training for m in target.modules())
    assert drafter.training and not drafter.fc.training
