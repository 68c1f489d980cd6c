"""Training objectives: many anchors per recorded response in one drafter forward.

Stage 1 (DESIGN.md §3/§4): N random anchors per sequence; every block sees the committed context before its
anchor (target features of the recorded response) and itself. Loss: position-decayed CE (+ optional DSpark
L1 between draft and target distributions).

Stage 2, Carryover (DESIGN.md §5), parallel draft-verify-draft:
  1. draft a block at each anchor t (no grad);
  2. the frozen target verifies all N proposals in ONE forward over `[recorded | N blocks of k+1]` with a
     block-sparse mask, giving accepted lengths a (vs the recorded tokens) and the rejected rows' states;
  3. draft again at the shifted anchor t' = t + a + 1 with those rows as carryover; supervise with the
     recorded tokens.
The gradient forward holds both the step-1 blocks (stage-1 loss, so the drafter keeps working without
carryover: first round, after a full accept) and the step-3 blocks — one forward, one backward.
`chain` > 1 (`--carry_chain`) repeats 2–3 (no grad) so that later blocks get the rows of a draft that itself had
rows, as in every decoding round after the first (`carry_chain`).

Batch dict: `input_ids [b, L]` (right-padded), `prompt_len [b]`, `seq_len [b]` (real length).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..generation_carryover import drafts_through_eos, eos_tensor
from .masks import dense_drafter_mask, flex_drafter_mask, verify_mask


@torch.no_grad()
def target_pass(target, drafter, input_ids, valid, need_logits: bool):
    """Tapped target features `[b, L, n*d]` (and logits) of the recorded sequences."""
    out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True, use_cache=False)
    feats = drafter.target_features(out.hidden_states)
    return feats, (out.logits if need_logits else None)


def sample_anchors(prompt_len, seq_len, num_anchors: int, generator=None):
    """Up to N distinct anchors per sequence in [prompt_len, seq_len-2] (positions of committed response tokens
    that still have a next token). Returns anchors `[b, N]` and a validity mask (short responses pad)."""
    b = prompt_len.shape[0]
    dev = prompt_len.device
    anchors = torch.zeros(b, num_anchors, dtype=torch.long, device=dev)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool, device=dev)
    for i in range(b):
        lo, hi = int(prompt_len[i]), int(seq_len[i]) - 1  # anchors t with t+1 < seq_len
        n = hi - lo
        if n <= 0:
            continue
        perm = torch.randperm(n, generator=generator)[:num_anchors].to(dev) + lo
        anchors[i, : perm.numel()] = perm.sort().values
        valid[i, : perm.numel()] = True
    return anchors, valid


def block_targets(input_ids, seq_len, anchors, anchor_valid, num_proposals: int):
    """Labels `[b, N, P]` (token at t+j, j=1..P), their validity, and the previous tokens (t+j-1) for the Markov
    head."""
    L = input_ids.shape[1]
    j = torch.arange(1, num_proposals + 1, device=input_ids.device)
    pos = anchors[:, :, None] + j  # [b, N, P]
    ok = anchor_valid[:, :, None] & (pos < seq_len[:, None, None])
    labels = input_ids.gather(1, pos.clamp(max=L - 1).flatten(1)).view_as(pos)
    prev = input_ids.gather(1, (pos - 1).clamp(max=L - 1).flatten(1)).view_as(pos)
    return labels, ok, prev, pos


def position_weights(cfg, device):
    """exp(-(j-1)/gamma) for proposal j = 1..P (DFlash's decay; gamma from the block size)."""
    j = torch.arange(1, cfg.num_proposals + 1, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / cfg.decay_gamma)


def proposal_logits(drafter, hidden, prev_tokens, ok=None):
    """Drafter hidden `[b, N, B, d]` -> proposal logits `[b, N, P, V]` (Markov: + bigram term, teacher-forced).

    With `ok` (`[b, N, P]`, bool) only the rows that count: `[n_ok, V]`, in `ok`'s row-major order. Why: padded
    anchors (a response with fewer positions than the anchor count) and proposals past a response's end can be a
    large share of the rows, and each costs a vocabulary-wide LM-head row and fp32 CE row (and their gradients) for
    nothing."""
    rows = hidden[:, :, drafter.proposal_rows()]
    if ok is not None:
        rows, prev_tokens = rows[ok], prev_tokens[ok]  # [n_ok, d], [n_ok]
    logits = drafter.lm_logits(rows).float()
    if drafter.config.drafter_type == "markov":
        logits = logits + drafter.markov_bias(prev_tokens).float()
    return logits


def target_rows(tlogits, ok, pos):
    """The target's logits for each valid proposal row, `[n_ok, V]` in `ok`'s row-major order: the row at position
    pos - 1 of that row's sequence predicts the token at pos, as the proposal does (DSpark's L1 term compares them)."""
    rows = ok.nonzero(as_tuple=True)[0]  # the sequence of each valid row
    return tlogits[rows, (pos[ok] - 1).clamp(max=tlogits.shape[1] - 1)]


def _data_parallel_denominator(denom):
    """The loss denominator shared by all data-parallel ranks: the mean of their weight sums.

    Why: DDP averages the ranks' gradients. With each rank dividing by its own weight sum, that average weighs a
    token on a rank of short responses more than one on a rank of long ones, so 2 GPUs at 8 sequences each train
    (and log) a different mean than 1 GPU at 16. The 2026-11-30e check on the real target showed the 2-GPU curve
    0.04-0.35 below the 1-GPU one at every logged step from step 20 on, on the same batches. Dividing by the mean
    weight sum instead makes the averaged gradient the single-process one exactly (`tests/test_train_scripts.py`, 2 CPU
    processes against 1). Re-run on the GPU with it (2026-11-30f), the mean gap fell from 0.101 to 0.064 and the
    curves cross after step 100.
    Only while training (gradients on): evaluation pools its own way, and a collective there is not needed."""
    import torch.distributed as dist

    if not (torch.is_grad_enabled() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return denom
    total = denom.detach().clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).clamp(min=1e-6)


def block_loss(logits, labels, ok, weights, target_logits=None, l1_weight: float = 0.0):
    """Weighted CE (+ l1_weight * ||p_draft - p_target||_1, which is 2*TV) and per-position accuracy.

    `logits` (and `target_logits`) hold the valid rows only, `[n_ok, V]` in `ok`'s row-major order
    (`proposal_logits(..., ok=ok)`); `labels` and `ok` are `[b, N, P]`."""
    w, lab = (weights[None, None, :] * ok.float())[ok], labels[ok]  # [n_ok] each
    ce = F.cross_entropy(logits, lab, reduction="none")
    denom = w.sum().clamp(min=1e-6)
    shared = _data_parallel_denominator(denom)  # = denom in one process
    loss = (ce * w).sum() / shared
    if target_logits is not None and l1_weight > 0:
        l1 = (logits.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
        loss = (1 - l1_weight) * loss + l1_weight * (l1 * w).sum() / shared
    with torch.no_grad():
        hit = torch.zeros_like(ok)  # [b, N, P]
        hit[ok] = logits.argmax(-1) == lab
        acc = hit.float().sum((0, 1)) / ok.float().sum((0, 1)).clamp(min=1)
        # expected accepted drafts if each block were verified: leading run of hits
        run = torch.cumprod(hit.long(), dim=-1).sum(-1).float()
        mean_run = run[ok[..., 0]].mean() if ok[..., 0].any() else torch.tensor(0.0)
    return loss, {"ce": float((ce.detach() * w).sum() / denom), "acc_per_pos": acc.tolist(),
                  "accept_run": float(mean_run)}


def _block_embeds_positions(drafter, input_ids, anchors):
    B = drafter.config.block_size
    embeds = drafter.embed_block(input_ids.gather(1, anchors))  # [b, N*B, d]
    positions = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).flatten(1)  # [b, N*B]
    return embeds, positions


def _mask(backend, anchors, ctx_valid, B, carry_valid=None, k=0, carry_offset=0):
    fn = flex_drafter_mask if backend == "flex" else dense_drafter_mask
    return fn(anchors, ctx_valid, B, carry_valid=carry_valid, k=k, carry_offset=carry_offset)


def draft_blocks(model, drafter, input_ids, feats, ctx_valid, anchors, carry=None, carry_pos=None,
                 carry_valid=None, k=0, carry_offset=0, backend="sdpa"):
    """One drafter forward for all blocks; returns hidden `[b, N, B, d]`. `model` may be a DDP wrapper."""
    b, L = input_ids.shape
    B = drafter.config.block_size
    embeds, positions = _block_embeds_positions(drafter, input_ids, anchors)
    mask = _mask(backend, anchors, ctx_valid, B, carry_valid, k, carry_offset)
    ctx_pos = torch.arange(L, device=input_ids.device)[None].expand(b, -1)
    hidden = model(embeds, positions, context_features=feats, context_positions=ctx_pos,
                   carryover_features=carry, carryover_positions=carry_pos, attn_mask=mask)
    return hidden.view(b, anchors.shape[1], B, -1)


@torch.no_grad()
def greedy_proposals(drafter, hidden, anchor_tokens):
    """Proposals `[b, N, P]` as inference would choose them greedily (Markov: left to right on own tokens)."""
    base = drafter.lm_logits(hidden[:, :, drafter.proposal_rows()]).float()
    if drafter.config.drafter_type != "markov":
        return base.argmax(-1)
    return drafter.propose(base, anchor_tokens, lambda row: (row, row.argmax(-1)))[0]


@torch.no_grad()
def verify_all(target, drafter, input_ids, ctx_valid, seq_len, anchors, anchor_valid, proposals,
               return_argmax: bool = False):
    """One target forward verifying every anchor's `[x_t, d_1..d_k]` against the recorded prefix.

    Returns accepted lengths `a [b, N]` (leading proposals equal to the recorded tokens) and the tapped
    features of verify rows 1..k `[b, N, k, n*d]` at positions t+1..t+k (row j's input is d_j); with
    `return_argmax`, also the target's argmax at every verify row `[b, N, k+1]` (row j predicts position t+j+1).
    """
    b, L = input_ids.shape
    N, k = proposals.shape[1], proposals.shape[2]
    blocks = torch.cat([input_ids.gather(1, anchors)[:, :, None], proposals], dim=2)  # [b, N, k+1]
    ids = torch.cat([input_ids, blocks.flatten(1)], dim=1)
    pos_blk = (anchors[:, :, None] + torch.arange(k + 1, device=anchors.device)).flatten(1)
    pos = torch.cat([torch.arange(L, device=anchors.device)[None].expand(b, -1), pos_blk], dim=1)
    mask = verify_mask(anchors, ctx_valid, k)
    out = target(input_ids=ids, position_ids=pos, attention_mask=mask, output_hidden_states=True, use_cache=False)
    feats = drafter.target_features(out.hidden_states, slice(L, None)).view(b, N, k + 1, -1)[:, :, 1:]
    recorded, ok, _, _ = block_targets(input_ids, seq_len, anchors, anchor_valid, k)
    accepted = torch.cumprod((proposals == recorded).long() * ok.long(), dim=-1).sum(-1)
    if return_argmax:
        return accepted, feats, out.logits[:, L:].argmax(-1).view(b, N, k + 1)
    return accepted, feats


def carryover_rows_valid(proposals, accepted, eos_ids=None):
    """Which verify rows 1..k of each anchor become carryover: `[b, N, k]`, rows past the accepted prefix, and not
    past the first drafted EOS. Inference crops a draft after a drafted EOS (generate() never verifies the rest,
    and the engine follows it), so those rows never reach the drafter there and must not in training either."""
    j = torch.arange(1, proposals.shape[-1] + 1, device=proposals.device)
    valid = j > accepted[..., None]
    if eos_ids is not None:
        valid &= j <= drafts_through_eos(proposals, eos_ids)[..., None]
    return valid


def eos_ids_of(target):
    """The target's EOS ids as a tensor `[n]` (generation_config may hold None, an int or a list)."""
    return eos_tensor(getattr(getattr(target, "generation_config", None), "eos_token_id", None))


def stage1_loss(model, drafter, target, batch, num_anchors=512, l1_weight=0.0, backend="sdpa", generator=None):
    input_ids, seq_len, prompt_len = batch["input_ids"], batch["seq_len"], batch["prompt_len"]
    L = input_ids.shape[1]
    ctx_valid = torch.arange(L, device=input_ids.device)[None] < seq_len[:, None]
    feats, tlogits = target_pass(target, drafter, input_ids, ctx_valid, need_logits=l1_weight > 0)
    anchors, a_ok = sample_anchors(prompt_len, seq_len, num_anchors, generator)
    hidden = draft_blocks(model, drafter, input_ids, feats, ctx_valid, anchors, backend=backend)
    labels, ok, prev, pos = block_targets(input_ids, seq_len, anchors, a_ok, drafter.config.num_proposals)
    logits = proposal_logits(drafter, hidden, prev, ok)  # [n_ok, V]
    t_logits = target_rows(tlogits, ok, pos) if tlogits is not None else None  # [n_ok, V]
    loss, m = block_loss(logits, labels, ok, position_weights(drafter.config, input_ids.device), t_logits, l1_weight)
    return loss, m


def carry_chain(drafter, target, input_ids, feats, ctx_valid, seq_len, anchors, a_ok, chain=1, backend="sdpa"):
    """The no-grad part of stage 2: draft at t without rows, verify, shift to t1 = t+a+1; then `chain`-1 more
    steps of draft (with the rows just handed on) → verify → shift, as decoding does round after round.

    Returns the block anchors `[t, t1, .., t_chain]` and their validity, per shifted anchor the rows it receives
    (features `[b, N*k, n*d]`, positions `[b, N*k]`, validity `[b, N*k]`), and per step the proposals drafted at
    `anchors[i]` and their accepted lengths `[b, N]`."""
    eos = eos_ids_of(target)
    with torch.no_grad():
        h = draft_blocks(drafter, drafter, input_ids, feats, ctx_valid, anchors, backend=backend)
        proposals = greedy_proposals(drafter, h, input_ids.gather(1, anchors))
    k = proposals.shape[2]
    j = torch.arange(1, k + 1, device=input_ids.device)
    out = {"anchors": [anchors], "ok": [a_ok], "rows": [], "proposals": [proposals], "accepted": []}
    cur, cur_ok = anchors, a_ok
    for step in range(chain):
        accepted, vfeats = verify_all(target, drafter, input_ids, ctx_valid, seq_len, cur, cur_ok, proposals)
        out["accepted"].append(accepted)
        nxt = cur + accepted + 1  # the shifted anchor: the correction's position
        nxt_ok = cur_ok & (nxt <= seq_len[:, None] - 2)
        nxt = torch.where(nxt_ok, nxt, cur)
        # rows a+1..k are rejected (up to a drafted EOS, as at inference)
        valid = carryover_rows_valid(proposals, accepted, eos) & nxt_ok[:, :, None]
        rows = (vfeats.flatten(1, 2), (cur[:, :, None] + j).flatten(1), valid.flatten(1))
        out["anchors"].append(nxt)
        out["ok"].append(nxt_ok)
        out["rows"].append(rows)
        if step + 1 < chain:  # the next draft of the chain, with these rows, as decoding's next round makes it
            with torch.no_grad():
                h = draft_blocks(drafter, drafter, input_ids, feats, ctx_valid, nxt, carry=rows[0], carry_pos=rows[1],
                                 carry_valid=rows[2], k=k, backend=backend)
                proposals = greedy_proposals(drafter, h, input_ids.gather(1, nxt))
            out["proposals"].append(proposals)
        cur, cur_ok = nxt, nxt_ok
    return out


def stage2_loss(model, drafter, target, batch, num_anchors=128, l1_weight=0.0, backend="sdpa", generator=None,
                chain=1):
    """Parallel draft-verify-draft (see module docstring). Loss = stage-1 term at t + carryover term.

    chain=1 trains the draft at t1 with the rows of a draft made *without* rows. After its first round, decoding
    hands a drafter only rows of drafts that themselves had rows; `examples/carryover_chain_probe.py` found the
    rows help in the first case and not in the second (2026-11-30b). chain=c follows the chain c steps (no grad)
    and trains the draft at every shifted anchor t1..tc with the rows handed to it; the carryover term is their
    mean. All blocks share one gradient forward. l1_weight > 0 (DSpark's term, the Markov drafter) keeps stage 1's
    (1-w) CE + w L1 in every term, so that a Markov pair's Carryover member trains the objective its baseline
    continues with."""
    input_ids, seq_len, prompt_len = batch["input_ids"], batch["seq_len"], batch["prompt_len"]
    cfg, dev = drafter.config, input_ids.device
    ctx_valid = torch.arange(input_ids.shape[1], device=dev)[None] < seq_len[:, None]
    feats, tlogits = target_pass(target, drafter, input_ids, ctx_valid, need_logits=l1_weight > 0)
    anchors, a_ok = sample_anchors(prompt_len, seq_len, num_anchors, generator)
    c = carry_chain(drafter, target, input_ids, feats, ctx_valid, seq_len, anchors, a_ok, chain, backend)
    N, k = anchors.shape[1], c["proposals"][0].shape[2]
    # blocks [t | t1 | .. | t_chain]; row group g (of the chain*N) is seen by block N + g alone
    all_anchors = torch.cat(c["anchors"], dim=1)
    carry, carry_pos, carry_valid = (torch.cat(x, 1) for x in zip(*c["rows"]))  # [b, chain*N*k, ...]
    hidden = draft_blocks(model, drafter, input_ids, feats, ctx_valid, all_anchors, carry=carry, carry_pos=carry_pos,
                          carry_valid=carry_valid, k=k, carry_offset=N, backend=backend)
    labels, ok, prev, pos = block_targets(input_ids, seq_len, all_anchors, torch.cat(c["ok"], 1), cfg.num_proposals)
    w = position_weights(cfg, dev)
    terms = []
    for s in range(chain + 1):  # group s: the blocks at t (s = 0) or at the s-th shifted anchor
        g = slice(s * N, (s + 1) * N)
        logits = proposal_logits(drafter, hidden[:, g], prev[:, g], ok[:, g])  # [n_ok of group s, V]
        t_logits = target_rows(tlogits, ok[:, g], pos[:, g]) if tlogits is not None else None
        terms.append(block_loss(logits, labels[:, g], ok[:, g], w, t_logits, l1_weight))
    (loss1, m1), m2 = terms[0], terms[-1][1]  # carry metrics: the last step (decoding's case when chain > 1)
    loss_carry = sum(t[0] for t in terms[1:]) / chain
    last, last_ok = c["anchors"][-1], c["ok"][-1]
    if not drafter.training:  # eval diagnostic: the same shifted blocks with the carryover rows withheld. If these
        # match the carry metrics, the drafter ignores its carryover states (what the 2026-11-30 ablation found)
        with torch.no_grad():
            h_off = draft_blocks(drafter, drafter, input_ids, feats, ctx_valid, last, backend=backend)
            lab2, ok2, prev2, _ = block_targets(input_ids, seq_len, last, last_ok, cfg.num_proposals)
            _, m3 = block_loss(proposal_logits(drafter, h_off, prev2, ok2), lab2, ok2, w)
    carried = c["rows"][-1][2].view(-1, N, k).sum(-1).float()[last_ok]
    accepted = c["accepted"][0]
    metrics = {"ce": m1["ce"], "acc_per_pos": m1["acc_per_pos"], "accept_run": m1["accept_run"],
               "ce_carry": m2["ce"], "acc_per_pos_carry": m2["acc_per_pos"], "accept_run_carry": m2["accept_run"],
               "verify_accepted": float(accepted[a_ok].float().mean()) if a_ok.any() else math.nan,
               "carried_rows": float(carried.mean()) if carried.numel() else 0.0}
    if chain > 1:
        metrics["accept_run_carry_step1"] = terms[1][1]["accept_run"]
    if not drafter.training:
        metrics.update({"acc_per_pos_carry_withheld": m3["acc_per_pos"], "accept_run_carry_withheld": m3["accept_run"]})
    return loss1 + loss_carry, metrics


__all__ = ["stage1_loss", "stage2_loss", "target_rows", "carry_chain", "carryover_rows_valid", "eos_ids_of",
           "verify_all", "sample_anchors", "block_targets", "greedy_proposals", "draft_blocks", "target_pass",
           "position_weights", "block_loss"]
