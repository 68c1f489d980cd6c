"""The carryover rows the drafter receives are exactly the rejected rows of the last verification.

For every drafting call we recompute, independently of the generator, what the carryover should be: the
target runs once, without cache, over the verified sequence `[committed tokens | anchor | proposals]` with
`output_hidden_states=True`; the rejected rows are the proposals after the accepted prefix; their features
are `hidden_states[i + 1]` for each tapped layer i, concatenated on the feature axis. The recorded
`rounds_carryover[...]["features"]` must match (fp32, atol 1e-5), and the positions must be the rows'
original absolute positions. What the drafter actually receives is also checked: `draft_hidden` gets
`fuse(features)` at those positions, and the committed-context cache never holds a rejected row.
"""

import inspect

import pytest
import torch

from hf_carryover import CarryoverCandidateGenerator, Drafter, DrafterContextCache

from conftest import (
    ARCHS, DRAFTER_TYPES, VOCAB, build_drafter, build_target, greedy, make_prompt, oracle_choose, speculative,
)

LAYERS = [0, 2, 4]  # distinct and not [i+1]-symmetric: an off-by-one tap (hidden_states[i]) cannot match
# Targets here use initializer_range=0.1: hidden states ~0.4 (max ~3), so fp32 noise between the cached
# incremental forward and the one-shot recomputation is ~1e-6, well inside atol 1e-5, while a wrong row
# differs by O(0.1). (At 0.3 the residual stream reaches ~30 and the noise alone is ~2e-5.)
INIT = 0.1


@pytest.fixture
def record_draft_inputs(monkeypatch):
    """Wrap `Drafter.draft_hidden`: what the drafter forward is actually given each round."""
    seen = []
    original = Drafter.draft_hidden
    signature = inspect.signature(original)

    def wrapped(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        carry, carry_pos = arguments.get("carryover_features"), arguments.get("carryover_positions")
        seen.append({
            "anchor_position": arguments["anchor_position"],
            "carryover_features": None if carry is None else carry.clone(),
            "carryover_positions": None if carry_pos is None else carry_pos.clone(),
        })
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Drafter, "draft_hidden", wrapped)
    return seen


@torch.no_grad()
def _expected_rows(target, verified: torch.Tensor, rows: slice) -> torch.Tensor:
    hs = target(verified, output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hs[i + 1][:, rows] for i in LAYERS], dim=-1)


def _check(target, drafter, calls, draft_inputs):
    """Verify every drafting call's carryover against an independent recomputation. Returns counts."""
    gen = drafter.last_candidate_generator
    records = gen.rounds_carryover
    assert calls[0]["first"] and not any(c["first"] for c in calls[1:])
    assert len(records) == len(calls) - 1  # one record per drafting call (prefill call excluded)
    drafted = iter(draft_inputs)
    counts = {"rejected": 0, "full_accept": 0}
    round_idx = 0
    for c in range(1, len(calls)):
        rec, now = records[c - 1], calls[c]["input_ids"]
        prev_in, prev_cand = calls[c - 1]["input_ids"], calls[c - 1]["candidate"]
        L, k = prev_in.shape[1], prev_cand.shape[1] - prev_in.shape[1]  # anchor at L-1, k proposals
        a = now.shape[1] - L - 1  # accepted drafts of the previous verification
        assert torch.equal(now[:, :L + a], prev_cand[:, :L + a])  # accepted drafts are the proposals' prefix
        assert rec["committed"] == L + a == now.shape[1] - 1
        # the committed-context cache holds exactly the committed rows: rejected rows never enter it
        assert calls[c]["cache_length"] == now.shape[1] - 1
        if k > 0:
            assert gen.rounds[round_idx]["accepted"] == a
            round_idx += 1
        if c == 1 or a == k:  # first round (after prefill), or everything accepted: nothing to carry
            assert rec["features"] is None and rec["positions"] is None
            counts["full_accept"] += c > 1
        else:
            expected = _expected_rows(target, prev_cand, slice(L + a, L + k))
            assert rec["features"].shape == expected.shape == (1, k - a, len(LAYERS) * target.config.hidden_size)
            torch.testing.assert_close(rec["features"], expected, atol=1e-5, rtol=0)
            assert rec["positions"].tolist() == [list(range(L + a, L + k))]
            counts["rejected"] += 1
        if calls[c]["candidate"].shape[1] > now.shape[1]:  # this call drafted: check what the drafter got
            got = next(drafted)
            assert got["anchor_position"] == now.shape[1] - 1
            if rec["features"] is None:
                assert got["carryover_features"] is None
            else:
                assert torch.equal(got["carryover_features"], rec["features"])
                assert torch.equal(got["carryover_positions"], rec["positions"])
    assert next(drafted, None) is None
    return counts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_carryover_rows_real_drafter(drafter_type, arch, record_calls, record_draft_inputs):
    target = build_target(arch, initializer_range=INIT)
    ids = make_prompt(7)
    drafter = build_drafter(target, drafter_type, True, target_layer_ids=LAYERS, block_size=5)
    drafter.record_carryover = True
    out = speculative(target, drafter, ids, 24)
    assert torch.equal(out, greedy(target, ids, 24))
    counts = _check(target, drafter, record_calls, record_draft_inputs)
    assert counts["rejected"] >= 5


def _corrupt(r, j):
    return (r % 2 == 1 and j == 1) or (r % 4 == 2 and j == 4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_carryover_rows_oracle_drafter(drafter_type, arch, record_calls, record_draft_inputs, monkeypatch):
    """Oracle proposals with corrupted positions: full accepts (no carryover) and partial rejections mix."""
    target = build_target(arch, initializer_range=INIT)
    ids = make_prompt(4)
    ref = greedy(target, ids, 40)
    monkeypatch.setattr(CarryoverCandidateGenerator, "_choose", oracle_choose(ref, VOCAB, _corrupt))
    drafter = build_drafter(target, drafter_type, True, target_layer_ids=LAYERS, block_size=6)
    drafter.record_carryover = True
    assert torch.equal(speculative(target, drafter, ids, 40), ref)
    counts = _check(target, drafter, record_calls, record_draft_inputs)
    assert counts["rejected"] >= 2 and counts["full_accept"] >= 2


@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_no_carryover_when_disabled(drafter_type, record_calls, record_draft_inputs):
    target = build_target("llama", initializer_range=INIT)
    ids = make_prompt(7)
    drafter = build_drafter(target, drafter_type, False, target_layer_ids=LAYERS)
    assert drafter.carryover_embedding is None
    assert not any("carryover" in k for k in drafter.state_dict())
    drafter.record_carryover = True
    assert torch.equal(speculative(target, drafter, ids, 20), greedy(target, ids, 20))
    gen = drafter.last_candidate_generator
    assert any(r["accepted"] < r["proposals"] for r in gen.rounds)  # there were rejected rows to (not) carry
    assert len(gen.rounds_carryover) == len(record_calls) - 1
    assert all(rec["features"] is None for rec in gen.rounds_carryover)
    assert record_draft_inputs and all(d["carryover_features"] is None for d in record_draft_inputs)


@torch.no_grad()
def test_carryover_is_temporary_marked_kv():
    """Carryover rows act as extra K/V rows `fuse(x) + marker` at their own positions, for one forward only.

    `forward(cache=C, carryover_features=X)` must equal `forward(cache=C')` where C' is C with the rows
    `fuse(X) + carryover_embedding` appended at the carryover positions (attention with every key visible is
    order-independent). Also: the marker, the positions and the rows themselves change the output (are used).
    """
    target = build_target("qwen3", initializer_range=INIT)
    drafter = build_drafter(target, "dflash", True, target_layer_ids=LAYERS)
    torch.manual_seed(5)
    B, width = drafter.config.block_size, len(LAYERS) * target.config.hidden_size
    block = drafter.embed_block(torch.tensor([[3]]))
    block_pos = torch.arange(10, 10 + B)[None]
    ctx = torch.randn(1, 10, width)
    carry = torch.randn(1, 3, width)
    carry_pos = torch.arange(10, 13)[None]  # overlapping the block's positions, as after a rejection

    def cache_with(rows, positions):
        cache = DrafterContextCache(len(drafter.layers))
        drafter.append_context(cache, rows, positions)
        return cache

    cache = cache_with(drafter.fuse(ctx), torch.arange(10)[None])
    out = drafter(block, block_pos, cache=cache, carryover_features=carry, carryover_positions=carry_pos)
    assert cache.length == 10  # temporary: the forward did not append carryover rows to the cache
    merged = cache_with(torch.cat([drafter.fuse(ctx), drafter.fuse(carry) + drafter.carryover_embedding], 1),
                        torch.cat([torch.arange(10)[None], carry_pos], 1))
    torch.testing.assert_close(out, drafter(block, block_pos, cache=merged), atol=1e-5, rtol=1e-5)

    unmarked = cache_with(torch.cat([drafter.fuse(ctx), drafter.fuse(carry)], 1),
                          torch.cat([torch.arange(10)[None], carry_pos], 1))
    variants = {
        "no carryover": drafter(block, block_pos, cache=cache),
        "shifted positions": drafter(block, block_pos, cache=cache, carryover_features=carry,
                                     carryover_positions=carry_pos - 7),
        "no marker": drafter(block, block_pos, cache=unmarked),
    }
    for name, other in variants.items():
        assert (out - other).abs().max() > 1e-3, name
