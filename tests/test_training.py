"""Training path: masks, objectives, the Trainer, and alignment of training-time carryover with inference."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_carryover import Drafter
from hf_carryover.training.data import ResponseCollator, ResponseDataset, regenerate_responses
from hf_carryover.training.masks import dense_drafter_mask, verify_mask
from hf_carryover.training.trainer import CarryoverTrainer, CarryoverTrainingArguments
from hf_carryover.training.objectives import (
    block_targets,
    carry_chain,
    carryover_rows_valid,
    draft_blocks,
    eos_ids_of,
    greedy_proposals,
    sample_anchors,
    stage1_loss,
    stage2_loss,
    target_pass,
    verify_all,
)


def tiny_target(seed=0, vocab=64, init=0.02):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=vocab - 1, bos_token_id=0, pad_token_id=0, initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


def tiny_drafter(target, typ="dflash", carryover=True, B=4, gate=None):
    """gate: None, or a carryover gate whose per-layer, per-head biases are drawn around `gate` (so they differ)."""
    torch.manual_seed(1)
    d = Drafter.from_target(target, drafter_type=typ, carryover=carryover, block_size=B, num_hidden_layers=2,
                            mask_token_id=5, **({} if gate is None else {"carryover_gate": gate}))
    if gate is not None:
        with torch.no_grad():
            d.carryover_gate.add_(torch.randn_like(d.carryover_gate))
    return d


def loop_drafter_mask(anchors, ctx_valid, B, carry_valid=None, k=0, carry_offset=0):
    """Independent reference: the visibility rules written as explicit loops."""
    b, N = anchors.shape
    L = ctx_valid.shape[1]
    G = 0 if carry_valid is None else carry_valid.shape[1] // k
    keys = L + G * k + N * B
    out = torch.zeros(b, 1, N * B, keys, dtype=torch.bool)
    for i in range(b):
        for n in range(N):
            for r in range(B):
                q = n * B + r
                for j in range(L):
                    out[i, 0, q, j] = bool(j < anchors[i, n] and ctx_valid[i, j])
                for g in range(G):
                    for c in range(k):
                        out[i, 0, q, L + g * k + c] = bool(g + carry_offset == n and carry_valid[i, g * k + c])
                for r2 in range(B):
                    out[i, 0, q, L + G * k + n * B + r2] = True
    return out


@pytest.mark.parametrize("with_carry", [False, True])
def test_drafter_mask_matches_loop_reference(with_carry):
    torch.manual_seed(0)
    b, L, B, k = 2, 11, 4, 3  # 3 anchors a row (below)
    anchors = torch.tensor([[2, 5, 9], [1, 3, 4]])
    ctx_valid = torch.ones(b, L, dtype=torch.bool)
    ctx_valid[1, 8:] = False  # padding
    carry_valid = torch.rand(b, 2 * k) > 0.4 if with_carry else None
    kw = dict(carry_valid=carry_valid, k=k if with_carry else 0, carry_offset=1 if with_carry else 0)
    assert torch.equal(dense_drafter_mask(anchors, ctx_valid, B, **kw), loop_drafter_mask(anchors, ctx_valid, B, **kw))


def test_verify_mask_matches_loop_reference():
    anchors = torch.tensor([[2, 6], [1, 4]])
    ctx_valid = torch.ones(2, 9, dtype=torch.bool)
    ctx_valid[0, 7:] = False
    k, L, N = 3, 9, 2
    m = verify_mask(anchors, ctx_valid, k)[:, 0]
    T = L + N * (k + 1)
    for i in range(2):
        for q in range(T):
            for kv in range(T):
                if q < L:
                    want = kv < L and kv <= q and bool(ctx_valid[i, kv])
                else:
                    n, r = divmod(q - L, k + 1)
                    if kv < L:
                        want = kv < anchors[i, n] and bool(ctx_valid[i, kv])
                    else:
                        n2, r2 = divmod(kv - L, k + 1)
                        want = n2 == n and r2 <= r
                want = want or q == kv
                assert bool(m[i, q, kv]) == want, (i, q, kv)


def _recorded_batch(target, n=6, new=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, plens = [], []
    for _ in range(n):
        p = torch.randint(1, 60, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        out = target.generate(p[None], max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        seqs.append(out[0].tolist())
        plens.append(len(p))
    return ResponseCollator(0)([{"id": i, "prompt_len": pl, "input_ids": s}
                                for i, (pl, s) in enumerate(zip(plens, seqs))])


@pytest.mark.parametrize("typ,chain,gate", [("dflash", 1, None), ("markov", 1, None), ("dflash", 2, None),
                                           ("dflash", 1, 0.0)])
def test_loss_decreases_and_every_parameter_changes(typ, chain, gate):
    target = tiny_target(init=0.3)  # a wide embedding: the frozen LM head must be able to express confidence
    drafter = tiny_drafter(target, typ, gate=gate)
    batch = _recorded_batch(target)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        kw = {} if step % 2 == 0 else {"chain": chain}
        fn = stage1_loss if step % 2 == 0 else stage2_loss  # both objectives touch every parameter between them
        loss, m = fn(drafter, drafter, target, batch, num_anchors=16, generator=torch.Generator().manual_seed(0), **kw)
        assert ("accept_run_carry_step1" in m) == (step % 2 == 1 and chain > 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    unchanged = [n for n, p in drafter.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


def full_block_loss(logits, labels, ok, weights, target_logits=None, l1_weight=0.0):
    """Reference for `block_loss`: every row `[b, N, P, V]` through the CE, `ok` applied as weights (the objectives'
    computation before they dropped the invalid rows)."""
    import torch.nn.functional as F

    w = weights[None, None, :] * ok.float()
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    denom = w.sum().clamp(min=1e-6)
    loss = (ce * w).sum() / denom
    if target_logits is not None and l1_weight > 0:
        l1 = (logits.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
        loss = (1 - l1_weight) * loss + l1_weight * (l1 * w).sum() / denom
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & ok
        acc = hit.float().sum((0, 1)) / ok.float().sum((0, 1)).clamp(min=1)
        run = torch.cumprod(hit.long(), dim=-1).sum(-1).float()
        mean_run = run[ok[..., 0]].mean() if ok[..., 0].any() else torch.tensor(0.0)
    return loss, {"ce": float((ce.detach() * w).sum() / denom), "acc_per_pos": acc.tolist(),
                  "accept_run": float(mean_run)}


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_valid_rows_only_logits_change_nothing(typ, monkeypatch):
    """The objectives compute LM-head rows for valid proposals only (`proposal_logits(..., ok)`). Loss, metrics and
    every gradient must equal the full `[b, N, P, V]` computation: padded anchors (more anchors than a response has
    positions) and proposals past a response's end are in this batch on purpose. Markov with the L1 term too."""
    from hf_carryover.training import objectives

    target = tiny_target(init=0.3)
    drafter = tiny_drafter(target, typ)
    batch = _recorded_batch(target)
    full, compact_loss = objectives.proposal_logits, objectives.block_loss

    def run(compact, fn, **kw):
        if not compact:  # the reference: every row through the head, ok applied by the loss alone
            monkeypatch.setattr(objectives, "proposal_logits", lambda d, h, prev, ok=None: full(d, h, prev))
            monkeypatch.setattr(objectives, "block_loss", full_block_loss)
        drafter.zero_grad()
        loss, m = fn(drafter, drafter, target, batch, num_anchors=64, generator=torch.Generator().manual_seed(0), **kw)
        loss.backward()
        monkeypatch.setattr(objectives, "proposal_logits", full)
        monkeypatch.setattr(objectives, "block_loss", compact_loss)
        return loss.detach(), m, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    for fn, kw in [(stage1_loss, {}), (stage2_loss, {}), (stage2_loss, {"chain": 2})]:
        (l_c, m_c, g_c), (l_f, m_f, g_f) = run(True, fn, **kw), run(False, fn, **kw)
        anchors, a_ok = sample_anchors(batch["prompt_len"], batch["seq_len"], 64, torch.Generator().manual_seed(0))
        assert not a_ok.all()  # padded anchors are present, so the compact path really drops rows
        assert torch.allclose(l_c, l_f, rtol=1e-5, atol=1e-6), (fn.__name__, kw, l_c, l_f)
        assert m_c.keys() == m_f.keys()
        for key in m_c:  # scalars and per-position lists
            assert m_c[key] == pytest.approx(m_f[key], rel=1e-5, abs=1e-6, nan_ok=True), (fn.__name__, kw, key)
        assert g_c.keys() == g_f.keys() and len(g_c) > 0
        for n in g_c:
            assert torch.allclose(g_c[n], g_f[n], rtol=1e-4, atol=1e-6), (fn.__name__, kw, n)
    if typ == "markov":  # DSpark's L1 term: the target rows must line up with the compact drafter rows
        drafter.zero_grad()
        loss, m = stage1_loss(drafter, drafter, target, batch, num_anchors=64, l1_weight=0.9,
                              generator=torch.Generator().manual_seed(0))
        ids, sl = batch["input_ids"], batch["seq_len"]
        L = ids.shape[1]
        ctx_valid = torch.arange(L)[None] < sl[:, None]
        feats, tl = target_pass(target, drafter, ids, ctx_valid, need_logits=True)
        anchors, a_ok = sample_anchors(batch["prompt_len"], sl, 64, torch.Generator().manual_seed(0))
        hidden = draft_blocks(drafter, drafter, ids, feats, ctx_valid, anchors)
        labels, ok, prev, pos = block_targets(ids, sl, anchors, a_ok, drafter.config.num_proposals)
        logits = full(drafter, hidden, prev)  # [b, N, P, V]; the target's row at pos - 1 predicts the token at pos

        def rows_at(p):  # the target's logits at positions p [b, N, P] -> [b, N, P, V]
            idx = p.clamp(max=L - 1).flatten(1)[..., None].expand(-1, -1, tl.shape[-1])  # [b, N*P, V]
            return tl.gather(1, idx).view(*p.shape, -1)

        t_full = rows_at(pos - 1)
        ref, m_ref = full_block_loss(logits, labels, ok, objectives.position_weights(drafter.config, ids.device),
                                     t_full.view_as(logits), 0.9)
        assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6) and m["ce"] == pytest.approx(m_ref["ce"], rel=1e-5)
        # negative control: target rows one position off give another loss, so the equality above can fail
        t_off = rows_at(pos)
        off, _ = full_block_loss(logits, labels, ok, objectives.position_weights(drafter.config, ids.device),
                                 t_off.view_as(logits), 0.9)
        assert not torch.allclose(off, ref, rtol=1e-4)
        # stage 2 keeps the term in every block group (t and the shifted anchors): each group's target rows are the
        # target's logits one position before each valid proposal, as gathered from the full [b, N, P, V] here
        seen_targets, seen_losses = [], []
        real_targets, real_loss = objectives.block_targets, objectives.block_loss
        monkeypatch.setattr(objectives, "block_targets", lambda *a: seen_targets.append(real_targets(*a)) or
                            seen_targets[-1])
        monkeypatch.setattr(objectives, "block_loss", lambda *a: seen_losses.append(a) or real_loss(*a))
        loss2, _ = stage2_loss(drafter, drafter, target, batch, num_anchors=64, l1_weight=0.9,
                               generator=torch.Generator().manual_seed(0))
        _, ok_all, _, pos_all = seen_targets[-1]  # the blocks [t | t1] of the gradient forward
        n = ok_all.shape[1] // 2
        assert len(seen_losses) == 2 and all(a[-1] == 0.9 and a[-2] is not None for a in seen_losses)
        for g, args in enumerate(seen_losses):
            ok_g, pos_g = ok_all[:, g * n:(g + 1) * n], pos_all[:, g * n:(g + 1) * n]
            assert torch.equal(args[-2], rows_at(pos_g - 1)[ok_g]), g
            assert not torch.equal(args[-2], rows_at(pos_g)[ok_g])
        monkeypatch.setattr(objectives, "block_loss", real_loss)
        loss0, _ = stage2_loss(drafter, drafter, target, batch, num_anchors=64,
                               generator=torch.Generator().manual_seed(0))
        assert not torch.allclose(loss2, loss0)  # the term is in the loss


@pytest.mark.parametrize("with_eos,gate", [(False, None), (True, None), (False, 1.0)])
@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_training_carryover_equals_inference_carryover(typ, with_eos, gate):
    """fp32: the rejected-row states stage 2 computes for an anchor and its proposal (one verify forward for all
    anchors, block-sparse mask) equal what generate() hands the drafter for the same prefix and proposal.
    with_eos: the EOS is a token the drafter drafts (and the target rejects) mid-sequence, so generate() crops
    those drafts after it; stage 2's carryover rows must stop there too. gate: a carryover gate (different biases per
    layer and head), whose key span sits at another offset in training (after the whole recorded context) than in
    inference (after the drafter's cache)."""
    target = tiny_target(seed=3)
    drafter = tiny_drafter(target, typ, gate=gate)
    drafter.record_carryover = True
    prompt = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(7))
    eos = None
    if with_eos:  # the most often drafted token past an accepted prefix that the target never emits
        seq = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        emitted = set(seq[0, prompt.shape[1]:].tolist())
        drafted = [t for r in drafter.last_candidate_generator.rounds[:-1] for t in r["tokens"][r["accepted"] + 1:]
                   if t not in emitted]
        eos = max(set(drafted), key=drafted.count)
    target.generation_config.eos_token_id = eos  # what stage 2 reads (eos_ids_of)
    seq = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    gen = drafter.last_candidate_generator
    rec = gen.rounds_carryover
    # Round r's carryover comes from verifying the proposals of round r-1, anchored at rec[r-1]["committed"].
    # Every drafting call (but the last) is followed by a verification; rounds[r] holds its proposals.
    pairs = [(rec[r - 1]["committed"], rec[r], gen.rounds[r - 1]["tokens"])
             for r in range(1, len(rec)) if rec[r]["features"] is not None]
    assert pairs, "the random drafter should have had rejections"
    L = seq.shape[1]
    batch = {"input_ids": seq, "prompt_len": torch.tensor([prompt.shape[1]]), "seq_len": torch.tensor([L])}
    ctx_valid = torch.ones(1, L, dtype=torch.bool)
    anchors = torch.tensor([[t for t, _, _ in pairs]])
    k = drafter.config.num_proposals
    proposals = torch.tensor([[toks + [0] * (k - len(toks)) for _, _, toks in pairs]])  # pad: rows are causal
    # (training's own draft-1 proposals are not compared: inference rounds >= 1 also see carryover rows)
    accepted, vfeats = verify_all(target, drafter, seq, ctx_valid, batch["seq_len"], anchors,
                                  torch.ones_like(anchors, dtype=torch.bool), proposals)
    for n, (t, r, _) in enumerate(pairs):
        a = int(accepted[0, n])
        n_rej = r["features"].shape[1]
        # inference may draft fewer than k near max_length; compare the rows it had
        assert torch.equal(r["positions"][0], torch.arange(t + a + 1, t + a + 1 + n_rej))
        torch.testing.assert_close(vfeats[0, n, a: a + n_rej], r["features"][0], atol=1e-5, rtol=1e-4)
        assert a + n_rej <= k

    # and the drafts themselves: stage 2's second draft at the shifted anchor t+a+1, with these rows as carryover,
    # proposes what generate()'s drafter proposed in the round that received them (states equal is not enough:
    # the rows' visibility and positions inside the drafter must match too)
    idx = [r for r in range(1, len(rec)) if rec[r]["features"] is not None]
    anchors2 = anchors + accepted + 1
    j = torch.arange(1, k + 1)
    carry_valid = carryover_rows_valid(proposals, accepted, eos_ids_of(target))  # as stage2_loss computes them
    if with_eos:
        assert not torch.equal(carry_valid, j[None, None] > accepted[:, :, None]), "no draft was cropped at EOS"
    feats, _ = target_pass(target, drafter, seq, ctx_valid, need_logits=False)
    with torch.no_grad():
        hidden = draft_blocks(drafter, drafter, seq, feats, ctx_valid, torch.cat([anchors, anchors2], 1),
                              carry=vfeats.flatten(1, 2), carry_pos=(anchors[:, :, None] + j).flatten(1),
                              carry_valid=carry_valid.flatten(1), k=k, carry_offset=anchors.shape[1])
        second = greedy_proposals(drafter, hidden[:, anchors.shape[1]:], seq.gather(1, anchors2))
    checked = 0
    for n, r in enumerate(idx):
        if r >= len(gen.rounds):  # the last call, with no room left to draft
            continue
        toks = gen.rounds[r]["tokens"]  # the proposals drafted with round r's carryover rows
        checked += 1
        assert second[0, n, : len(toks)].tolist() == toks, (n, second[0, n].tolist(), toks)
    assert checked >= 2


def test_trainer_runs_and_resumes(tmp_path, monkeypatch):
    """CPU: a tiny stage-1 run through `trainer/train.py`, then stage 2 from its output, then a resume."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from trainer.train import main

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    prompts = [(f"p{i}", torch.randint(1, 60, (5,)).tolist()) for i in range(12)]
    regenerate_responses(target, prompts, tmp_path / "data", max_new_tokens=20, batch_size=6, shard_size=6)
    assert 8 <= len(ResponseDataset(tmp_path / "data")) <= 12  # records with < 2 response tokens are dropped
    common = ["--target", str(tmp_path / "target"), "--target_dtype", "float32", "--data_dir", str(tmp_path / "data"),
              "--eval_data_dir", str(tmp_path / "data"), "--block_size", "4", "--num_hidden_layers", "2",
              "--mask_token_id", "5", "--per_device_train_batch_size", "4", "--num_anchors", "8",
              "--report_to", "none", "--use_cpu", "true", "--logging_steps", "1", "--save_steps", "2"]
    main(common + ["--output_dir", str(tmp_path / "s1"), "--max_steps", "2"])
    metrics = json.loads((tmp_path / "s1" / "final" / "eval_metrics.json").read_text())
    assert len(metrics["eval_acc_per_pos"]) == 3
    main(common + ["--output_dir", str(tmp_path / "s2"), "--max_steps", "2", "--stage", "2",
                   "--carryover", "true", "--init_from", str(tmp_path / "s1" / "final")])
    metrics = json.loads((tmp_path / "s2" / "final" / "eval_metrics.json").read_text())
    assert "eval_acc_per_pos_carry" in metrics
    # the eval-only diagnostic (carryover rows withheld at the same shifted anchors) is there, per position
    assert len(metrics["eval_acc_per_pos_carry_withheld"]) == 3 and "eval_accept_run_carry_withheld" in metrics
    log = json.loads((tmp_path / "s2" / "final" / "train_log.json").read_text())
    assert not [e for e in log if "train_accept_run_carry_withheld" in e]  # training steps skip the extra forward
    # --l1_weight reaches stage 2's objective (DSpark's term in every term there), with the chain setting beside it
    from hf_carryover.training import trainer as trainer_mod
    seen = []
    real = trainer_mod.stage2_loss
    monkeypatch.setattr(trainer_mod, "stage2_loss", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    main(common + ["--output_dir", str(tmp_path / "s2l1"), "--max_steps", "1", "--stage", "2", "--carryover", "true",
                   "--l1_weight", "0.9", "--init_from", str(tmp_path / "s1" / "final")])
    assert seen and all(kw["l1_weight"] == 0.9 and kw["chain"] == 1 for kw in seen)
    monkeypatch.undo()
    # continuing from a bf16 folder (a shipped or packed drafter) trains fp32 master weights, not bf16 ones
    Drafter.from_pretrained(tmp_path / "s1" / "final", dtype=torch.bfloat16).save_pretrained(tmp_path / "s1_bf16")
    cont = main(common + ["--output_dir", str(tmp_path / "s1c"), "--max_steps", "1",
                          "--init_from", str(tmp_path / "s1_bf16")])
    assert {p.dtype for p in cont.model.parameters()} == {torch.float32}
    trainer = main(common + ["--output_dir", str(tmp_path / "s1"), "--max_steps", "4",
                             "--resume_from_checkpoint", "auto"])
    assert trainer.state.global_step == 4
    with pytest.raises(ValueError, match="carryover=True"):
        main(common + ["--output_dir", str(tmp_path / "bad"), "--max_steps", "1", "--stage", "2"])
    with pytest.raises(ValueError, match="carry_chain=0"):
        main(common + ["--output_dir", str(tmp_path / "bad"), "--max_steps", "1", "--stage", "2", "--carryover", "true",
                       "--init_from", str(tmp_path / "s1" / "final"), "--carry_chain", "0"])
    # a chained stage 2 through the script: the chain's first-step metric is logged beside the last step's
    main(common + ["--output_dir", str(tmp_path / "s2c"), "--max_steps", "1", "--stage", "2", "--carryover", "true",
                   "--init_from", str(tmp_path / "s1" / "final"), "--carry_chain", "2"])
    assert "eval_accept_run_carry_step1" in json.loads((tmp_path / "s2c" / "final" / "eval_metrics.json").read_text())


def test_block_targets_layouts():
    """DFlash proposal j and Markov proposal j both predict the token at anchor + j; Markov has one more."""
    ids = torch.arange(20)[None]
    anchors = torch.tensor([[3]])
    ok = torch.ones(1, 1, dtype=torch.bool)
    labels, valid, prev, _ = block_targets(ids, torch.tensor([20]), anchors, ok, 4)
    assert labels[0, 0].tolist() == [4, 5, 6, 7] and prev[0, 0].tolist() == [3, 4, 5, 6]
    labels, valid, _, _ = block_targets(ids, torch.tensor([6]), anchors, ok, 4)
    assert valid[0, 0].tolist() == [True, True, False, False]
    a, v = sample_anchors(torch.tensor([2]), torch.tensor([5]), 8)
    assert a[0, v[0]].tolist() == [2, 3]


def test_verify_argmax_rows_on_a_greedy_recording():
    """verify_all(return_argmax=True): proposing the recorded greedy tokens themselves, every block is accepted
    and row j's argmax is the recorded token at t+j+1 (the target's own greedy choice, computed inside the
    block-sparse verify forward)."""
    target = tiny_target(seed=2)
    drafter = tiny_drafter(target)
    batch = _recorded_batch(target, n=2, new=14)
    ids, seq_len = batch["input_ids"], batch["seq_len"]
    L, k = ids.shape[1], drafter.config.num_proposals
    ctx = torch.arange(L)[None] < seq_len[:, None]
    anchors, ok = sample_anchors(batch["prompt_len"], seq_len - k - 1, 4, torch.Generator().manual_seed(0))
    labels, _, _, _ = block_targets(ids, seq_len, anchors, ok, k)
    acc, _, arg = verify_all(target, drafter, ids, ctx, seq_len, anchors, ok, labels, return_argmax=True)
    assert ok.any() and bool((acc[ok] == k).all())
    nxt = ids.gather(1, (anchors[:, :, None] + torch.arange(1, k + 2)).clamp(max=L - 1).flatten(1)).view_as(arg)
    assert torch.equal(arg[ok], nxt[ok])


def test_eval_metrics_pool_every_process():
    """Data-parallel evaluation: each process holds its shard's per-batch metrics; the reported held-out metrics
    must be those of the whole set (as if one process had evaluated every batch), not of the main process's shard."""
    from hf_carryover.training.trainer import _reduce

    shard0 = {"accept_run": [1.0, float("nan"), 2.0], "acc_per_pos": [[0.5, 0.2], [0.7, 0.4]]}
    shard1 = {"accept_run": [4.0], "acc_per_pos": [[0.9, 0.6]]}
    sums1 = []
    _reduce(shard1, "eval_", allsum=lambda t: sums1.append(t) or t)  # process 1's sums, in key order
    it = iter(sums1)
    pooled = _reduce(shard0, "eval_", allsum=lambda t: t + next(it))  # the all-reduce, as process 0 sees it
    assert pooled == _reduce({k: shard0[k] + shard1[k] for k in shard0}, "eval_")
    assert pooled["eval_accept_run"] == round(7 / 3, 5) and pooled != _reduce(shard0, "eval_")


@pytest.mark.parametrize("typ", ["dflash", "markov"])
def test_carry_chain_follows_generate_rounds(typ):
    """stage 2's chain from the first anchor of a generate() run replays its rounds: the row-free first draft,
    then drafts with the rows of a draft that itself had rows (decoding's case), anchors and proposals alike."""
    target = tiny_target(seed=3)
    drafter = tiny_drafter(target, typ)
    drafter.record_carryover = True
    prompt = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(7))
    seq = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    gen = drafter.last_candidate_generator
    rec = gen.rounds_carryover
    chain = min(8, len(gen.rounds) - 2)  # the last rounds may be cut by the length budget
    assert chain >= 3
    L = seq.shape[1]
    ctx = torch.ones(1, L, dtype=torch.bool)
    feats, _ = target_pass(target, drafter, seq, ctx, need_logits=False)
    target.generation_config.eos_token_id = None  # as generate() was told
    c = carry_chain(drafter, target, seq, feats, ctx, torch.tensor([L]), torch.tensor([[rec[0]["committed"]]]),
                    torch.ones(1, 1, dtype=torch.bool), chain=chain)
    assert [int(a) for a in c["anchors"]] == [rec[r]["committed"] for r in range(chain + 1)]
    k = drafter.config.num_proposals
    with torch.no_grad():  # the last draft: at t_chain with the rows of the one before, as the gradient forward has it
        rows = c["rows"][-1]
        h = draft_blocks(drafter, drafter, seq, feats, ctx, c["anchors"][-1], carry=rows[0], carry_pos=rows[1],
                         carry_valid=rows[2], k=k)
        last = greedy_proposals(drafter, h, seq.gather(1, c["anchors"][-1]))
    for r, props in enumerate(c["proposals"] + [last]):
        toks = gen.rounds[r]["tokens"]
        assert props[0, 0, : len(toks)].tolist() == toks, r


def test_one_process_seeing_several_gpus_is_refused(tmp_path, monkeypatch):
    """One process with two visible GPUs would make Trainer run DataParallel: twice the batch, the frozen target on
    one GPU (what the 2026-11-29 "1-GPU" DDP comparison ran without knowing). The trainer refuses, naming the fix."""
    target = tiny_target()
    drafter = Drafter.from_target(target, drafter_type="dflash", carryover=False, block_size=4, num_hidden_layers=1,
                                  mask_token_id=5)
    args = CarryoverTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    CarryoverTrainer(model=drafter, args=args, target=target)  # one device: fine
    monkeypatch.setattr(CarryoverTrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError,
                       match="sees 2 GPUs.*DataParallel.*--num_processes 2 --multi_gpu.*CUDA_VISIBLE_DEVICES"):
        CarryoverTrainer(model=drafter, args=args, target=target)


def test_sampled_response_sets(tmp_path, monkeypatch):
    """T=1 regeneration: a seed reproduces its set, another seed gives another set, and tokens come from the whole
    distribution (top-k off: transformers' default top_k=50 would never pick a token ranked 50 or lower); the
    script's --start skips prompts a greedy set already covers."""
    import sys
    from pathlib import Path

    target = tiny_target(vocab=128, init=0.005)  # a flat distribution: low ranks get sampled
    prompts = [(f"p{i}", [3 + i, 9, 4, 7]) for i in range(8)]

    def responses(out, **kw):
        regenerate_responses(target, prompts, tmp_path / out, max_new_tokens=16, batch_size=4, **kw)
        return [r["input_ids"] for r in ResponseDataset(tmp_path / out).records]

    a, b, c = responses("a", temperature=1.0, seed=0), responses("b", temperature=1.0, seed=0), \
        responses("c", temperature=1.0, seed=1)
    assert a == b and a != c
    greedy = responses("g")
    assert greedy == responses("g2", temperature=0.0, seed=5)  # greedy ignores the seed
    with torch.no_grad():  # rank of every sampled token under the target's distribution at its step
        ranks = []
        for seq in a:
            logits = target(torch.tensor([seq])).logits[0, 3:-1]  # predictions for tokens 4..end
            tok = torch.tensor(seq[4:])
            ranks += (logits > logits.gather(1, tok[:, None])).sum(1).tolist()
    assert max(ranks) >= 50
    target.save_pretrained(tmp_path / "target")
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"id": pid, "input_ids": ids}) + "\n" for pid, ids in prompts))
    # the script's command line, run in this process as test_regenerate_with_vllm_plumbing runs it (a new process
    # would spend ~6 s importing torch and transformers)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "trainer"))
    import regenerate

    monkeypatch.setattr(sys, "argv", ["regenerate.py", "--target", str(tmp_path / "target"), "--prompts", str(pfile),
                                      "--out", str(tmp_path / "late"), "--start", "5", "--dtype", "float32",
                                      "--max_new_tokens", "4", "--temperature", "1", "--seed", "3"])
    regenerate.main()
    assert [r["id"] for r in ResponseDataset(tmp_path / "late").records] == ["p5", "p6", "p7"]


def test_response_dataset_reads_several_folders_and_names_a_missing_one(tmp_path):
    """Comma-separated roots: a training set that swaps one response set for another shares the rest; a typo in one
    root must not silently drop its data."""
    for name, ids in (("a/w0", ["a1", "a2"]), ("b", ["b1"])):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "shard-00000.jsonl").write_text(
            "".join(json.dumps({"id": i, "prompt_len": 2, "input_ids": [1, 2, 3, 4]}) + "\n" for i in ids))
    both = ResponseDataset(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert [r["id"] for r in both.records] == ["a1", "a2", "b1"]
    with pytest.raises(ValueError, match="not found.*nope"):
        ResponseDataset(f"{tmp_path / 'a'},{tmp_path / 'nope'}")


def test_regenerate_with_vllm_plumbing(tmp_path, monkeypatch, capsys):
    """`trainer/regenerate.py --engine vllm` against a stand-in `vllm` module (vLLM itself runs on the GPU only): token
    ids go in as prompt_token_ids, each request gets its own seed when sampling, the model's generation config is
    ignored, a response that stopped at EOS keeps one, responses are cut after their first EOS, and the shards are
    the same records transformers' path writes."""
    import sys
    import types
    from pathlib import Path

    calls = {}

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            calls["llm"] = kw

        def generate(self, prompts, params, use_tqdm=True):
            calls.setdefault("params", []).extend(p.kw for p in params)
            outs = []
            for q in prompts:
                first = q["prompt_token_ids"][0]
                toks = [first + 10, 2, 7] if first == 5 else [first + 10, first + 11]  # 5: EOS mid-way
                finish = "stop" if first % 2 == 0 else "length"  # even: stopped at an EOS vLLM left out
                done = types.SimpleNamespace(token_ids=toks, finish_reason=finish)
                outs.append(types.SimpleNamespace(outputs=[done]))
            return outs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    target = tiny_target(vocab=128)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(tmp_path / "target")
    prompts = [(f"p{i}", [3 + i, 9, 4, 7]) for i in range(4)]
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"id": pid, "input_ids": ids}) + "\n" for pid, ids in prompts))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "trainer"))
    import regenerate

    monkeypatch.setattr(sys, "argv", ["regenerate.py", "--engine", "vllm", "--target", str(tmp_path / "target"),
                                      "--prompts", str(pfile), "--out", str(tmp_path / "v"), "--temperature", "1",
                                      "--seed", "40", "--batch_size", "2", "--max_new_tokens", "6"])
    regenerate.main()
    assert calls["llm"]["generation_config"] == "vllm" and calls["llm"]["max_model_len"] == 4 + 6 + 8
    assert [p["seed"] for p in calls["params"]] == [40, 41, 42, 43]  # batch i at seed + i, request j at + j
    assert all(p["max_tokens"] == 6 and p["temperature"] == 1.0 and p["top_p"] == 1.0 for p in calls["params"])
    records = {r["id"]: r["input_ids"][r["prompt_len"]:] for r in ResponseDataset(tmp_path / "v").records}
    assert records == {"p0": [13, 14], "p1": [14, 15, 2], "p2": [15, 2], "p3": [16, 17, 2]}

    # --sets: several sets from one engine, each in its own folder, greedy without seeds, sampled with its own
    engines = []
    monkeypatch.setattr(LLM, "__init__", lambda self, **kw: engines.append(kw))
    calls["params"] = []
    base = ["regenerate.py", "--engine", "vllm", "--target", str(tmp_path / "target"), "--prompts", str(pfile),
            "--out", str(tmp_path / "sets"), "--batch_size", "4", "--max_new_tokens", "6"]
    monkeypatch.setattr(sys, "argv", base + ["--sets", "0:0", "1:7"])
    regenerate.main()
    assert len(engines) == 1  # one engine start for both sets
    assert [p["seed"] for p in calls["params"]] == [None] * 4 + [7, 8, 9, 10]
    assert [p["temperature"] for p in calls["params"]] == [0.0] * 4 + [1.0] * 4
    for name in ("regen-T0-s0", "regen-T1-s7"):
        assert {r["id"] for r in ResponseDataset(tmp_path / "sets" / name).records} == {"p0", "p1", "p2", "p3"}
    for bad, msg in ((["--sets", "1"], "expected T:SEED"), (["--sets", "0:0", "0:0"], "same folder"),
                     (["--sets", "1:-1"], ">= 0")):
        monkeypatch.setattr(sys, "argv", base + bad)
        with pytest.raises(SystemExit):
            regenerate.main()
        assert msg in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["regenerate.py", "--prompts", str(pfile), "--out", str(tmp_path / "t"),
                                      "--sets", "0:0"])
    with pytest.raises(SystemExit):
        regenerate.main()
    assert "needs --engine vllm" in capsys.readouterr().err


def test_regeneration_reports_progress_per_batch_and_counts_resumed_shards(tmp_path, monkeypatch):
    """A shard can take many minutes on a CPU: progress moves per generated batch, and a resumed run counts the
    shards already on disk as done instead of generating them again."""
    from hf_carryover.training import data as data_mod

    seen = []
    monkeypatch.setattr(data_mod._Progress, "update", lambda self, n: seen.append(n))
    calls = []

    def respond(prompts, seed):  # a stand-in source of responses: each prompt's last token, then EOS (id 2)
        calls.append(len(prompts))
        return [[p[-1], 2] for p in prompts]

    prompts = [(f"p{i}", [5 + i, 7]) for i in range(10)]
    kw = dict(batch_size=3, shard_size=6, respond=respond, eos_token_id=2)
    regenerate_responses(None, prompts[:6], tmp_path / "d", **kw)  # the first shard only, as a run cut after it
    assert seen == [3, 3] and calls == [3, 3]
    seen.clear(), calls.clear()
    regenerate_responses(None, prompts, tmp_path / "d", **kw)
    assert seen == [6, 3, 1] and calls == [3, 1]  # shard 0 from disk, shard 1 in batches of 3 and 1
    assert len(ResponseDataset(tmp_path / "d").records) == 10
