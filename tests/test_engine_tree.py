"""Tree verification in the fast engine (CPU, eager, fp32): exact greedy output, the chain tree equals linear rounds,
a wider tree accepts at least as much per round, the K/V move, sampled trees that follow the target's law, and clear
errors."""

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs, _prompts, _trained_setup

from test_context_lookup import PROMPT_LOOP
from test_sampling import ALPHA, NEW, PROMPT, PURE, _drafter, _pvalues, _target

from hf_carryover.engine import capture as capture_mod
from hf_carryover.engine import engine as engine_mod
from hf_carryover.engine import refill as refill_mod
from hf_carryover.engine.engine import DecodeState, SpeculativeEngine
from hf_carryover.engine.static_cache import TargetStaticCache
from hf_carryover.engine.tree import (TreeSpec, accept_tree, best_ids, lookup_chain_lp, lookup_ranks, node_ranks,
                                      node_tokens, select_tree, static_tree)

WIDE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("carryover", [False, True])
@pytest.mark.parametrize("lookup", [None, 4])
@pytest.mark.parametrize("nodes", [None, 5])
def test_tree_output_equals_plain_greedy(arch, carryover, lookup, nodes):
    """Any tree, static or chosen per row (nodes=5 of WIDE), untrained drafter (mostly rejections: the K/V move of
    short paths), batch of 4, ends mid-tree."""
    target = build_target(arch)
    prompts = _prompts(0, (1, 6, 13, 4))
    refs = _greedy_refs(target, prompts, 23)
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", carryover), max_len=128)
    out = engine.generate(prompts, max_new_tokens=23, tree=WIDE, prompt_lookup_num_tokens=lookup, tree_nodes=nodes)
    assert out == refs
    assert sum(len(r) for r in engine.rounds) > 0


@pytest.mark.parametrize("carryover", [False, True])
def test_tree_with_a_good_drafter_equals_greedy_and_accepts_more(carryover):
    """A drafter that is often right: long accepted paths (K/V moved past siblings), output still exact; the chain
    tree reproduces the linear rounds exactly (for a Carryover drafter too: its tree rounds carry the rank-0 chain
    below the accepted node, which on the chain tree are the linear round's rows), and a wider tree (a superset of
    the chain) never accepts less per round on these prompts, and here strictly more in total."""
    target, drafter, prompts, max_new, refs = _trained_setup("dflash", carryover, steps=40)
    engine = SpeculativeEngine(target, drafter, max_len=160)
    linear = engine.generate(prompts, max_new_tokens=max_new)
    linear_rounds = engine.rounds
    assert linear == refs
    k = drafter.config.num_proposals
    assert engine.generate(prompts, max_new_tokens=max_new, tree=TreeSpec.chain(k)) == refs
    assert engine.rounds == linear_rounds
    wide = TreeSpec.chain(k).paths + [(1,), (2,), (1, 0), (0, 1), (0, 0, 1), (1, 0, 0), (0, 1, 0)]
    assert engine.generate(prompts, max_new_tokens=max_new, tree=wide) == refs
    tau_linear = sum(len(r) for r in refs) / sum(len(r) for r in linear_rounds)
    assert engine.tau >= tau_linear
    assert sum(len(r) for r in engine.rounds) < sum(len(r) for r in linear_rounds)


def test_compiled_tree_round_equals_eager():
    """A tree round through torch.compile ("aot_eager": inductor's tracing without its CPU code generation; the
    inductor-compiled tree round ran on the H200 in examples/results/h200-2026-12-01h) gives the eager tokens and
    rounds, and the mode says compiled."""
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", False)
    prompts = _prompts(1, (4, 9))
    eager = SpeculativeEngine(target, drafter, max_len=96)
    fast = SpeculativeEngine(target, drafter, max_len=96, compile="aot_eager")
    ref = eager.generate(prompts, max_new_tokens=20, tree=WIDE)
    assert fast.generate(prompts, max_new_tokens=20, tree=WIDE) == ref and fast.rounds == eager.rounds
    assert fast.last_mode == "eager +compile"


@pytest.mark.parametrize("mode", ["tree_lookup", "linear"])
def test_compiled_round_is_one_graph(mode):
    """A compiled round (and the compiled row prefill's two steps) each trace as one graph on a fresh target, but for
    the tree round's one deliberate split (`test_compiled_rounds_write_the_caches_in_place`)
    (`examples/compile_census.py`, which decodes a mode as a user's first call). Until 2026-12-03 two things broke
    them: the tree's tensors were made on the first round, inside the compiled function, and their Python loop broke
    the tree round twice; and transformers installed its hidden-state hooks on the first forward that asked for hidden
    states, inside the compiled prefill or round (`graphs.install_output_hooks`). Inductor then compiled each in
    pieces that could not fuse across the breaks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from compile_census import census

    row = census(mode)
    assert row["last_mode"] == "eager +compile"
    if mode == "linear":  # the row prefill's forward and copy-in, the round; no break
        assert (row["graphs"], row["breaks"]) == (3, 0), row
    else:  # the tree round in two graphs, split on purpose between the verify and the move (`_tree_round`)
        assert (row["graphs"], row["breaks"]) == (4, 1), row
        assert all("graph_break()" in reason for reason in row["reasons"]), row


def _whole_cache_buffers(codes, caches) -> int:
    """Buffers the generated code allocates with as many elements as one of `caches` (a whole-cache copy)."""
    sizes = {c.numel() for c in caches}
    found = 0
    for code in codes:
        for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", code):
            found += torch.Size(int(x) for x in shape.split(",") if x.strip()).numel() in sizes
    return found


def test_compiled_rounds_write_the_caches_in_place():
    """Inductor (its C++ backend here; the decision is the same for Triton) compiles a tree + lookup round at batch 2
    with the eager engine's tokens and rounds, and allocates no buffer the size of a KV cache: every cache write goes
    into the cache in place. Before 2026-12-05 each of the round's `scatter_` writes into a cache became a copy of
    the whole cache, written back at the graph's end (two passes over every layer's K and V a round), and the tree
    round's second write of each cache (the move of the accepted path) did the same until the round was split before
    it. `examples/kernel_census.py` counts the same on the SmolLM2-shaped target."""
    from torch._inductor.utils import run_and_get_code

    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(1, (4, 9))
    kw = dict(max_new_tokens=20, tree=WIDE, tree_nodes=5, prompt_lookup_num_tokens=3)
    eager = SpeculativeEngine(target, drafter, max_len=96)
    ref = eager.generate(prompts, **kw)
    fast = SpeculativeEngine(target, drafter, max_len=96, compile=True)
    torch._dynamo.reset()
    out, codes = run_and_get_code(lambda: fast.generate(prompts, **kw))
    assert out == ref and fast.rounds == eager.rounds and fast.last_mode == "eager +compile"
    cache, dcache = fast._caches[2]
    assert _whole_cache_buffers(codes, cache.k + dcache.keys) == 0
    assert len(codes) == 2  # the round's two graphs (the prefill is the batched eager one)


def test_accept_tree_picks_the_matching_path():
    spec = TreeSpec([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)])  # nodes 1..6 in this (depth) order
    t = static_tree(spec, 1, "cpu")
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])  # node i proposes tokens[i-1]
    # the target chooses 6 after the root (node 2), then 9 after node 2 (node 5); after node 5: 42 (bonus)
    choice = torch.tensor([[6, 0, 9, 0, 0, 42, 0]])
    a, path, nxt = accept_tree(tokens, torch.ones_like(tokens, dtype=torch.bool), choice, t)
    assert a.tolist() == [2] and nxt.tolist() == [42]
    assert path[0, :3].tolist() == [0, 2, 5] and path[0, 3:].tolist() == [3, 4, 5, 6]
    # an invalid node is never accepted, even when it matches
    valid = torch.tensor([[True, False, True, True, True, True]])
    a, path, nxt = accept_tree(tokens, valid, choice, t)
    assert a.tolist() == [0] and nxt.tolist() == [6] and path[0].tolist() == list(range(7))


def _best_first(lp, n):
    """Reference: the n likeliest rank paths (product of per-depth probabilities), grown one node at a time."""
    import heapq

    D, R = lp.shape
    out, heap = [], [(-lp[0, 0].item(), (0,))]
    while heap and len(out) < n:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < D:
            heapq.heappush(heap, (neg - lp[len(path), 0].item(), path + (0,)))
        if path[-1] + 1 < R:
            d = len(path) - 1
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (neg + lp[d, path[-1]].item() - lp[d, path[-1] + 1].item(), sibling))
    return set(out)


def test_select_tree_keeps_the_likeliest_paths_as_a_tree():
    D, R = 5, 4
    full = TreeSpec([p for d in range(1, D + 1) for p in __import__("itertools").product(range(R), repeat=d)])
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, D, 50, generator=g).mul(2).log_softmax(-1).topk(R, -1).values  # [b, D, R], sorted
    t = select_tree(full, lp, 12)
    for r in range(3):
        paths = [full.paths[i - 1] for i in range(1, full.num_nodes + 1)]
        depth, parent, rank = t["depth"][r].tolist(), t["parent"][r].tolist(), t["rank"][r].tolist()
        # rebuild each kept node's rank path from its parent chain
        kept = [()]
        for i in range(1, len(depth)):
            assert parent[i] < i and depth[parent[i]] == depth[i] - 1  # parents first, one level up
            kept.append(kept[parent[i]] + (rank[i],))
        assert set(kept[1:]) == _best_first(lp[r], 12) and set(kept[1:]) <= set(paths)
        anc = t["anc"][r]
        for i in range(len(depth)):  # anc holds exactly the node and its ancestors
            chain, j = {0, i}, i
            while j:
                chain.add(j)
                j = parent[j]
            assert set(anc[i].nonzero()[:, 0].tolist()) == chain


def test_best_ids_keeps_the_best_in_index_order():
    """`best_ids` keeps the n best scores, ties to the lower index (a stable sort's choice), in index order, with
    or without `ranked`; without ties both equal topk + sort."""
    g = torch.Generator().manual_seed(3)
    for score in (torch.randn(3, 200, generator=g), torch.randint(0, 5, (3, 200), generator=g).float()):
        ref = torch.sort(-score, dim=1, stable=True).indices[:, :31].sort(1).values
        assert torch.equal(best_ids(score, 31), ref)
        if score.frac().abs().sum() > 0:
            assert torch.equal(best_ids(score, 31, ranked=False), ref)


def test_tree_topk_choice_gives_the_same_rounds():
    """tree_topk="ranked" (the default) and "torch" pick the same tree nodes on an untrained drafter's logits (no
    ties): same output and rounds, static and dynamic trees, with a lookup; a bad value is refused."""
    target = build_target("llama", seed=4)
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(2, (5, 11))
    for nodes in (None, 6):
        runs = [SpeculativeEngine(target, drafter, max_len=96, tree_topk=how) for how in ("ranked", "torch")]
        outs = [e.generate(prompts, max_new_tokens=20, tree=WIDE, tree_nodes=nodes, prompt_lookup_num_tokens=3)
                for e in runs]
        assert outs[0] == outs[1] and runs[0].rounds == runs[1].rounds
    with pytest.raises(ValueError, match="tree_topk"):
        SpeculativeEngine(target, drafter, tree_topk="sort")


def test_cache_move_reads_before_writing():
    cache = TargetStaticCache(2, 1, 1, 8, 1, torch.float32, "cpu")
    for buf in cache.k + cache.v:
        buf.copy_(torch.arange(8.0).view(1, 1, 8, 1))
    cache.move(torch.tensor([[3, 5, 6]]), torch.tensor([[2, 3, 4]]))  # slot 3 is read before it is overwritten
    for buf in cache.k + cache.v:
        assert buf[0, 0, :, 0].tolist() == [0, 1, 3, 5, 6, 5, 6, 7]


def test_tree_errors():
    with pytest.raises(ValueError, match="no parent"):
        TreeSpec([(0,), (1, 0)])
    with pytest.raises(ValueError, match="twice"):
        TreeSpec([(0,), (0,)])
    target = build_target("llama")
    prompts = _prompts(2, (5,))
    markov = SpeculativeEngine(target, build_drafter(target, "markov", False), max_len=96)
    with pytest.raises(ValueError, match="DFlash drafter"):
        markov.generate(prompts, max_new_tokens=5, tree=WIDE)
    dflash = SpeculativeEngine(target, build_drafter(target, "dflash", False), max_len=96)
    too_deep = TreeSpec.chain(dflash.drafter.config.num_proposals + 1)
    with pytest.raises(ValueError, match="proposes"):
        dflash.generate(prompts, max_new_tokens=5, tree=too_deep)
    with pytest.raises(ValueError, match="tree_nodes=12"):
        dflash.generate(prompts, max_new_tokens=5, tree=WIDE, tree_nodes=12)


def test_calibration_counts_every_anchor_like_a_one_anchor_draft():
    """examples/calibrate_tree.py's batched rank paths (all anchors of padded responses in one forward) equal, anchor
    by anchor, a draft of that one anchor on its own response; and the tree it keeps is prefix-closed."""
    import collections
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from calibrate_tree import best_tree, calibrate

    from hf_carryover.training.objectives import draft_blocks, target_pass

    target, drafter, prompts, max_new, refs = _trained_setup("dflash", False, steps=30)
    records = [{"input_ids": p + r, "prompt_len": len(p)} for p, r in zip(prompts, refs)]
    records[1] = {**records[1], "input_ids": records[1]["input_ids"][:20]}  # a shorter one: padding in the batch
    counts, anchors = calibrate(target, drafter, records, ranks=3, batch_size=3, log=lambda *_: None)
    want, n = collections.Counter(), 0
    P = drafter.config.num_proposals
    for rec in records:
        ids = torch.tensor([rec["input_ids"]])
        ok = torch.ones_like(ids, dtype=torch.bool)
        feats, _ = target_pass(target, drafter, ids, ok, need_logits=False)
        for t in range(rec["prompt_len"], ids.shape[1] - 1):
            hid = draft_blocks(drafter, drafter, ids, feats, ok, torch.tensor([[t]]))
            top = drafter.lm_logits(hid[0, 0, drafter.proposal_rows()]).topk(3, -1).indices  # [P, 3]
            path = []
            for d in range(P):
                if t + 1 + d >= ids.shape[1] or ids[0, t + 1 + d] not in top[d]:
                    break
                path.append(int((top[d] == ids[0, t + 1 + d]).nonzero()[0]))
            n += 1
            for d in range(1, len(path) + 1):
                want[tuple(path[:d])] += 1
    assert anchors == n and counts == want
    kept = set(best_tree(counts, 10))
    assert all(p[:-1] in kept for p in kept if len(p) > 1)
    TreeSpec(kept)  # a valid tree


def test_select_tree_keeps_the_chain_a_lookup_reaches():
    """keep_chain=L keeps the rank-0 chain to depth L (where looked-up tokens go) even when the drafter scores it low,
    fills the rest by score, and still returns a tree; L=0 changes nothing."""
    D, R = 6, 3
    full = TreeSpec([p for d in range(1, D + 1) for p in __import__("itertools").product(range(R), repeat=d)])
    lp = torch.tensor([[0.4, 0.35, 0.25]] * D).log()[None].expand(2, -1, -1)  # unsure everywhere: shallow bushy tree
    free = select_tree(full, lp, 8)
    forced = select_tree(full, lp, 8, keep_chain=torch.tensor([6, 0]))
    assert free["depth"][0].max() < 6 and forced["depth"][0].max() == 6
    for r in range(2):
        assert all(forced["parent"][r, i] < i for i in range(1, 9))
    assert torch.equal(forced["depth"][1], free["depth"][1]) and torch.equal(forced["rank"][1], free["rank"][1])
    chain = [i for i in range(9) if forced["main"][0, i]]
    assert sorted(forced["depth"][0, chain].tolist()) == list(range(7))  # root + chain depths 1..6


def test_scored_lookup_is_kept_as_far_as_it_outscores_the_drafters_alternatives():
    """`lookup_chain_lp`: a looked-up token scores max(drafter log-prob of it, log confidence), NaN where there is no
    lookup. In `select_tree(chain_lp=...)` a confident lookup then runs deep through a drafter that is unsure, a
    doubtful one gives its nodes to the drafter's alternatives after a step or two, and a row without a lookup gets
    the plain selection."""
    D, R = 6, 3
    full = TreeSpec([p for d in range(1, D + 1) for p in __import__("itertools").product(range(R), repeat=d)])
    lp = torch.tensor([[0.4, 0.35, 0.25]] * D).log()[None].expand(3, -1, -1)  # unsure everywhere
    top = torch.tensor([[10, 11, 12]] * D)[None].expand(3, -1, -1)  # [b, D, R]
    look = torch.tensor([[40] * D, [11] + [40] * (D - 1), [0] * D])  # row 1: its first token is the drafter's rank 1
    n_look = torch.tensor([6, 6, 0])
    chain = lookup_chain_lp(lp, top, look, n_look, 0.9)
    assert torch.allclose(chain[0], torch.tensor(0.9).log().expand(D))  # not in the drafter's list: the floor
    assert torch.isclose(chain[1, 0], torch.tensor(0.9).log())  # max(log 0.35, log 0.9)
    assert chain[2].isnan().all()
    assert torch.isclose(lookup_chain_lp(lp, top, look, n_look, 0.2)[1, 0], torch.tensor(0.35).log())
    sure = select_tree(full, lp, 8, chain_lp=chain)
    doubt = select_tree(full, lp, 8, chain_lp=lookup_chain_lp(lp, top, look, n_look, 0.3))
    plain = select_tree(full, lp, 8)
    on_chain = sure["main"][0] & (sure["depth"][0] > 0)
    assert sure["depth"][0, on_chain].max() == D  # six steps of 0.9 outscore every alternative of 0.4 or less
    assert 0 < doubt["depth"][0][doubt["main"][0]].max() < D  # 0.3 a step: cut short, alternatives kept instead
    for key in ("depth", "rank", "parent"):
        assert torch.equal(sure[key][2], plain[key][2])
    for r in range(3):
        assert all(sure["parent"][r, i] < i for i in range(1, 9))


@pytest.mark.parametrize("confidence, min_ngram", [(0.2, 3), (0.9, 3), (None, 2)])
def test_scored_or_shorter_lookup_is_exact(confidence, min_ngram):
    """`lookup_confidence` changes which nodes a round verifies and `lookup_min_ngram` which rounds look up, never the
    output: plain greedy decoding's tokens on a prompt that loops (lookups hit); out-of-range values are refused."""
    target = _target()
    prompts = [PROMPT_LOOP[0].tolist(), PROMPT_LOOP[0, 6:].tolist()]
    refs = _greedy_refs(target, prompts, 20)
    engine = SpeculativeEngine(target, _drafter(target, "dflash"), max_len=128, lookup_confidence=confidence,
                               lookup_min_ngram=min_ngram)
    assert engine.generate(prompts, max_new_tokens=20, tree=WIDE, prompt_lookup_num_tokens=4, tree_nodes=6) == refs
    assert sum(map(sum, engine.lookup_rounds)) > 0
    for bad in ({"lookup_confidence": 0.0}, {"lookup_confidence": 1.5}, {"lookup_min_ngram": 0},
                {"lookup_min_ngram": 5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculativeEngine(target, _drafter(target, "dflash"), max_len=128, **bad)


def test_lookup_min_ngram_reaches_the_lookup():
    """A sequence whose last 3 tokens never occurred before but whose last 2 did: no lookup at 3, one at 2 (the
    engine passes its `lookup_min_ngram` to `batched_context_lookup`)."""
    target = _target()
    seq = torch.tensor([[1, 2, 5, 6, 7, 9, 5, 6] + [0] * 8])  # suffix (5, 6) seen at 2; (9, 5, 6) never
    for n, expect in ((3, 0), (2, 3)):
        engine = SpeculativeEngine(target, _drafter(target, "dflash"), max_len=64, lookup_min_ngram=n)
        st = engine._state(1, engine.drafter.config.num_proposals, 8, 0, "cpu", torch.float32)
        st.seq.zero_()
        st.seq[:, :16] = seq
        st.anchor_pos.fill_(7)  # the anchor (6) at position 7: 8 committed tokens
        engine._lookup_next(st, 3)
        assert int(st.n_look[0]) == expect
        if expect:
            assert st.look[0, :3].tolist() == [7, 9, 5]


def test_siblings_of_a_looked_up_token_take_the_drafters_ranking_without_it():
    """With a lookup on the rank-0 chain, each looked-up token's siblings propose the drafter's ranked tokens minus
    the looked-up one, so the drafter's first choice is still proposed; nodes elsewhere, depths the lookup does not
    reach and rounds without a lookup keep their own ranks. Scores in `select_tree` follow the proposed tokens."""
    tree = TreeSpec([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])
    top = torch.tensor([[[5, 7, 9], [20, 21, 22], [30, 31, 32]]]).expand(4, -1, -1)  # [b, D=3, R=3]
    look = torch.tensor([[7, 21, 99], [11, 20, 30], [5, 20, 30], [0, 0, 0]])  # row 3: no lookup
    n_look = torch.tensor([2, 1, 3, 0])
    lpos = lookup_ranks(top, look, n_look)
    assert lpos.tolist() == [[1, 1, -1], [3, -1, -1], [0, 0, 0], [-1, -1, -1]]
    t = static_tree(tree, 4, "cpu")
    tokens = node_tokens(top, t, node_ranks(t, lpos))
    # node order: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1); the chain nodes get the lookup later (engine)
    assert tokens[0].tolist() == [5, 5, 9, 20, 20, 20, 30, 31]  # 7 looked up at depth 1: siblings 5, 9; 21 at depth 2
    assert tokens[1].tolist() == [5, 5, 7, 20, 21, 20, 30, 31]  # 11 not in the ranking: siblings shift by one
    assert tokens[2].tolist() == [5, 7, 9, 20, 21, 20, 30, 31]  # the lookup agrees with rank 0: nothing moves
    assert torch.equal(tokens[3], node_tokens(top, t)[3])  # no lookup: own ranks
    assert tokens[1, 5] == 20  # (1, 0): child of a non-chain node, own rank even where depth 2 has no lookup
    lp = torch.tensor([[0.6, 0.3, 0.1]] * 3).log()[None].expand(4, -1, -1)
    shifted = select_tree(tree, lp, 2, lookup_pos=lpos)
    plain = select_tree(tree, lp, 2)
    # row 1 (lookup 11 at depth 1): sibling (1,) proposes rank 0 now, so it outscores (0, 0)
    assert plain["depth"][1].tolist() == [0, 1, 2] and shifted["depth"][1].tolist() == [0, 1, 1]


@pytest.mark.parametrize("siblings", [True, False])
def test_lookup_siblings_switch_is_exact_and_switches_the_ranking(monkeypatch, siblings):
    """`lookup_siblings=False` (kept for paired τ runs) gives a looked-up token's siblings their own ranks again:
    `lookup_ranks` is not consulted and `node_ranks` gets None. Both settings equal plain greedy decoding on a
    prompt that loops, so lookups hit."""
    seen = []
    real = node_ranks

    def spy(t, lookup_pos=None):
        seen.append(lookup_pos)
        return real(t, lookup_pos)

    monkeypatch.setattr("hf_carryover.engine.tree_round.node_ranks", spy)
    target = _target()
    prompts = [PROMPT_LOOP[0].tolist(), PROMPT_LOOP[0, 6:].tolist()]
    refs = _greedy_refs(target, prompts, 20)
    engine = SpeculativeEngine(target, _drafter(target, "dflash"), max_len=128, lookup_siblings=siblings)
    assert engine.generate(prompts, max_new_tokens=20, tree=WIDE, prompt_lookup_num_tokens=4, tree_nodes=6) == refs
    assert sum(map(sum, engine.lookup_rounds)) > 0
    assert seen and all((p is not None) == siblings for p in seen)


# every token of the 16-token test vocabulary at depth 1, the top 6 x 6 at depth 2: a draw always matches a child
FULL16 = [(r,) for r in range(16)] + [(r, s) for r in range(6) for s in range(6)] + [(0, 0, s) for s in range(4)]


def _sample_tree(target, drafter, prompt, n, tree=WIDE, lookup=None, seed=6):
    """n engine samples of `prompt` with a draft tree at T=1 and the target's own n samples (NEW tokens each)."""
    torch.manual_seed(5)
    plain = target.generate(prompt.repeat(n, 1), max_new_tokens=NEW, do_sample=True, **PURE)[:, prompt.shape[1]:]
    engine = SpeculativeEngine(target, drafter, max_len=prompt.shape[1] + NEW + 80)
    spec = engine.generate([prompt[0].tolist()] * n, max_new_tokens=NEW, do_sample=True, seed=seed, tree=tree,
                           prompt_lookup_num_tokens=lookup)
    return [tuple(s) for s in spec], [tuple(s) for s in plain.tolist()], engine


@pytest.mark.parametrize("tree, lookup", [(WIDE, None), (FULL16, None), (FULL16, 3)],
                         ids=["wide", "full", "full-lookup"])
def test_sampled_tree_follows_the_target(tree, lookup):
    """Chi-square tests at alpha = 0.001 of 2000 sampled tree calls against the target's own samples, per position and
    for adjacent pairs (positions 2-4 come from tree rounds). An untrained drafter: with WIDE most draws match no
    child; with FULL16 every draw at depth 1 matches one (mostly not the rank-0 one) and some at depth 2 do, so
    acceptance of siblings and of paths of two nodes is covered. With lookup the prompt loops, so looked-up tokens sit
    on the rank-0 chain beside the drafter's alternatives."""
    target = _target()
    drafter = _drafter(target, "dflash")
    prompt = PROMPT_LOOP if lookup else PROMPT
    spec, plain, engine = _sample_tree(target, drafter, prompt, 2000, tree, lookup)
    accepted = [a for rows in engine.rounds for a in rows]
    assert sum(a >= 1 for a in accepted) > 0.15 * len(accepted)
    if tree is FULL16:  # every depth-1 draw is a child; paths of two nodes in about 5 % of rounds (NEW = 4: a <= 2)
        assert all(a >= 1 for a in accepted) if lookup is None else sum(a >= 1 for a in accepted) > 0.9 * len(accepted)
        assert sum(a == 2 for a in accepted) > 0.02 * len(accepted)
    if lookup:
        assert sum(map(sum, engine.lookup_rounds)) > 0.3 * len(spec)
    pvals = _pvalues(spec, plain)
    assert min(pvals.values()) > ALPHA, pvals


def test_sampled_tree_negative_control(monkeypatch):
    """The test has power: one uniform shared by every verified row of a round (draws that should be independent)
    makes the chi-square test reject."""

    def shared(self, gen):
        self.noise.copy_(torch.rand(self.noise.shape[0], 1, generator=gen, device=self.noise.device)
                         .expand_as(self.noise))

    monkeypatch.setattr(DecodeState, "draw", shared)
    target = _target()
    spec, plain, _ = _sample_tree(target, _drafter(target, "dflash"), PROMPT, 2000, FULL16)
    assert min(_pvalues(spec, plain).values()) < ALPHA


def test_sampled_tree_rounds_compiled_and_captured_equal_eager(monkeypatch):
    """A sampled tree call through torch.compile and through the cuda_graphs loop (an eager stand-in on CPU): the
    same seed gives the eager engine's tokens and rounds (the uniforms are drawn outside the round)."""
    from test_engine_capture import _fake_capture

    target = build_target("llama", seed=5)
    drafter = build_drafter(target, "dflash", True)
    prompts = _prompts(1, (4, 9))
    kw = dict(max_new_tokens=20, tree=WIDE, do_sample=True, temperature=0.9, seed=4)
    eager = SpeculativeEngine(target, drafter, max_len=96)
    ref = eager.generate(prompts, **kw)
    fast = SpeculativeEngine(target, drafter, max_len=96, compile="aot_eager")
    assert fast.generate(prompts, **kw) == ref and fast.rounds == eager.rounds
    monkeypatch.setattr(engine_mod, "_is_cuda", lambda dev: True)
    captured = []
    monkeypatch.setattr(capture_mod, "capture_round", _fake_capture(captured))
    monkeypatch.setattr(refill_mod, "capture_round", _fake_capture([]))  # the row prefill's graphs: stand-ins too
    graphed = SpeculativeEngine(target, drafter, max_len=96, cuda_graphs=True)
    assert graphed.generate(prompts, **kw) == ref and graphed.rounds == eager.rounds
    assert len(captured) == 2 and graphed.last_mode == "cuda_graph"  # the round and the call's start
    # the greedy call of the same tree is its own shape (its own round and, its state holding fewer uniforms per row,
    # its own start) and still plain greedy decoding
    greedy = {x: v for x, v in kw.items() if x not in ("do_sample", "temperature", "seed")}
    assert graphed.generate(prompts, **greedy) == _greedy_refs(target, prompts, 20) and len(captured) == 4
