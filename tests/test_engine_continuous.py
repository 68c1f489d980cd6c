"""Continuous batching in the fast engine (`generate(..., batch_size=b)`, CPU, eager): a prompt's output and rounds do
not depend on which rows it shared the batch with or when it was loaded, and sampling still follows the target."""

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs, _prompts, _trained_setup
from test_sampling import ALPHA, NEW, PROMPT, VOCAB16, _drafter, _pvalues, _target

from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.engine.tree import TreeSpec

WIDE = TreeSpec([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)])


def _alone(engine, prompts, **kw):
    """Each prompt in a call of its own: outputs, rounds and lookup flags (the reference for every batching)."""
    outs, rounds, looked = [], [], []
    for p in prompts:
        outs += engine.generate([p], **kw)
        rounds += engine.rounds
        looked += engine.lookup_rounds
    return outs, rounds, looked


@pytest.mark.parametrize("typ,carryover,extra", [
    (None, False, {}),
    ("dflash", True, {}),
    ("markov", True, {}),
    ("dflash", False, {"prompt_lookup_num_tokens": 4}),
    ("dflash", True, {"prompt_lookup_num_tokens": 4}),
    (None, False, {"prompt_lookup_num_tokens": 3}),
    ("dflash", True, {"tree": WIDE, "tree_nodes": 5}),
])
def test_continuous_batching_equals_each_prompt_alone(typ, carryover, extra):
    """Seven prompts of mixed lengths (the longest first, so refilled rows run over stale cache positions) through 3
    rows, with an EOS that ends some rows early: every prompt's output is plain greedy decoding's, and its rounds (and
    lookup flags) are the ones it gets in a call of its own."""
    target, drafter, prompts, max_new, _ = _trained_setup(typ or "dflash", carryover, steps=60)
    drafter = drafter if typ == "dflash" or typ is None else build_drafter(target, typ, carryover)
    drafter = drafter if typ else None
    prompts = _prompts(7, (13, 3, 9, 1, 6, 11, 4)) + prompts[:1]
    eos = _greedy_refs(target, prompts[:1], 12)[0][11]  # a token prompt 0 emits at step 12
    kw = dict(max_new_tokens=max_new, eos_token_id=eos, **extra)
    engine = SpeculativeEngine(target, drafter, max_len=96)
    refs = _greedy_refs(target, prompts, max_new, eos=eos)
    assert len(refs[0]) <= 12 < max_new
    alone = _alone(engine, prompts, **kw)
    assert alone[0] == refs
    for b in (3, 1, len(prompts) + 4):
        out = engine.generate(prompts, batch_size=b, **kw)
        assert (out, engine.rounds, engine.lookup_rounds) == alone, b
        if typ is not None or extra:
            assert sum(map(len, engine.rounds)) > 0


def test_continuous_batching_refills_as_rows_finish():
    """The number of rounds of a continuous call: less than serving the same prompts in static batches of the same
    size, because a row that finishes early is given the next prompt instead of idling until the batch's slowest
    row ends (here: budgets of very different length through an EOS)."""
    target = build_target("llama", seed=5)
    engine = SpeculativeEngine(target, None, max_len=96)
    prompts = _prompts(8, (3, 5, 2, 7, 4, 6))
    free = _greedy_refs(target, prompts, 40)
    eos = free[0][2]  # ends prompt 0 (and maybe others) early
    calls = []
    engine.round_hook = lambda st: calls.append(1)
    engine.generate(prompts, max_new_tokens=40, eos_token_id=eos, batch_size=2)
    continuous = len(calls)
    calls.clear()
    for i in range(0, len(prompts), 2):
        engine.generate(prompts[i : i + 2], max_new_tokens=40, eos_token_id=eos)
    static = len(calls)
    lengths = [len(r) for r in _greedy_refs(target, prompts, 40, eos=eos)]
    assert min(lengths) < 10 and max(lengths) == 40
    assert continuous < static
    # 2 rows cannot emit more than 2 tokens a round: at least half the tokens' worth of rounds (minus prefills' tokens)
    assert continuous >= (sum(lengths) - len(prompts)) / 2


def test_continuous_sampling_matches_target_distribution():
    """Chi-square tests at alpha = 0.001 as in test_engine.py: 2000 requests through 48 rows (each row serves ~40
    prompts one after another, its refill sampling the first token) against the target's own sampling."""
    n = 2000
    target = _target()
    drafter = _drafter(target, "dflash")
    torch.manual_seed(11)
    plain = target.generate(PROMPT.repeat(n, 1), max_new_tokens=NEW, do_sample=True, top_k=0)[:, PROMPT.shape[1]:]
    engine = SpeculativeEngine(target, drafter, max_len=32)
    spec = engine.generate([PROMPT[0].tolist()] * n, max_new_tokens=NEW, do_sample=True, seed=12, batch_size=48)
    assert len(spec) == n and all(len(s) == NEW for s in spec)
    rejected = sum(a < drafter.config.num_proposals for rows in engine.rounds for a in rows)
    assert rejected > n // 4, "rejections must be frequent for the test to mean anything"
    pvals = _pvalues([tuple(s) for s in spec], [tuple(s) for s in plain.tolist()])
    assert min(pvals.values()) > ALPHA, pvals
    assert max(max(s) for s in spec) < VOCAB16


def test_batch_size_errors():
    target = build_target("llama")
    engine = SpeculativeEngine(target, None, max_len=64)
    with pytest.raises(ValueError, match="batch_size=0"):
        engine.generate([[1, 2]], batch_size=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], batch_size=2)
    for bad in ("yes", 0, -2, 2.0):
        with pytest.raises(ValueError, match=f"prefill_ahead={bad!r}: True, False or a number of prompts"):
            SpeculativeEngine(target, None, max_len=64, prefill_ahead=bad)


def test_restart_loads_flagged_rows_as_start_loads_all():
    """`stage_rows` + `restart` leave row r exactly as `stage` + `start` (a call's start) leave a row with that prompt
    (whatever a finished request left there: stale carryover rows, lookup, round counters) and touch no other row,
    flags aside (per batch: recomputed)."""
    target = build_target("llama")
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", True), max_len=64)
    engine.generate(_prompts(9, (5, 8, 6)), max_new_tokens=10, prompt_lookup_num_tokens=3)
    (st,) = engine._states.values()
    g = torch.Generator().manual_seed(0)
    own = st.tensors()[:15]  # the state's own tensors (the caches follow)
    for t in own + [st.prompt, st.plen, st.first]:  # garbage everywhere, as a finished request might leave it
        t.copy_(torch.randint(0, 2, t.shape, generator=g).to(t.dtype) if t.dtype == torch.bool else
                torch.randint(1, 50, t.shape, generator=g).to(t.dtype))
    before = [t.clone() for t in own]
    prompts = [[4, 9, 2, 7], [8, 1]]
    st.stage_rows([2, 0], prompts)  # two rows at once, out of order
    st.first[2], st.first[0] = 11, 12
    st.restart()
    fresh = [t.clone() for t in own]
    st.stage([prompts[1], [5, 6], prompts[0]], st.eos.clone())
    st.first.copy_(torch.tensor([12, 3, 11]))
    st.start()
    names = "anchor anchor_pos n_out done out accepted round carry_valid carry_pos seq looked look n_look flags carry"
    for name, new, old, ref in zip(names.split(), fresh, before, own):
        if name == "flags":
            continue
        assert torch.equal(new[1], old[1]), name  # the other row: untouched
        assert torch.equal(new[[0, 2]], ref[[0, 2]]), name
    assert st.flags[2:].tolist() == st.done.tolist()


def test_row_prefill_equals_batched_prefill():
    """Static batches prefilled row by row through the refill's width buckets (what a call does where rounds are
    captured, `SpeculativeEngine.row_prefill`) decode exactly as with one batched prefill: same tokens, same rounds,
    greedy and sampled (the first token's draw consumes the generator the same way). One trained setup serves every
    configuration (training is most of the time)."""
    target, drafter, prompts, max_new, _ = _trained_setup("dflash", True, steps=60)
    prompts = _prompts(7, (13, 3, 9)) + prompts[:1]
    configs = [(None, {}), (drafter, {}), (drafter, {"prompt_lookup_num_tokens": 4}),
               (drafter, {"tree": WIDE, "tree_nodes": 5}), (drafter, {"do_sample": True, "seed": 3})]
    for d, extra in configs:
        engine = SpeculativeEngine(target, d, max_len=96)
        kw = dict(max_new_tokens=max_new, **extra)
        for batch in (prompts, prompts[:1]):
            engine.row_prefill = False
            ref = engine.generate(batch, **kw), engine.rounds
            assert not engine._prefills
            engine.row_prefill = True
            assert (engine.generate(batch, **kw), engine.rounds) == ref, (d is None, extra, len(batch))
            assert engine._prefills  # the row prefill really ran
            engine._prefills.clear()


def test_run_ahead_queues_the_next_round_behind_a_refill():
    """`graphs.run_ahead` with refills, on a stand-in decoder (rows with a number of rounds left): after a read that
    refilled rows, the next round is queued before the host reads again (the queue never drains for a refill), and
    every prompt still gets all its rounds. Fails on the loop before 2026-12-05, which read again first."""
    from hf_carryover.engine.graphs import run_ahead

    budgets = [3, 5, 1, 4, 2, 6, 2]  # rounds each prompt needs, served through 2 rows
    left = torch.tensor(budgets[:2])  # rounds left per row
    flags = torch.zeros(4, dtype=torch.bool)  # [all done, (unused), row 0 done, row 1 done]
    waiting, served, events = list(range(2, len(budgets))), {0: 0, 1: 0}, []
    slot = [0, 1]

    def set_flags():
        flags[2:] = left == 0
        flags[0] = bool((left == 0).all())

    def launch():  # one round: every unfinished row advances
        events.append("launch")
        for r in range(2):
            if left[r] > 0:
                left[r] -= 1
                served[slot[r]] += 1
        set_flags()

    def on_read(host):
        events.append("read")
        rows = [r for r in range(2) if host[2 + r] and waiting]
        for r in rows:
            slot[r] = waiting.pop(0)
            served[slot[r]] = 0
            left[r] = budgets[slot[r]]
        set_flags()
        if rows:
            events.append("refill")
        return bool(rows)

    set_flags()
    launched = run_ahead(launch, flags, on_read)
    assert served == dict(enumerate(budgets))  # every prompt decoded all its rounds
    assert not waiting and events.count("refill") >= 3
    for i, e in enumerate(events):
        if e == "refill":
            assert events[i + 1] == "launch", events  # the next round is queued before the next read
    assert launched == events.count("launch")


@pytest.mark.parametrize("ahead_n", [True, 3])
def test_prefill_ahead_gives_the_same_tokens_and_rounds(ahead_n):
    """`prefill_ahead=True` (the next waiting prompt's forward run early, then copied into the row that frees first)
    and `prefill_ahead=3` (the next three in one forward, each in a staging slot of its own; the call's first rows
    and unstaged refills three a forward too): every configuration's outputs, rounds and lookup flags equal the plain
    refill's, greedy and sampled (the first token's draw consumes the generator at the same point), through 3 rows
    and through 1; and the staged prompts were really loaded. A prompt left staged by an earlier call (as an
    interrupted one would leave it) is not loaded."""
    from hf_carryover.engine.refill import RowPrefill

    target, drafter, prompts, max_new, _ = _trained_setup("dflash", True, steps=60)
    prompts = _prompts(7, (13, 3, 9, 1, 6, 11, 4)) + prompts[:1]
    eos = _greedy_refs(target, prompts[:1], 12)[0][11]
    loads = []
    real_load = RowPrefill.load

    def counting_load(self, r, key=None):
        loads.append(r)
        return real_load(self, r, key)

    configs = [(None, {}), (drafter, {}), (drafter, {"prompt_lookup_num_tokens": 4}),
               (drafter, {"tree": WIDE, "tree_nodes": 5}), (drafter, {"do_sample": True, "seed": 3}),
               (drafter, {"tree": WIDE, "do_sample": True, "seed": 4})]
    for d, extra in configs:
        kw = dict(max_new_tokens=max_new, eos_token_id=eos, **extra)
        plain = SpeculativeEngine(target, d, max_len=96, prefill_ahead=False)
        ahead = SpeculativeEngine(target, d, max_len=96, prefill_ahead=ahead_n)  # (True: the default)
        slots = 1 if ahead_n is True else ahead_n
        for b in (3, 1, 3):
            for pf in (plain._prefills.get((b, False, 1)), ahead._prefills.get((b, False, slots))):
                if pf is not None:  # staged by a call that never loaded it: its key is a prompt index of this call
                    pf.ahead([3], [prompts[-1]])
            want = plain.generate(prompts, batch_size=b, **kw), plain.rounds, plain.lookup_rounds
            loads.clear()
            RowPrefill.load = counting_load
            try:
                got = ahead.generate(prompts, batch_size=b, **kw), ahead.rounds, ahead.lookup_rounds
            finally:
                RowPrefill.load = real_load
            assert got == want, (d is None, extra, b)
            assert len(loads) >= 3, loads  # most refills took the prompt prefilled ahead
            assert ahead._prefills[(b, False, slots)].staged == {}  # every staged prompt was used


def test_prefill_ahead_writes_only_its_staging_buffers():
    """Why the staged forward may run on a side stream beside the rounds: `RowPrefill.ahead` leaves every tensor a
    round reads or writes (the state and the batch's caches) as it was, and `load(r)` then changes row r of the
    caches only. The Triton attention's split counters of the prefill's lane are not the rounds'."""
    from hf_carryover.engine import triton_attention as ta

    target = build_target("llama")
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", True), max_len=64)
    engine.generate(_prompts(9, (5, 8, 6, 7)), max_new_tokens=10, batch_size=3)
    (st,) = engine._states.values()
    (pf,) = engine._prefills.values()
    before = [t.clone() for t in st.tensors()]
    pf.ahead(["next"], [[4, 9, 2, 7, 3]])
    assert all(torch.equal(a, t) for a, t in zip(before, st.tensors()))
    assert pf.staged == {"next": (0, 5, pf.width(5))}
    pf.load(1, "next")
    caches = st.cache.k + st.cache.v + st.dcache.keys + st.dcache.values
    old = before[-len(caches):]
    assert all(torch.equal(a[[0, 2]], t[[0, 2]]) for a, t in zip(old, caches))  # the other rows: untouched
    assert any(not torch.equal(a[1], t[1]) for a, t in zip(old, caches))
    assert pf.staged == {}
    with pytest.raises(RuntimeError, match="no prompt was staged"):
        pf.load(0)
    with pytest.raises(ValueError, match="1 to 1 prompts with one key each"):
        pf.ahead([1, 2], [[4, 9], [5]])
    dev = torch.device("cpu")
    with ta.counter_lane("row_prefill"):
        mine = ta._counters(dev, 8)
    assert ta._counters(dev, 8) is not mine and ta._counters(dev, 8) is ta._counters(dev, 4)


def test_staging_slots_prefill_each_prompt_as_alone():
    """`prefill_ahead=N`'s staging slots are independent: three prompts of different widths staged in one forward
    (`RowPrefill.ahead`) and loaded in another order write each batch row's caches (target and drafter) and give its
    logits as the one-slot prefill of that prompt alone does (at the prompt's positions), and leave the other rows as
    they were; a key that was not staged is refused by name. (Equal up to float rounding, not bitwise: a GEMM of three
    prompts' rows may sum in another order than one of one prompt's, as any batched forward; the tokens are compared
    exactly in `test_prefill_ahead_gives_the_same_tokens_and_rounds`.)"""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True)
    one = SpeculativeEngine(target, drafter, max_len=300)
    three = SpeculativeEngine(target, drafter, max_len=300, prefill_ahead=3)
    prompts = _prompts(4, (5, 140, 2))  # width buckets 128, 256, 128: the group's forward pads all three to 256
    with torch.no_grad():
        for engine in (one, three):
            engine.generate(_prompts(9, (5, 8, 6, 7)), max_new_tokens=10, batch_size=3)
    (st1,), (pf1,) = one._states.values(), one._prefills.values()
    (st3,), (pf3,) = three._states.values(), three._prefills.values()
    assert (pf1.slots, pf3.slots) == (1, 3)

    def caches(st):
        return st.cache.k + st.cache.v + st.dcache.keys + st.dcache.values

    for st in (st1, st3):  # both batches' caches from the same start
        for t in caches(st):
            t.zero_()
    pf3.ahead(["a", "b", "c"], prompts)
    assert pf3.staged == {"a": (0, 5, 256), "b": (1, 140, 256), "c": (2, 2, 256)}
    with pytest.raises(KeyError, match="'d' was not staged"):
        pf3.load(0, "d")
    got = {r: pf3.load(r, key).clone() for r, key in ((2, "c"), (0, "a"))}  # "b" stays staged
    assert list(pf3.staged) == ["b"]
    for r, p in ((2, prompts[2]), (0, prompts[0])):
        pf1.ahead([r], [p])
        torch.testing.assert_close(pf1.load(r, r), got[r], rtol=1e-5, atol=1e-5)
    for big3, big1 in zip(caches(st3), caches(st1)):  # rows 0 and 2 as prefilled alone, at the prompts' positions
        for r, n in ((0, 5), (2, 2)):  # (past them: pad rows of another width, never seen, `refill.py`)
            torch.testing.assert_close(big3[r, :, :n], big1[r, :, :n], rtol=1e-5, atol=1e-5)
    assert not any(t[1].any() for t in caches(st3))  # row 1 untouched
    assert all(t[[0, 2]].abs().sum() > 0 for t in caches(st3))  # (rows 0 and 2 were written)
    # one short prompt next (width 128): the slots it leaves unused must not read their last group's positions (139
    # lies past this width)
    pf3.ahead(["d"], [prompts[2]])
    torch.testing.assert_close(pf3.load(1, "d"), got[2], rtol=1e-5, atol=1e-5)
