"""A drafter with `learned_mask_embedding=True` (the mask slots use a learned vector, not a target row —
needed for targets without a spare vocabulary row) saves, reloads and generates exactly."""

import pytest
import torch
from transformers import AutoModel

from hf_carryover import Drafter, DrafterContextCache

from conftest import ARCHS, DRAFTER_TYPES, build_drafter, build_target, greedy, make_prompt, speculative


def _learned(target, drafter_type):
    return build_drafter(target, drafter_type, True, mask_token_id=None, learned_mask_embedding=True)


@torch.no_grad()
def _draft(drafter, target):
    """Drafter hidden states of one block after a short committed context taken from the target."""
    ids = make_prompt(6)
    hs = target(ids, output_hidden_states=True).hidden_states
    cache = DrafterContextCache(len(drafter.layers))
    drafter.append_context(cache, drafter.fuse(drafter.target_features(hs)), torch.arange(6)[None])
    return drafter.draft_hidden(ids[:, -1:], 6, cache)


def test_from_target_defaults_to_learned_mask():
    target = build_target("llama")
    drafter = Drafter.from_target(target, num_hidden_layers=1, target_layer_ids=[1])
    assert drafter.config.learned_mask_embedding and drafter.config.mask_token_id is None
    assert drafter.mask_embedding is not None and "mask_embedding" in drafter.state_dict()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_type", DRAFTER_TYPES)
def test_learned_mask_round_trip_and_exact_generate(drafter_type, arch, tmp_path):
    target = build_target(arch)
    drafter = _learned(target, drafter_type)
    assert drafter.config.mask_token_id is None
    before = _draft(drafter, target)

    # the learned vector is what fills the mask slots: changing it changes the draft
    with torch.no_grad():
        saved_vector = drafter.mask_embedding.clone()
        drafter.mask_embedding.add_(1.0)
        assert (_draft(drafter, target) - before).abs().max() > 1e-3
        drafter.mask_embedding.copy_(saved_vector)

    drafter.save_pretrained(tmp_path)
    for loader in (lambda: Drafter.from_pretrained(tmp_path), lambda: AutoModel.from_pretrained(tmp_path)):
        loaded = loader().eval()
        assert type(loaded) is Drafter and loaded.config.learned_mask_embedding
        saved, got = drafter.state_dict(), loaded.state_dict()
        assert sorted(saved) == sorted(got)
        for key in saved:
            assert torch.equal(saved[key], got[key]), key
        # non-persistent buffers (RoPE inv_freq) are rebuilt on load, not read: they must come out identical
        for (key, value), (key2, value2) in zip(drafter.named_buffers(), loaded.named_buffers()):
            assert key == key2 and torch.equal(value, value2), (key, value, value2)
        loaded.bind_target(target)
        torch.testing.assert_close(_draft(loaded, target), before, atol=0, rtol=0)

        ids = make_prompt(5)
        ref = greedy(target, ids, 21)
        assert torch.equal(speculative(target, loaded, ids, 21), ref)
        assert loaded.last_candidate_generator.rounds
