"""Tree verification for DFlash drafters: several candidate continuations checked in one target forward.

Why it pays for a block drafter: a DFlash drafter gives, from one forward, a distribution at every block position
that does not depend on the tokens proposed before it (the block is `[anchor, mask, ...]`). Its top-ranked
alternatives are therefore free, and a tree whose nodes are "the rank-r token at depth d" (Medusa-style static
tree over ranks) covers the places where the top-1 chain usually breaks (the first one or two positions) at the
price of more verified tokens. For a small target at batch 1 the verify forward should cost about the same for 16
or 64 tokens (it is bound by kernel launches, not arithmetic), so more accepted tokens per verification is nearly
free speed (on the H200, 63-node trees ran as fast as 31-node ones: `examples/results/h200-2026-12-01e/`). The tree's
shape is fixed per call (a list of rank paths), so every round has the same shapes and runs as one CUDA graph like the
linear rounds.

Vocabulary: node 0 is the root (the anchor, the last committed token); node i >= 1 is the rank path
`paths[i-1]` = (r_1, ..., r_d): the rank-r_d token of the drafter's depth-d distribution, child of the node whose
path is (r_1, ..., r_{d-1}). Nodes are ordered by depth, so a parent always comes before its children.

Verification of a tree in a position-indexed static cache: node i is written at cache slot `anchor_pos + i` with
RoPE position `anchor_pos + depth(i)`, and its query sees the committed slots (< anchor_pos) and its ancestors'
slots. After acceptance (the target's argmax at each accepted node's parent equals the node's token, or in sampled
rounds the token drawn from the target's distribution there; accepted nodes form one path), the accepted path's K/V
are moved to the slots `anchor_pos + 1 .. anchor_pos + a`, which makes the cache exactly what a linear verification
of that path would have left.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


class TreeSpec:
    """A static draft tree given by rank paths, e.g. `[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]`.

    Every prefix of a path must be in the tree too (a node needs its parent). Tensors are built once per device."""

    def __init__(self, paths):
        paths = [tuple(int(r) for r in p) for p in paths]
        if not paths:
            raise ValueError("a draft tree needs at least one node")
        if len(set(paths)) != len(paths):
            raise ValueError("a draft tree lists a rank path twice")
        have = set(paths)
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"rank path {p}: ranks are >= 0 and a path has at least one step")
            if len(p) > 1 and p[:-1] not in have:
                raise ValueError(f"rank path {p} has no parent {p[:-1]} in the tree (every prefix must be a node)")
        self.paths = sorted(paths, key=lambda p: (len(p), p))  # by depth, so parents precede children
        self.num_nodes = len(self.paths)
        self.max_depth = max(len(p) for p in self.paths)
        self.max_rank = max(max(p) for p in self.paths) + 1
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        self.parent = [0 if len(p) == 1 else index[p[:-1]] for p in self.paths]
        self._tensors: dict = {}

    @classmethod
    def chain(cls, length: int) -> "TreeSpec":
        """The linear block as a tree (rank 0 at every depth): tree rounds with it accept what linear rounds do."""
        return cls([(0,) * d for d in range(1, length + 1)])

    @classmethod
    def load(cls, path) -> "TreeSpec":
        """A tree saved as JSON with a `paths` list (what `examples/calibrate_tree.py` writes)."""
        import json

        with open(path) as f:
            data = json.load(f)
        if "paths" not in data:
            raise ValueError(f"{path}: a draft-tree file needs a 'paths' list of rank paths")
        return cls(data["paths"])

    @classmethod
    def from_pretrained(cls, drafter_dir_or_repo, filename: str = "draft_tree.json", **hub_kwargs) -> "TreeSpec":
        """The calibrated tree a drafter folder or Hub repo ships beside its weights (`filename`). Shipped drafters
        carry one made by `examples/calibrate_tree.py` on training responses."""
        path = Path(str(drafter_dir_or_repo))
        if path.is_dir():
            file = path / filename
            if not file.is_file():
                raise FileNotFoundError(f"{path} has no {filename}: make one with examples/calibrate_tree.py "
                                        f"--drafter {path} --out {file}")
            return cls.load(file)
        from huggingface_hub import hf_hub_download

        return cls.load(hf_hub_download(str(drafter_dir_or_repo), filename, **hub_kwargs))

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return f"TreeSpec({self.num_nodes} nodes, depth {self.max_depth}, ranks {self.max_rank})"

    def tensors(self, device) -> dict:
        """depth/rank/parent `[N+1]` (root included, depth 0) and `anc` `[N+1, N+1]` bool: anc[i, j] = node j is
        node i itself or one of its ancestors (the root is everyone's)."""
        key = str(device)
        if key not in self._tensors:
            n = self.num_nodes + 1
            depth = torch.tensor([0] + [len(p) for p in self.paths])
            rank = torch.tensor([0] + [p[-1] for p in self.paths])
            parent = torch.tensor([0] + self.parent)
            anc = torch.eye(n, dtype=torch.bool)
            anc[:, 0] = True
            for i in range(1, n):  # parents come first, so their rows are complete
                anc[i] |= anc[parent[i]]
            main = torch.tensor([True] + [max(p) == 0 for p in self.paths])  # the rank-0 chain (lookup goes there)
            self._tensors[key] = {name: t.to(device) for name, t in
                                  dict(depth=depth, rank=rank, parent=parent, anc=anc, main=main).items()}
        return self._tensors[key]


def fit_tree(tree, drafter, nodes=None) -> TreeSpec:
    """`tree` (a TreeSpec or a list of rank paths) as a TreeSpec, after checking that `drafter` can verify it, `nodes`
    a round: a DFlash drafter, depth within its block, `nodes` within the tree. Shared by the engine's calls
    (`check_tree`) and `Drafter.use_draft_tree`."""
    tree = tree if isinstance(tree, TreeSpec) else TreeSpec(tree)
    if drafter is None or drafter.config.drafter_type != "dflash":
        raise ValueError("draft trees need a DFlash drafter: its block positions are drafted independently, "
                         "so the top-ranked tokens of each position combine into a tree (a Markov drafter's "
                         "proposals depend on the previous proposal).")
    if tree.max_depth > drafter.config.num_proposals:
        raise ValueError(f"draft tree of depth {tree.max_depth}: this drafter proposes "
                         f"{drafter.config.num_proposals} tokens a block.")
    if tree.max_rank > drafter.config.vocab_size:
        raise ValueError(f"draft tree with rank {tree.max_rank - 1}: the drafter ranks {drafter.config.vocab_size} "
                         "tokens.")
    if nodes is not None and not 1 <= int(nodes) <= tree.num_nodes:
        raise ValueError(f"tree_nodes={nodes}: between 1 and the tree's {tree.num_nodes} nodes (None: all).")
    return tree


def check_tree(tree, drafter, longest: int, max_len: int, nodes=None):
    """`tree` (a TreeSpec, a list of rank paths, or None) as a TreeSpec or None, after checking that this drafter and
    call can verify it: `fit_tree`'s checks and room in the engine's caches (`max_len`) for the `longest` sequence
    plus the rows a round writes. Greedy and sampled calls alike (`SpeculativeEngine._tree_round`)."""
    if tree is None:
        return None
    tree = fit_tree(tree, drafter, nodes)
    if longest + (nodes or tree.num_nodes) + 2 > max_len:  # a round writes only its N+1 verified rows
        raise ValueError(f"max_len={max_len} is too small for {longest} tokens + a tree of "
                         f"{nodes or tree.num_nodes} nodes.")
    return tree


def static_tree(spec: TreeSpec, b: int, device) -> dict:
    """The spec's tensors with a batch dim (expanded views): every row verifies the same tree."""
    t = spec.tensors(device)
    return {name: v.expand(b, *v.shape) for name, v in t.items()}


def _places(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`[..., n]` -> each entry's place in descending order of `vals` (ties: lower `ids` first), 0 for the first:
    the number of entries that beat it. A strict order, so the places are 0..n-1 (NaN aside)."""
    v_i, v_j = vals[..., :, None], vals[..., None, :]  # [..., n, 1] against [..., 1, n]
    beats = (v_j > v_i) | ((v_j == v_i) & (ids[..., None, :] < ids[..., :, None]))  # [..., n, n]
    return beats.sum(-1)


def best_ids(score: torch.Tensor, n: int, ranked: bool = True) -> torch.Tensor:
    """`[b, M]` scores -> `[b, n]`: the indices of the n highest, in ascending index order (ranked: ties go to the
    lower index).

    ranked=False: `score.topk(n).indices.sort()`, a topk and a sort launch (10.9 and ~4.5 us in a profile of a 31-node
    tree round on the H200, `h200-2026-12-03d`). ranked=True: a node is kept when fewer than n nodes beat it
    (`_places`), and the kept ones land at their place among the kept in index order (a cumulative sum): comparison,
    scan and scatter kernels that inductor generates; the comparison took 5.4 us in `h200-2026-12-03e`'s profile. Timed
    alone on an H100 (`h100-2026-12-06c`, on top of the engine's `draft_topk="triton"` and `skinny_rows=64`): a captured
    tree 31 + lookup round 1.323 against 1.336 ms, so the engine's default is ranked."""
    if not ranked:
        return score.topk(n, dim=1).indices.sort(1).values
    b, m = score.shape
    ids = torch.arange(m, device=score.device)
    keep = _places(score, ids.expand(b, -1)) < n  # [b, M]
    place = torch.where(keep, (keep.long().cumsum(1) - 1).clamp(max=n), n)  # [b, M]: column n takes the dropped
    out = torch.zeros(b, n + 1, dtype=torch.long, device=score.device)
    out.scatter_(1, place, ids.expand(b, -1))
    return out[:, :n]


def select_tree(spec: TreeSpec, logprobs: torch.Tensor, nodes: int, keep_chain=None, lookup_pos=None,
                chain_lp=None, ranked: bool = False) -> dict:
    """Per-row trees of `nodes` nodes chosen from the superset `spec` by the drafter's own probabilities.

    logprobs `[b, D, R]`: log-probabilities of the drafter's top-R tokens at depths 1..D. A node's score is its path's
    log-probability under the drafter (sum over its ancestors' ranks; the positions of a DFlash block are drafted
    independently, so that is the product of the marginals); the best `nodes` are kept. A child never scores above
    its parent, so the kept set is a tree (ties go to the shallower node). This is the dynamic tree of EAGLE-2 with a
    fixed node count, chosen on the device: per-row tensors as `static_tree` gives, and no host sync.

    keep_chain `[b]` (optional): per row, the depth to which the rank-0 chain is kept whatever it scores. A context
    lookup puts its tokens there, and a looked-up continuation is often right far deeper than the drafter is sure of:
    without this, a 15-token lookup would be cut to the few chain nodes the drafter's own scores keep.

    lookup_pos `[b, D]` (optional, `lookup_ranks`): a looked-up token's siblings are scored by the token they will
    propose (`node_ranks`), not by their own rank.

    chain_lp `[b, D]` (optional, instead of keep_chain): the step log-probability to score each depth's rank-0 chain
    node with, where a lookup puts its token there (NaN elsewhere: the drafter's own). The lookup's tokens then compete
    with the drafter's alternatives by score instead of being kept to their full length (`lookup_chain_lp`).

    ranked: how the best `nodes` are found (`best_ids`); the same nodes either way but for ties."""
    t = spec.tensors(logprobs.device)
    b, R = logprobs.shape[0], logprobs.shape[2]
    depth, rank = t["depth"], t["rank"]
    ranks = node_ranks(static_tree(spec, b, logprobs.device), lookup_pos)  # [b, M]
    node_lp = logprobs.flatten(1).gather(1, (depth[1:] - 1) * R + ranks)  # [b, M]: each superset node's own step
    if chain_lp is not None:  # chain nodes that propose a looked-up token: its score, not the drafter's rank 0
        on_chain = chain_lp.gather(1, (depth[1:] - 1).expand(b, -1))  # [b, M]
        node_lp = torch.where(t["main"][1:][None] & ~on_chain.isnan(), on_chain, node_lp)
    path_lp = node_lp @ t["anc"][1:, 1:].T.to(node_lp.dtype)  # [b, M]: summed over the node and its ancestors
    score = path_lp - 1e-4 * depth[1:]
    if keep_chain is not None:  # forced chain nodes outrank every other node, shallow first (still a tree)
        forced = t["main"][1:][None] & (depth[1:][None] <= keep_chain[:, None])  # [b, M]
        score = torch.where(forced, 1e4 - depth[1:].to(score.dtype), score)
    keep = best_ids(score, min(nodes, spec.num_nodes), ranked) + 1  # [b, N]: superset ids, by depth
    sel = torch.cat([torch.zeros_like(keep[:, :1]), keep], 1)  # [b, N+1], root first
    local = torch.zeros(b, spec.num_nodes + 1, dtype=torch.long, device=sel.device)
    local.scatter_(1, sel, torch.arange(sel.shape[1], device=sel.device).expand(b, -1))  # superset id -> kept index
    return {"depth": depth[sel], "rank": rank[sel], "parent": local.gather(1, t["parent"][sel]),
            "anc": t["anc"][sel[:, :, None], sel[:, None, :]], "main": t["main"][sel]}  # anc: [b, N+1, N+1]


def lookup_chain_lp(logprobs: torch.Tensor, top: torch.Tensor, look: torch.Tensor, n_look: torch.Tensor,
                    confidence: float) -> torch.Tensor:
    """`[b, D]`: the score of each depth's looked-up token for `select_tree(chain_lp=...)`, NaN at depths without one.

    A looked-up token scores the drafter's log-probability of it (from its top-R list `logprobs`/`top` `[b, D, R]`;
    below the list counts as nothing) or log(`confidence`), whichever is larger: a lookup the drafter also ranks high
    keeps its place, and one it does not rank is still trusted as a match in the context, a little less at every
    further depth. The idea: keeping the whole lookup (`keep_chain`) fills up to 15 of the round's nodes whether or not
    its first token is right, nodes taken from the drafter's alternatives at the first depths, where most rounds end.
    Measured, it did not pay: on 40 held-out HumanEval prompts (fp32, CPU, tree 31 + lookup 15, the shipped Carryover
    drafter) τ was 3.459 with the whole lookup kept, 3.446 at confidence 0.9 and 3.304 at 0.6
    (`examples/results/cpu-2026-12-03/`). Looked-up rounds emitted 7.3 tokens on average: deep lookups are worth
    their nodes."""
    R = top.shape[2]
    pos = lookup_ranks(top, look, n_look)  # [b, D]: R where not listed, -1 where no lookup
    drafter = torch.where((pos >= 0) & (pos < R), logprobs.gather(2, pos.clamp(0, R - 1)[..., None])[..., 0],
                          torch.full_like(logprobs[..., 0], -float("inf")))
    floor = torch.full_like(drafter, math.log(confidence))
    return torch.where(pos >= 0, torch.maximum(drafter, floor), torch.full_like(drafter, float("nan")))


def lookup_ranks(top: torch.Tensor, look: torch.Tensor, n_look: torch.Tensor) -> torch.Tensor:
    """`[b, D]`: where the looked-up token of each depth sits in the drafter's ranking `top` `[b, D, R]` (R where it
    is not among the top R), -1 at depths without one (no lookup, or deeper than it reaches). `look` `[b, >=D]` and
    `n_look` `[b]` are the round's lookup (`n_look` 0: none)."""
    D, R = top.shape[1], top.shape[2]
    eq = top == look[:, :D, None]  # [b, D, R]
    pos = torch.where(eq.any(-1), eq.long().argmax(-1), R)
    depth = torch.arange(1, D + 1, device=top.device)
    return torch.where(depth[None] <= n_look[:, None], pos, -1)


def node_ranks(t: dict, lookup_pos: torch.Tensor | None = None) -> torch.Tensor:
    """`[b, N]`: the rank in the drafter's list that each node's token is taken from.

    A node's own rank, except for the siblings of a looked-up token. A lookup puts its tokens on the rank-0 chain,
    so the drafter's rank-0 token at that depth would otherwise be proposed nowhere, and a sibling could repeat the
    looked-up token. Instead the siblings take the drafter's ranking with the looked-up token removed: the rank-r
    sibling gets rank r-1 where the looked-up token is not among ranks 0..r-1, else rank r. `lookup_pos` `[b, D]`
    from `lookup_ranks` (-1: no lookup at that depth, no change); None: the nodes' own ranks."""
    rank = t["rank"][:, 1:]
    if lookup_pos is None:
        return rank
    depth, parent, main = t["depth"][:, 1:], t["parent"][:, 1:], t["main"]
    sibling = main.gather(1, parent) & ~main[:, 1:]  # [b, N]: child of a chain node, not on the chain itself
    at = lookup_pos.gather(1, depth - 1)  # [b, N]: where the looked-up token at this node's depth ranks (-1: none)
    return torch.where(sibling, rank - 1 + (rank - 1 >= at).long(), rank)


def node_tokens(top: torch.Tensor, t: dict, ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Proposal tokens of the tree nodes `[b, N]` from the drafter's top-ranked tokens `top` `[b, D, R]`, each node's
    taken from its own rank or from `ranks` `[b, N]` (`node_ranks`)."""
    ranks = t["rank"][:, 1:] if ranks is None else ranks
    return top.flatten(1).gather(1, (t["depth"][:, 1:] - 1) * top.shape[2] + ranks)


def unique_children(tokens: torch.Tensor, t: dict) -> torch.Tensor:
    """`[b, N]` bool: False for a node whose token an earlier sibling already proposes. Siblings with equal tokens
    would both be accepted; keeping the first keeps the accepted nodes one path. With `node_ranks` a looked-up token's
    siblings skip it, so this is a safety net (a caller that puts other tokens on the tree may need it)."""
    parent = t["parent"][:, 1:]
    same_parent = parent[:, :, None] == parent[:, None, :]  # [b, N, N]
    earlier = torch.ones_like(same_parent[0]).tril(-1)  # j < i
    dup = (tokens[:, :, None] == tokens[:, None, :]) & same_parent & earlier
    return ~dup.any(-1)


def tree_mask(keys: torch.Tensor, anchor_pos: torch.Tensor, t: dict) -> torch.Tensor:
    """`[b, 1, N+1, max_len]` bool attention mask of the tree verify: committed slots and the node's ancestors."""
    anc = t["anc"]  # [b, n, n]
    n = anc.shape[1]
    rel = keys[None, :] - anchor_pos[:, None]  # [b, max_len]: slot relative to the anchor's slot
    inside = (rel >= 0) & (rel < n)
    anc_cols = anc.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))  # [b, n, max_len]
    return ((rel < 0)[:, None, :] | (inside[:, None, :] & anc_cols))[:, None]


def accept_tree(tokens: torch.Tensor, valid: torch.Tensor, choice: torch.Tensor, t: dict):
    """Acceptance of a tree against the target's choice after each node.

    tokens, valid `[b, N]` (node proposals; invalid ones are never accepted); choice `[b, N+1]` (the target's
    argmax after each node, root first, or in sampled rounds a draw from its distribution there). Returns a `[b]`
    (accepted depth), `path` `[b, N+1]` (path[:, d] = node at depth d of the accepted path for d <= a; the identity
    elsewhere, so slots past a are left as they are) and the next token `[b]` (the target's choice after the deepest
    accepted node)."""
    parent, depth, anc = t["parent"][:, 1:], t["depth"], t["anc"]
    match = (tokens == choice.gather(1, parent)) & valid  # [b, N]: node proposes what the target chose after its parent
    match = torch.cat([torch.ones_like(match[:, :1]), match], 1)  # [b, N+1], the root always holds
    # a node is accepted when it and all its ancestors match: count matching ancestors (self included) by depth
    ok = (match[:, None, :] & anc).sum(-1) == depth + 1  # [b, N+1]
    a = (ok * depth).amax(1)  # [b]
    last = (ok * (depth + 1) * (depth == a[:, None])).argmax(1)  # the deepest accepted node (unique)
    b, n = depth.shape
    ident = torch.arange(n, device=tokens.device).expand(b, -1)
    on_path = anc[torch.arange(b, device=tokens.device), last] & ok  # [b, N+1]: accepted nodes are last's ancestors
    # on-path node i goes to column depth(i); the others to spare columns n + i, so no two writes meet
    spare = torch.cat([ident, ident], 1)  # [b, 2(N+1)]
    spare.scatter_(1, torch.where(on_path, depth, ident + n), ident)
    path = spare[:, :n]
    return a, path, choice.gather(1, last[:, None])[:, 0]


__all__ = ["TreeSpec", "accept_tree", "check_tree", "fit_tree", "lookup_chain_lp", "lookup_ranks", "node_ranks",
           "node_tokens", "select_tree", "static_tree", "tree_mask", "unique_children"]
