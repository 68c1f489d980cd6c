"""Draft-tree rounds of `SpeculativeEngine` (a mixin): one target forward verifies a tree of the drafter's
top-ranked tokens instead of its linear block.

Kept apart from `linear_round.py` because a tree round shares only the engine's building blocks (`_draft_logits`,
`_target_forward`, `_commit`, the static state) and not its linear acceptance; the tree's own pieces (selection,
ancestor mask, acceptance along a path) are the functions of `tree.py`.
"""

from __future__ import annotations

import torch

from .sampling import inverse_cdf
from .state import DecodeState
from .tree import (TreeSpec, accept_tree, lookup_chain_lp, lookup_ranks, node_ranks, node_tokens, select_tree,
                   static_tree, tree_mask, unique_children)
from .vocab_topk import MAX_RANK, draft_topk


class TreeRounds:
    """`_tree_round` and `_tree_carry` for `SpeculativeEngine`, which provides `drafter`, `lookup_siblings`,
    `lookup_confidence`, `tree_topk`, `draft_topk`, `_steps`, `_draft_logits`, `_target_forward` and `_commit`."""

    def _tree_round(self, st: DecodeState, tree: TreeSpec, lookup=0, nodes=None, do_sample=False):
        """One round that verifies a draft tree (`tree.py`; static or chosen per row), not the linear block.

        The drafter drafts as usual, with the previous round's carryover states if it is a Carryover drafter
        (`_tree_carry`); the tree's nodes take its top-ranked tokens; with `lookup`, a row's looked-up tokens
        replace the rank-0 chain's, and their siblings take the drafter's ranking without the looked-up token, so the
        drafter's own first choice stays among the alternatives (`tree.node_ranks`; not with `lookup_siblings=False`).
        One target forward verifies all nodes; the accepted path's K/V and target features are moved to the positions
        after the anchor, so the caches end as after a linear verification of that path. `nodes` (a Python int):
        each row verifies the `nodes` nodes of `tree` its drafter finds likeliest (`tree.select_tree`); None: all of
        `tree`.
        No host sync, fixed shapes.

        do_sample (a Python bool): the target's token after each verified row is *drawn* from its distribution (at
        `st.temperature`, from the round's uniforms `st.noise[:, :N+1]`) instead of taken as the argmax, and the tree
        is accepted against those draws exactly as against argmaxes (`accept_tree`). Lossless: each emitted token is a
        draw from the target's distribution given the tokens before it, because the path only follows a node whose
        token equals the draw made at its parent. For proposals that are fixed tokens (top-ranked ones, looked-up
        ones: point masses) this is the same law as rejection sampling tried child after child (accept a child with
        the target's probability of it, else drop it from the target's distribution and try the next, else draw from
        what is left), in one draw per verified row."""
        k, steps, b = st.k, self._steps, st.b
        on = self.drafter.config.carryover
        # (`vocab_topk.py`'s kernel reads bf16 logits as they are)
        kernel = self.draft_topk == "triton" and tree.max_rank <= MAX_RANK
        logits_d = self._draft_logits(st.dcache, st.anchor, st.anchor_pos, st.carry if on else None, st.carry_pos,
                                      st.carry_valid if on else st.carry_valid[:, :0], cast=not kernel)
        lp, top = draft_topk(logits_d[:, : tree.max_depth], tree.max_rank, kernel)  # [b, D, R] each, lp float32
        hit = lpos = None
        if lookup:
            look, n_look = st.look.clone(), st.n_look.clone()  # [b, k], [b]
            hit = n_look > 0
            if self.lookup_siblings:  # [b, D]: the looked-up tokens' places in the drafter's ranking
                lpos = lookup_ranks(top, look, n_look)
        # a dynamic tree keeps the rank-0 chain as deep as the lookup reaches (its tokens go there, below), or with
        # `lookup_confidence` scores the looked-up tokens and keeps them as far as they outscore the alternatives
        keep = chain_lp = None
        if lookup and self.lookup_confidence is None:
            keep = torch.where(hit, n_look, 0)
        elif lookup and nodes is not None:
            chain_lp = lookup_chain_lp(lp, top, look, n_look, self.lookup_confidence)  # [b, D]
        t = static_tree(tree, b, st.anchor.device) if nodes is None else select_tree(
            tree, lp, nodes, keep_chain=keep, lookup_pos=lpos, chain_lp=chain_lp, ranked=self.tree_topk == "ranked")
        depth = t["depth"]  # [b, N+1]
        n = depth.shape[1]
        tokens = node_tokens(top, t, node_ranks(t, lpos))  # [b, N]; a looked-up token's siblings skip it
        if lookup:
            d1 = depth[:, 1:]
            use = t["main"][:, 1:] & hit[:, None] & (d1 <= n_look[:, None])  # [b, N]
            tokens = torch.where(use, look.gather(1, (d1 - 1).clamp(max=k - 1)), tokens)
        valid = unique_children(tokens, t)
        block = torch.cat([st.anchor[:, None], tokens], 1)  # [b, N+1]
        slots = st.anchor_pos[:, None] + steps[:n]  # [b, N+1]: node i at slot anchor_pos + i
        rope = st.anchor_pos[:, None] + depth  # [b, N+1]: at position anchor_pos + depth(i)
        logits, feats = self._target_forward(st.cache, block, rope, slots=slots,
                                             mask=tree_mask(steps, st.anchor_pos, t))
        if do_sample:  # one draw per verified row: [b, N+1, V] -> [b*(N+1), V] -> [b, N+1]
            probs = (logits.float() / st.temperature).softmax(-1)
            choice = inverse_cdf(probs.flatten(0, 1), st.noise[:, :n].reshape(-1)).view(b, n)
        else:
            choice = logits.argmax(-1)
        a, path, nxt = accept_tree(tokens, valid, choice, t)
        # Compiled rounds are split here on purpose: the verify forward above wrote every layer's K/V into the caches
        # (`TargetStaticCache.update`) and the move below writes them again. Inductor writes a graph input in place
        # only for its graph's last write to it; an earlier one becomes a copy of the whole cache, written back at the
        # graph's end: two passes over all 60 caches a round (counted on CPU: `tests/test_engine_tree.py`). Split,
        # each graph writes each cache once, in place. (No-op when not compiling; captured rounds still replay as one
        # CUDA graph.)
        torch._dynamo.graph_break()
        st.cache.move(slots.gather(1, path), slots)  # the accepted path's K/V to slots anchor_pos + depth
        m = min(n, k + 1)  # the drafter's context needs rows 0..a (a <= depth <= k)
        rows = feats.gather(1, path[:, :m, None].expand(-1, -1, feats.shape[-1]))  # [b, m, F]
        st.dcache.write(self.drafter, self.drafter.fuse(rows), st.anchor_pos[:, None] + steps[:m])
        drafts = block.gather(1, path[:, 1:m])  # [b, m-1]: the accepted path's tokens first
        drafts = torch.cat([drafts, drafts.new_zeros(b, k - drafts.shape[1])], 1)  # [b, k]
        if on:  # before _commit moves the anchors: the carry rows sit right after this round's accepted path
            self._tree_carry(st, t, feats, path, a)
        self._commit(st, drafts, a, nxt, None, lookup, hit)

    def _tree_carry(self, st: DecodeState, t: dict, feats, path, a) -> None:
        """The carryover states a tree round leaves for the next round: the target features of the rank-0 chain
        below the deepest accepted node (its rank-0 child, that child's rank-0 child, ...), which the verify forward
        computed and which the accepted path rejected.

        Why that chain: in a linear round the carryover rows are the rejected rest of the drafted block, i.e. the
        drafter's top-1 continuation of the accepted prefix, each row seen by the target after that prefix. In a
        tree the same rows are the rank-0 descendants of the last accepted node (tree attention shows each node its
        ancestors only, so their states are exactly those of a linear verification of the accepted path followed
        by that chain). On the chain tree (`TreeSpec.chain`) they are the linear round's rows, so tree and linear
        rounds stay equal round for round (tested). Rows past the length budget are left out, as a linear round
        leaves out drafts generate() would not verify. Fixed shapes, no host sync: a chain shorter than k (the
        accepted node has no rank-0 child in the tree) leaves the rest of the buffer invalid."""
        k, steps = st.k, self._steps
        parent, rank = t["parent"], t["rank"]  # [b, N+1] (root first)
        n = parent.shape[1]
        # child0[:, i] = node i's rank-0 child, n (a sentinel) where it has none; column n is the sentinel's own.
        # One compare-and-argmax over [b, n+1, N] (33 x 31 at 31 nodes) rather than a scatter into a filled buffer:
        # one small kernel in a compiled round instead of two
        first = rank[:, 1:] == 0  # [b, N]: every node but the root is somebody's child; rank-0 ones are unique
        is_child0 = (parent[:, None, 1:] == steps[: n + 1][None, :, None]) & first[:, None, :]  # [b, n+1, N]
        child0 = torch.where(is_child0.any(-1), is_child0.long().argmax(-1) + 1, n)  # [b, n+1]
        cur = path.gather(1, a[:, None])  # [b, 1]: the deepest accepted node
        chain = []
        for _ in range(k):  # a Python loop over the fixed k: one gather per depth below the accepted node
            cur = child0.gather(1, cur)
            chain.append(cur)
        chain = torch.cat(chain, 1)  # [b, k], node ids or n
        # the chain's feature rows, the sentinel's zero (a clamped gather and a select, fused into the copy: no
        # padded copy of feats)
        rows = feats.gather(1, chain.clamp(max=n - 1)[..., None].expand(-1, -1, feats.shape[-1]))  # [b, k, F]
        st.carry.copy_(torch.where((chain < n)[..., None], rows, 0))
        depth = a[:, None] + 1 + steps[None, :k]  # [b, k]: chain node s is at depth a + 1 + s
        budget = st.max_new - st.n_out - 1  # [b]: as in a linear round, only rows generate() would have verified
        st.carry_valid.copy_((chain < n) & (depth <= budget[:, None]) & ~st.done[:, None])
        st.carry_pos.copy_(st.anchor_pos[:, None] + depth)
