"""The linear round of `SpeculativeEngine` (a mixin): draft a block, verify it, accept per row, commit.

Kept apart from `engine.py` (construction, the decode loop, capture and compile) because it is the part that runs
inside a captured graph: every method here reads and writes only the static state and the caches, with no host sync
and no shape that depends on the prompt. Draft-tree rounds (`tree_round.py`) reuse `_draft_logits` and `_commit`.
"""

from __future__ import annotations

import torch

from ..generation_carryover import accepted_as_generate_counts, batched_context_lookup
from .sampling import inverse_cdf, point_mass
from .state import DecodeState, is_eos
from .timing import PhaseClock


class LinearRounds:
    """`_round` and its pieces for `SpeculativeEngine`, which provides `drafter`, `lookup_min_ngram`, `_steps` and
    `_target_forward`."""

    # ------------------------------------------------------------------ drafter
    def _draft_logits(self, dcache, anchor_tok, anchor_pos, carry, carry_pos, carry_valid, cast=True):
        """The drafter's proposal logits `[b, P, V]` (float32; cast=False: the head's own dtype) for the block at each
        row's anchor."""
        d, cfg = self.drafter, self.drafter.config
        B, b = cfg.block_size, anchor_tok.shape[0]
        block = d.embed_block(anchor_tok[:, None])  # [b, B, d]
        positions = anchor_pos[:, None] + self._steps[:B]
        ctx = self._steps[None] < anchor_pos[:, None]  # [b, max_len]
        mask = torch.cat([ctx, carry_valid, torch.ones(b, B, dtype=torch.bool, device=ctx.device)], 1)
        hidden = d(block, positions, cache=dcache, carryover_features=carry, carryover_positions=carry_pos,
                   attn_mask=mask[:, None, None, :])
        logits = d.lm_logits(hidden[:, d.proposal_rows()])  # [b, P, V]
        return logits.float() if cast else logits

    def _draft(self, dcache, anchor_tok, anchor_pos, carry, carry_pos, carry_valid, noise, temperature, do_sample):
        d, cfg, b = self.drafter, self.drafter.config, anchor_tok.shape[0]
        logits = self._draft_logits(dcache, anchor_tok, anchor_pos, carry, carry_pos, carry_valid)  # [b, P, V]
        if cfg.drafter_type != "markov" and not do_sample:
            return logits.argmax(-1), None  # greedy DFlash: rows are independent, no distribution needed
        if cfg.drafter_type != "markov":  # sampled DFlash: one draw for all rows, proposal j with uniform column j
            P = logits.shape[1]
            probs = (logits / temperature).softmax(-1)  # [b, P, V]
            return inverse_cdf(probs.reshape(b * P, -1), noise[:, :P].reshape(b * P)).view(b, P), probs

        cols = iter(range(noise.shape[1]) if do_sample else ())

        def pick(row):  # proposal j uses uniform column j
            if not do_sample:
                return row, row.argmax(-1)
            probs = (row / temperature).softmax(-1)
            return probs, inverse_cdf(probs, noise[:, next(cols)])

        tokens, dists = d.propose(logits, anchor_tok, pick)  # [b, k], [b, k, V]
        return tokens, (dists if do_sample else None)

    # ------------------------------------------------------------------ acceptance
    @staticmethod
    def _accept(drafts, q, logits, do_sample, temperature, noise, valid=None):
        """Accepted count a `[b]` and the token emitted after them `[b]` (correction or bonus). Sampling reads
        `noise` `[b, 2k+1]`: columns k..2k-1 for the acceptance tests, 2k for the correction/bonus draw.
        `valid` `[b, k]` (lookup rounds): which slots were proposed. Acceptance stops at the first unproposed slot,
        and there the target's own distribution is sampled, as at a bonus slot (its q is zeroed)."""
        b, k = drafts.shape
        if not do_sample:
            choice = logits.argmax(-1)  # [b, k+1]
            match = drafts == choice[:, :k]
            a = torch.cumprod((match if valid is None else match & valid).long(), 1).sum(1)
            return a, choice.gather(1, a[:, None])[:, 0]
        p = (logits / temperature).softmax(-1)  # [b, k+1, V]
        q = p[:, :0] if q is None else q  # plain AR: no drafts, [b, 0, V], so the bonus slot samples p itself
        if valid is not None:
            q = q * valid[..., None]
        pd = p[:, :k].gather(2, drafts[..., None])[..., 0]
        qd = q.gather(2, drafts[..., None])[..., 0]
        u = noise[:, k : 2 * k]
        ok = u * qd <= pd  # accept with probability min(1, p/q)
        if valid is not None:
            ok &= valid
        a = torch.cumprod(ok.long(), 1).sum(1)
        rows = torch.arange(b, device=drafts.device)
        p_a = p[rows, a]  # target distribution at the first rejected (or bonus) slot
        q_a = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, a]  # bonus slot: residual is p itself
        resid = (p_a - q_a).clamp(min=0)
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)
        nxt = inverse_cdf(resid, noise[:, 2 * k])
        return a, nxt

    # ------------------------------------------------------------------ one round
    def _round(self, st: DecodeState, do_sample=False, clock=None, lookup=0, draft=True):
        """One round for all rows: reads `st`, writes it (and the caches) in place. No host sync, no Python
        branch on tensor values, no shape that depends on the prompt: eager and captured rounds are the same code.
        Sampled rounds read their uniforms and temperature from `st` (`st.draw` fills them before each round).
        `lookup` > 0: context lookup of up to that many tokens (a Python int: one graph per value), read from the
        state (computed by the previous round); the round ends by computing the next one's. `draft=False` (a Python
        bool: its own graph) skips the drafter; only valid when every unfinished row looks up (`st.flags[1]`)."""
        clock = clock or PhaseClock(False, None, None)
        k, steps = st.k, self._steps
        clock.start()
        if self.drafter is not None and draft:
            on = self.drafter.config.carryover
            drafts, q = self._draft(st.dcache, st.anchor, st.anchor_pos, st.carry if on else None, st.carry_pos,
                                    st.carry_valid if on else st.carry_valid[:, :0], st.noise, st.temperature,
                                    do_sample)
        else:  # [b, k]: k = 0 (plain decoding) or lookup filler (a skipped drafter: every unfinished row looks up)
            drafts, q = st.anchor[:, None].expand(-1, k), None
        valid = None
        if lookup:
            look, n_look = st.look.clone(), st.n_look.clone()  # [b, k], [b]: this round's lookup (overwritten below)
            hit = n_look > 0
            if self.drafter is not None:  # a miss keeps the drafted block, every slot proposed
                n_look = torch.where(hit, n_look, torch.full_like(n_look, k))
            valid = steps[None, :k] < n_look[:, None]  # [b, k]
            drafts = torch.where(hit[:, None], look, drafts)
        clock.lap("draft")
        block = torch.cat([st.anchor[:, None], drafts], 1)  # [b, k+1]
        bpos = st.anchor_pos[:, None] + steps[: k + 1]
        logits, feats = self._target_forward(st.cache, block, bpos)
        clock.lap("verify")
        if lookup and do_sample:  # a looked-up token is proposed with certainty: a point mass
            point = point_mass(look, logits.shape[-1])  # [b, k, V]
            q = point if q is None else torch.where(hit[:, None, None], point, q)
        a, nxt = self._accept(drafts, q, logits, do_sample, st.temperature, st.noise, valid)
        done, n_out = st.done, st.n_out  # this round's inputs; the new values are copied in at the end
        a_log = a  # accepted drafts as generate() counts them
        if self.drafter is not None or lookup:
            # the drafts generate() verifies (through the first EOS, within the length budget, within a lookup) and
            # its count of accepted ones: so the logged rounds, and a Carryover drafter's next round, equal
            # generate()'s. With no budget left generate() verifies without drafting, which is not a draft round:
            # logged as -1 (no round)
            budget = st.max_new - n_out - 1  # [b]: tokens that can still be emitted after the anchor
            proposed = budget if valid is None else torch.minimum(budget, valid.sum(1))
            a_log, n_drafted = accepted_as_generate_counts(a, drafts, st.eos, proposed)
            a_log = torch.where(budget > 0, a_log, torch.full_like(a, -1))
        if self.drafter is not None:
            st.dcache.write(self.drafter, self.drafter.fuse(feats), bpos)
            st.carry.copy_(feats[:, 1:])
            j = steps[1 : k + 1][None]
            st.carry_valid.copy_((j > a[:, None]) & (j <= n_drafted[:, None]) & ~done[:, None])
            st.carry_pos.copy_(bpos[:, 1:])
        self._commit(st, drafts, a, nxt, a_log, lookup, hit if lookup else None)
        clock.lap("other")

    def _commit(self, st: DecodeState, drafts, a, nxt, a_log, lookup=0, hit=None):
        """Emit each row's accepted drafts `drafts[:, :a]` `[b, k]` and `nxt`, within its length budget and through
        its first EOS; log the round (`a_log`, None: the tokens kept minus one) and move the anchors. With `lookup`,
        also extend the committed sequence and compute the next round's lookup."""
        k, steps = st.k, self._steps
        done, n_out = st.done, st.n_out
        # accepted drafts, then the correction/bonus at column a: [b, k+1]. Pointwise (a padded read and a select),
        # which inductor fuses into its readers; a scatter into a concatenated buffer was kernels of their own
        idx = steps[None, : k + 1]
        emitted = torch.where(idx == a[:, None], nxt[:, None], torch.nn.functional.pad(drafts, (0, 1)))
        # keep the first a+1 tokens, within the length budget, up to and including the first EOS
        keep = (idx <= a[:, None]) & (idx < (st.max_new - n_out)[:, None]) & ~done[:, None]
        eos_kept = is_eos(emitted, st.eos) & keep
        first_eos = torch.where(eos_kept.any(1), eos_kept.long().argmax(1), torch.full_like(a, k + 1))
        keep &= idx <= first_eos[:, None]
        slots = (n_out[:, None] + idx).clamp(max=st.cap - 1)
        # index_put_ rather than scatter_, as for the caches (`put_positions`): written in place when compiled
        st.out.index_put_((st.rows, slots), torch.where(keep, emitted, st.out.gather(1, slots)))
        if lookup:  # the committed sequence grows by the kept tokens, after the anchor
            at = (st.anchor_pos[:, None] + 1 + idx).clamp(max=st.seq.shape[1] - 1)
            st.seq.index_put_((st.rows, at), torch.where(keep, emitted, st.seq.gather(1, at)))
        if a_log is None:  # tokens kept minus one; a round with no room for a draft is no draft round, as above
            a_log = torch.where(st.max_new - n_out - 1 > 0, keep.sum(1) - 1, torch.full_like(a, -1))
        col = st.round.clamp(max=st.accepted.shape[1] - 1)[:, None]  # [b, 1]: each row's column for this round
        st.accepted.index_put_((st.rows, col), torch.where(done, torch.full_like(a, -1), a_log)[:, None])
        if lookup:  # `looked` has `accepted`'s shape: the same column
            st.looked.index_put_((st.rows, col), (hit & ~done)[:, None])
        st.round.add_(1)
        new_n_out = n_out + keep.sum(1)
        new_done = done | (new_n_out >= st.max_new) | eos_kept.any(1)
        st.anchor_pos.copy_(torch.where(new_done, st.anchor_pos, st.anchor_pos + a + 1))
        st.anchor.copy_(torch.where(new_done, st.anchor, nxt))
        st.n_out.copy_(new_n_out)
        st.done.copy_(new_done)
        st.set_flags(self._lookup_next(st, lookup) if lookup else torch.zeros_like(new_done[0]))

    def _lookup_next(self, st: DecodeState, lookup: int) -> torch.Tensor:
        """Store the next round's context lookup in `st` (from the committed sequence as it now stands) and return
        whether every unfinished row has one (a 0-d bool tensor; no sync)."""
        look, n_look, _ = batched_context_lookup(st.seq, st.anchor_pos + 1, st.k, lookup,
                                                 min_ngram=self.lookup_min_ngram)  # [b, k], [b]
        st.look.copy_(look)
        st.n_look.copy_(n_look)
        return ((n_look > 0) | st.done).all()
