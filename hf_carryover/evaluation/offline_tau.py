"""Exact offline τ at T=0: replay speculative decoding against one greedy target rollout per prompt.

Why: at T=0 the tokens speculative decoding emits are the target's greedy rollout, whatever the drafter does,
so every round's outcome is fixed by (anchor position, drafter proposals, recorded tokens). We can therefore
replay all prompts *in one batch*, round by round: one drafter forward for every prompt's block, one target
forward that verifies every block against its recorded prefix (the block-sparse verification of training),
accepted length = leading proposals equal to the recorded tokens. That reproduces the rounds of
`target.generate(assistant_model=drafter)` exactly (a test checks it, Carryover included), at the cost of a
few batched forwards per round instead of one generate() call per prompt — EDR's observation (DESIGN.md §7)
that T=0 speculative decoding is a deterministic walk over one rollout.

Rules mirrored from the online path (`accepted_as_generate_counts`, shared with the engine): proposals are cut to
the remaining length budget and after the first EOS, and an accepted drafted EOS counts one less; the carryover of
the next round is verify rows a+1..n of the proposals actually verified; a round with no proposal left (budget
exhausted) is not a draft round.
"""

from __future__ import annotations

import torch

from ..generation_carryover import accepted_as_generate_counts
from ..training.objectives import draft_blocks, greedy_proposals, target_pass, verify_all


@torch.no_grad()
def offline_rounds(target, drafter, rollouts, max_new_tokens: int, eos_token_ids=(), batch_size: int = 64):
    """Accepted-length sequence per prompt.

    rollouts: list of `(prompt_len, token_ids)` where token_ids = prompt + the target's greedy response
    (as produced with the same `max_new_tokens` and EOS). Returns a list (one per prompt) of dicts
    `{"accepted": [...], "proposals": [...]}` matching `CarryoverCandidateGenerator.rounds`.
    """
    out = []
    for i in range(0, len(rollouts), batch_size):
        out += _replay(target, drafter, rollouts[i : i + batch_size], max_new_tokens, eos_token_ids)
    return out


def _replay(target, drafter, rollouts, max_new_tokens, eos_token_ids):
    device = next(drafter.parameters()).device
    cfg = drafter.config
    k = cfg.num_proposals
    b = len(rollouts)
    L = max(len(ids) for _, ids in rollouts)
    ids = torch.zeros(b, L, dtype=torch.long, device=device)
    for r, (_, seq) in enumerate(rollouts):
        ids[r, : len(seq)] = torch.tensor(seq, device=device)
    plen = torch.tensor([p for p, _ in rollouts], device=device)
    slen = torch.tensor([len(s) for _, s in rollouts], device=device)
    max_len = plen + max_new_tokens  # generate()'s max_length per prompt
    ctx_valid = torch.arange(L, device=device)[None] < slen[:, None]
    feats, _ = target_pass(target, drafter, ids, ctx_valid, need_logits=False)
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    j = torch.arange(1, k + 1, device=device)

    t = plen.clone()  # anchor = position of the first generated token (the prefill's bonus token)
    carry = carry_pos = carry_valid = None
    log = []  # per round: [2, b] accepted (-1 where the row is done) and proposals
    while True:
        budget = max_len - (t + 1) - 1  # proposals that could still be emitted, as in get_candidates
        active = (t < slen - 1) & (budget > 0)
        if not active.any():
            break
        anchors = t.clamp(max=L - 1)[:, None]
        hidden = draft_blocks(drafter, drafter, ids, feats, ctx_valid, anchors,
                              carry=carry, carry_pos=carry_pos, carry_valid=carry_valid,
                              k=0 if carry is None else k)
        props = greedy_proposals(drafter, hidden, ids.gather(1, anchors))  # [b, 1, k]
        accepted, vfeats = verify_all(target, drafter, ids, ctx_valid, slen, anchors, active[:, None], props)
        # proposals verified (cut at the first EOS and to the budget) and accepted ones, as generate() counts them
        accepted, n_prop = accepted_as_generate_counts(accepted[:, 0], props[:, 0], eos, budget)
        log.append(torch.stack([torch.where(active, accepted, -1), n_prop]))  # stays on the device
        if cfg.carryover:
            carry = vfeats[:, 0]  # [b, k, F]: rows 1..k of this verification
            carry_pos = t[:, None] + j
            carry_valid = (j[None] > accepted[:, None]) & (j[None] <= n_prop[:, None]) & active[:, None]
        t = torch.where(active, t + accepted + 1, t)
    rounds = [{"accepted": [], "proposals": []} for _ in range(b)]
    for acc, prop in (torch.stack(log).tolist() if log else []):  # one transfer at the end
        for r in range(b):
            if acc[r] >= 0:
                rounds[r]["accepted"].append(acc[r])
                rounds[r]["proposals"].append(prop[r])
    return rounds


def tau_from_rounds(rounds) -> float:
    """τ over all prompts: Σ(accepted + 1) / number of draft rounds."""
    acc = [a for r in rounds for a in r["accepted"]]
    return (sum(acc) + len(acc)) / max(len(acc), 1)


__all__ = ["offline_rounds", "tau_from_rounds"]
