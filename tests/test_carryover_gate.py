"""The carryover gate: a learned attention-logit bias on the carryover keys, one per drafter layer and head.

Why it exists: the 2026-11-30f Carryover drafter read its rows in a way that cost τ (−0.044 per prompt against the
same drafter with the rows withheld), and stage 2 also cost first-draft quality. A gate that starts nearly closed
starts stage 2 from the baseline drafter's behaviour. These tests pin down what it computes on every path."""

import copy

import pytest
import torch
from conftest import build_drafter, build_target
from test_engine import _greedy_refs
from test_offline_tau import overfit
from test_training import tiny_drafter, tiny_target

from hf_carryover import modeling_drafter
from hf_carryover.engine.engine import SpeculativeEngine
from hf_carryover.modeling_drafter import DrafterContextCache
from hf_carryover.training.masks import dense_drafter_mask, flex_drafter_mask
from hf_carryover.training.trainer import CarryoverTrainer, CarryoverTrainingArguments


def _draft(drafter, target, carry: bool, seed=0):
    """Drafter hidden states of one block after 9 committed rows, with or without 3 carryover rows."""
    g = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    ctx = torch.randn(1, 9, width, generator=g)
    rows = torch.randn(1, 3, width, generator=g)
    cache = DrafterContextCache(len(drafter.layers))
    drafter.append_context(cache, drafter.fuse(ctx), torch.arange(9)[None])
    with torch.no_grad():
        return drafter.draft_hidden(torch.tensor([[7]]), 9, cache, rows if carry else None,
                                    torch.arange(10, 13)[None] if carry else None)


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_closed_gate_equals_rows_withheld_and_zero_gate_equals_no_gate(typ):
    target = tiny_target()
    gated = tiny_drafter(target, typ, gate=0.0).eval()
    gated.bind_target(target)
    ungated = copy.deepcopy(gated)
    ungated.carryover_gate = None
    with torch.no_grad():
        gated.carryover_gate.zero_()
    torch.testing.assert_close(_draft(gated, target, True), _draft(ungated, target, True))  # bias 0 = no bias
    assert not torch.allclose(_draft(gated, target, True), _draft(gated, target, False))  # the rows matter...
    with torch.no_grad():
        gated.carryover_gate.fill_(-1e4)  # ...until the gate is shut: exp(-1e4) is 0 in fp32
    torch.testing.assert_close(_draft(gated, target, True), _draft(gated, target, False))


def test_flex_score_mod_equals_the_dense_gate(monkeypatch):
    """The FlexAttention path (training on GPU) adds the gate as a score_mod; eager FlexAttention on CPU must give
    what the dense boolean mask plus additive gate gives (forward only: FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(modeling_drafter, "_FLEX", [flex_attention])  # CPU inductor cannot compile this one
    target = tiny_target()
    drafter = tiny_drafter(target, gate=-1.0)
    drafter.bind_target(target)
    B, k, L = drafter.config.block_size, 3, 10
    anchors = torch.tensor([[2, 5]])
    ctx_valid = torch.ones(1, L, dtype=torch.bool)
    carry_valid = torch.tensor([[True, True, False, True, False, True]])  # 2 groups of k rows, some rejected
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    ctx, carry = torch.randn(1, L, width, generator=g), torch.randn(1, 2 * k, width, generator=g)
    block = torch.randn(1, 2 * B, target.config.hidden_size, generator=g)
    positions = (anchors[:, :, None] + torch.arange(B)).flatten(1)
    carry_pos = (anchors[:, :, None] + 1 + torch.arange(k)).flatten(1)
    outs = []
    with torch.no_grad():
        for gate in (-1.0, -1e4):  # -1e4: the rows shut out, which must change the output (the gate is applied)
            drafter.carryover_gate.fill_(gate)
            for mask in (dense_drafter_mask(anchors, ctx_valid, B, carry_valid, k),
                         flex_drafter_mask(anchors, ctx_valid, B, carry_valid, k)):
                outs.append(drafter(block, positions, context_features=ctx, context_positions=torch.arange(L)[None],
                                    carryover_features=carry, carryover_positions=carry_pos, attn_mask=mask))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs[3], outs[2], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outs[0], outs[2], atol=1e-3)


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_engine_rounds_equal_generate_with_a_gated_drafter(typ):
    """The engine's drafter keys are a static cache, a fixed carryover buffer and the block: the gate's span must
    land on the buffer there too (greedy output exact, rounds equal to generate()'s round for round)."""
    target = build_target("llama", seed=5)
    drafter = build_drafter(target, typ, True, carryover_gate=0.5)
    with torch.no_grad():
        drafter.carryover_gate.normal_(std=1.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (3 + n,), generator=g).tolist() for n in range(3)]
    refs = _greedy_refs(target, prompts, 30)
    overfit(drafter, target, [(len(p), p + r, 30) for p, r in zip(prompts, refs)], steps=30)
    drafter.eval()
    online = []
    for p in prompts:
        target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=30, do_sample=False)
        online.append([r["accepted"] for r in drafter.last_candidate_generator.rounds])
    engine = SpeculativeEngine(target, drafter, max_len=96)
    assert engine.generate(prompts, max_new_tokens=30) == refs
    assert engine.rounds == online
    assert any(a < drafter.config.num_proposals for rounds in online for a in rounds)  # rows were carried


def test_gate_trains_at_its_own_learning_rate(tmp_path):
    """Stage 2 puts the gate in its own optimizer group at carry_gate_lr_multiplier x the learning rate."""
    target = tiny_target()
    drafter = tiny_drafter(target, gate=-6.0)
    args = CarryoverTrainingArguments(output_dir=str(tmp_path), stage=2, learning_rate=1e-3, use_cpu=True,
                                      carry_gate_lr_multiplier=40.0, report_to="none")
    opt = CarryoverTrainer(model=drafter, args=args, target=target).create_optimizer()
    groups = [(g["lr"], {id(p) for p in g["params"]}) for g in opt.param_groups]
    gate = [lr for lr, ids in groups if id(drafter.carryover_gate) in ids]
    assert gate == [pytest.approx(4e-2)]
    assert all(lr == pytest.approx(1e-3) for lr, ids in groups if id(drafter.carryover_gate) not in ids)
    assert sum(len(ids) for _, ids in groups) == len([p for p in drafter.parameters() if p.requires_grad])


def test_gate_values_script_reads_what_training_left(tmp_path):
    """examples/carryover_gate_values.py reports the saved gate against its initial value, and refuses an ungated
    drafter by name."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import carryover_gate_values

    target = tiny_target()
    gated = tiny_drafter(target, "dflash", gate=-6.0)
    with torch.no_grad():
        gated.carryover_gate.fill_(-6.0)
        gated.carryover_gate[0, 0] = -4.0  # one head opened by 2, one closed by 1
        gated.carryover_gate[-1, -1] = -7.0
    gated.save_pretrained(tmp_path / "gated")
    s = carryover_gate_values.gate_stats(tmp_path / "gated", -6.0)
    assert s["shape"] == list(gated.carryover_gate.shape)
    assert (s["heads_opened"], s["heads_closed"], s["largest_opening"]) == (1, 1, pytest.approx(2.0))
    assert s["max"] == pytest.approx(-4.0) and s["min"] == pytest.approx(-7.0)
    assert s["mean_move"] == pytest.approx(1.0 / gated.carryover_gate.numel())
    ungated = tiny_drafter(target, "dflash")
    ungated.save_pretrained(tmp_path / "plain")
    with pytest.raises(SystemExit, match="no carryover_gate"):
        carryover_gate_values.gate_stats(tmp_path / "plain", None)
