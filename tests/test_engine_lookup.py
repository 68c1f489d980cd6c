"""Context lookup in the fast engine (`SpeculativeEngine.generate(prompt_lookup_num_tokens=N)`), eager on CPU.

The engine's lookup is a fixed-shape batched twin of the generate() path's: the same matches (compared on random
sequences), the same rounds as generate() with the same knob at T=0 (round for round, lookup rounds included),
greedy output equal to plain greedy decoding, and sampled output that follows the target's law.
"""

import random

import pytest
import torch
from conftest import build_drafter, build_target
from test_context_lookup import PROMPT_LOOP
from test_engine import _greedy_refs, _trained_setup
from test_sampling import ALPHA, NEW, PURE, _drafter, _pvalues, _target

from hf_carryover.engine import capture as capture_mod
from hf_carryover.engine import engine as engine_mod
from hf_carryover.engine import linear_round
from hf_carryover.engine import refill as refill_mod
from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.generation_carryover import batched_context_lookup, context_lookup


# (a, c, x) for every token x, then (a, c): the first round looks up whatever the prefill chose
LOOPING_PROMPTS = [[t for x in range(96) for t in (a, c, x)] + [a, c] for a, c in ((7, 1), (5, 2))]


def naive_lookup(tokens, num, max_ngram=4, min_ngram=3):
    """The rule written as plainly as possible: the longest suffix n-gram (max_ngram..min_ngram) that occurs earlier,
    its earliest occurrence, and up to `num` tokens that follow it inside the sequence."""
    t = len(tokens) - 1
    for n in range(max_ngram, min_ngram - 1, -1):
        if t < n:
            continue
        for s in range(0, t - n + 1):
            if tokens[s : s + n] == tokens[t - n + 1 :]:
                return tokens[s + n : s + n + num], n
    return [], 0


def test_batched_lookup_equals_the_list_lookup():
    """Random short sequences over a 3-token alphabet (so 3- and 4-gram repeats are common, with and without a
    longer match), padded with junk past each row's length: every row's tokens, count and matched n-gram equal the
    plain rule's, and so do the list wrapper's (the generate() path and the offline replay use them)."""
    rng = random.Random(0)
    for k, num in [(5, 5), (5, 3), (8, 20)]:
        rows = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(64)]
        S = 40
        seq = torch.tensor([r + [rng.randrange(4, 9) for _ in range(S - len(r))] for r in rows])
        tokens, n, ngram = batched_context_lookup(seq, torch.tensor([len(r) for r in rows]), k, num)
        hits = 0
        for r, t, m, g in zip(rows, tokens.tolist(), n.tolist(), ngram.tolist()):
            ref = naive_lookup(r, min(k, num))
            assert (t[:m], g if m else 0) == ref, (r, t, m, g, ref)
            assert context_lookup(r, min(k, num)) == ref
            hits += m > 0
        assert 10 < hits < 64  # both outcomes occur


def _online(target, drafter, prompts, max_new, lookup, **kw):
    outs, rounds = [], []
    for p in prompts:
        y = target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=max_new, do_sample=False,
                            prompt_lookup_num_tokens=lookup, **kw)
        outs.append(y[0, len(p):].tolist())
        rounds.append([(r["accepted"], r.get("source") == "lookup") for r in drafter.last_candidate_generator.rounds])
    return outs, rounds


@pytest.mark.parametrize("typ", ["dflash", "markov"])
@pytest.mark.parametrize("carryover", [False, True], ids=["nocarry", "carry"])
def test_engine_lookup_rounds_equal_generate(typ, carryover):
    """A drafter that is often right and prompts that repeat themselves: the engine's output is plain greedy
    decoding, and its rounds (accepted counts, and which rounds looked up) are generate()'s, round for round,
    including rounds near max_new_tokens and a lookup shorter than the block."""
    target, drafter, prompts, max_new, _ = _trained_setup(typ, carryover, steps=60)
    prompts = [p + p[:5] + p for p in prompts]  # loops in the prompt: lookups from the first round on
    refs = _greedy_refs(target, prompts, max_new)
    lookup = 6  # below the block's 7 proposals: lookups are shorter than drafts
    outs, online = _online(target, drafter, prompts, max_new, lookup)
    assert outs == refs
    engine = SpeculativeEngine(target, drafter, max_len=160)
    assert engine.generate(prompts, max_new_tokens=max_new, prompt_lookup_num_tokens=lookup) == refs
    assert [list(zip(a, lk)) for a, lk in zip(engine.rounds, engine.lookup_rounds)] == online
    n_look = sum(map(sum, engine.lookup_rounds))
    assert 0 < n_look < sum(map(len, engine.rounds))  # both kinds of round occur
    # the same engine without lookup: no lookup rounds, and the plain rounds come back
    assert engine.generate(prompts, max_new_tokens=max_new) == refs
    assert not any(map(any, engine.lookup_rounds))


def test_engine_lookup_with_eos_and_no_drafter():
    """Plain prompt-lookup decoding (no drafter; k = N) and a drafter with an EOS list: greedy output equals plain
    greedy decoding row for row; rows stop at their EOS."""
    target = build_target("llama")
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (4, 9, 6)]
    prompts = [p + p + p[:3] for p in base]
    free = _greedy_refs(target, prompts, 30)
    eos = free[1][7]
    for drafter in (None, build_drafter(target, "dflash", True)):
        for kw, refs in (({}, free), ({"eos_token_id": eos}, _greedy_refs(target, prompts, 30, eos=eos))):
            engine = SpeculativeEngine(target, drafter, max_len=128)
            assert engine.generate(prompts, max_new_tokens=30, prompt_lookup_num_tokens=5, **kw) == refs
            assert any(map(any, engine.lookup_rounds))


def _sample_engine_with_lookup(target, drafter, n=2000):
    """n engine samples of PROMPT_LOOP with 3-token lookups (the first round looks up whatever the prefill sampled),
    the target's own n samples, and the engine (for its rounds)."""
    torch.manual_seed(5)
    prompt = PROMPT_LOOP
    plain = target.generate(prompt.repeat(n, 1), max_new_tokens=NEW, do_sample=True, **PURE)[:, prompt.shape[1]:]
    engine = SpeculativeEngine(target, drafter, max_len=prompt.shape[1] + NEW + 40)
    spec = engine.generate([prompt[0].tolist()] * n, max_new_tokens=NEW, do_sample=True, seed=6,
                           prompt_lookup_num_tokens=3)
    return [tuple(s) for s in spec], [tuple(s) for s in plain.tolist()], engine


@pytest.mark.parametrize("typ", ["dflash", "markov", None])
def test_engine_lookup_sampling_follows_the_target(typ):
    """Chi-square tests at alpha = 0.001 against the target's own sampling, with a prompt that makes the first
    round look up whatever the prefill sampled: looked-up tokens are point masses, kept with the target's probability
    of them, and a filler slot past a short lookup samples the target itself."""
    n = 2000
    target = _target()
    spec, plain, engine = _sample_engine_with_lookup(target, _drafter(target, typ) if typ else None, n)
    looked = [(a, lk) for rows, lks in zip(engine.rounds, engine.lookup_rounds) for a, lk in zip(rows, lks) if lk]
    assert len(looked) > 0.3 * n
    assert any(a > 0 for a, _ in looked) and any(a < 3 for a, _ in looked)
    pvals = _pvalues(spec, plain)
    assert min(pvals.values()) > ALPHA, pvals


def test_engine_lookup_negative_control(monkeypatch):
    """The sampling test has power: if the verifier is told a looked-up token was drawn uniformly (it was not), the
    chi-square test rejects."""

    def uniform(tokens, vocab):
        return torch.full((*tokens.shape, vocab), 1.0 / vocab)

    monkeypatch.setattr(linear_round, "point_mass", uniform)
    spec, plain, _ = _sample_engine_with_lookup(_target(), None)
    assert min(_pvalues(spec, plain).values()) < ALPHA


def test_bad_engine_lookup_setting_is_named():
    target = build_target("llama")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=0"):
        SpeculativeEngine(target, None, max_len=32).generate([[3, 7, 1]], max_new_tokens=4,
                                                             prompt_lookup_num_tokens=0)


def test_engine_lookup_compiled_and_graph_plumbing(monkeypatch):
    """Lookup rounds through torch.compile ("aot_eager": the same graphs and breaks as inductor, without its code
    generation; greedy: one graph; sampled: breaks only at the draws' sums) and through the cuda_graphs control flow
    (an eager stand-in on CPU): the eager lookup engine's tokens and rounds, greedy and sampled; a lookup setting is
    its own captured shape."""
    from test_engine_capture import _fake_capture

    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    prompts = LOOPING_PROMPTS
    kw = dict(max_new_tokens=20, prompt_lookup_num_tokens=4)
    eager = SpeculativeEngine(target, drafter, max_len=340)
    ref = eager.generate(prompts, **kw)
    ref_rounds = (eager.rounds, eager.lookup_rounds)
    assert any(map(any, eager.lookup_rounds))
    sampled = eager.generate(prompts, do_sample=True, temperature=0.8, seed=3, **kw)
    sampled_rounds = (eager.rounds, eager.lookup_rounds)

    fast = SpeculativeEngine(target, drafter, max_len=340, compile="aot_eager")  # tracing as inductor's; test_engine
    # runs the one inductor compile
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert fast.generate(prompts, **kw) == ref and (fast.rounds, fast.lookup_rounds) == ref_rounds
    assert not counters["graph_break"], dict(counters["graph_break"])  # greedy lookup rounds: whole graphs
    assert fast.generate(prompts, do_sample=True, temperature=0.8, seed=3, **kw) == sampled
    assert (fast.rounds, fast.lookup_rounds) == sampled_rounds
    # sampled ones break only around the draws' running sums (`running_mass`, left to ATen's fixed-order scans)
    breaks = counters["graph_break"]
    assert breaks and all("running_mass" in reason for reason in breaks), dict(breaks)

    monkeypatch.setattr(engine_mod, "_is_cuda", lambda dev: True)
    captured = []
    monkeypatch.setattr(capture_mod, "capture_round", _fake_capture(captured))
    monkeypatch.setattr(refill_mod, "capture_round", _fake_capture([]))  # the row prefill's graphs: stand-ins too
    graphed = SpeculativeEngine(target, drafter, max_len=340, cuda_graphs=True)
    plain = graphed.generate(prompts, max_new_tokens=20)
    assert graphed.generate(prompts, **kw) == ref and (graphed.rounds, graphed.lookup_rounds) == ref_rounds
    # without lookup one round and the call's start; with lookup two rounds (drafted, and skipping the drafter) and a
    # start that computes the first lookup
    assert graphed.last_mode == "cuda_graph" and len(captured) == 5
    assert graphed.skipped_drafts > 0
    assert plain == ref  # greedy either way
    # sampled lookup rounds through the same loop (two more captures): the eager engine's tokens and rounds
    assert graphed.generate(prompts, do_sample=True, temperature=0.8, seed=3, **kw) == sampled
    assert (graphed.rounds, graphed.lookup_rounds) == sampled_rounds and len(captured) == 7


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_rounds_that_all_look_up_skip_the_drafter(do_sample):
    """With lookup_skips_drafter (the default) a round in which every unfinished row looks up runs without the
    drafter: the drafter's forward runs that many times fewer, and tokens and rounds are exactly those of an engine
    that drafts every round (greedy; sampled with the same seed). A batch whose rows do not all look up together skips
    only the rounds where they do."""
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    calls = []
    drafter.register_forward_hook(lambda *a: calls.append(1))
    looping = LOOPING_PROMPTS
    g = torch.Generator().manual_seed(4)
    mixed = [looping[0], torch.randint(1, 90, (40,), generator=g).tolist()]  # the second row rarely looks up
    kw = dict(max_new_tokens=24, prompt_lookup_num_tokens=4, do_sample=do_sample, temperature=0.8, seed=3)
    for prompts in (looping, mixed, looping[:1]):
        out = {}
        for skip in (False, True):
            calls.clear()
            # run_ahead off: the drafting engine would otherwise run one more round (and drafter call) at the end
            engine = SpeculativeEngine(target, drafter, max_len=340, lookup_skips_drafter=skip, run_ahead=False)
            out[skip] = (engine.generate(prompts, **kw), engine.rounds, engine.lookup_rounds, len(calls),
                         engine.skipped_drafts)
        assert out[True][:3] == out[False][:3]
        assert out[False][4] == 0 and out[True][3] == out[False][3] - out[True][4]
        if prompts is looping or len(prompts) == 1:
            assert out[True][4] > 0
        # a skipped round is one in which every unfinished row looked up
        assert out[True][4] <= min(sum(lk) for lk in out[True][2])
