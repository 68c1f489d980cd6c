"""RoPE's `rotate_half` without a concatenation, in the engine's frozen compiled rounds.

Why: transformers writes `rotate_half(x)` as `cat((-x[..., h:], x[..., :h]), -1)`. Inductor lowers that `cat` by writing
each half into a buffer of its own kernel, and the RoPE kernel reads the buffer back: on this CPU's Triton code
(`examples/kernel_census.py`, a proxy) four of a batch-1 plain step's kernels per layer were these halves, for q and
k. Written as one pointwise expression, `where(i < h, -s, s)` with i the last-dimension index and
s = x[..., (i + h) % 2h] (x's halves swapped, an index inductor turns into plain indexing), the
halves are indexing inside whichever kernel reads them, and the rotation fuses into the RoPE (and cache write)
that uses it. Same values bit for bit: each element is the same element of x, negated or not.

`rotate_half_without_cat(graph)` rewrites every such `cat` in a post-grad graph and returns how many; the engine's
post-grad pass (`fuse_projections.FuseSharedInputMatmuls`) runs it with `freezing`.
"""
from __future__ import annotations

import torch

from .fx_nodes import is_call, node_maker

_END = (2**63 - 1, 2**31 - 1)  # what `x[..., h:]` leaves as a slice's end


def _slice_of(node, dim, start, end):
    """x when `node` is `slice(x, dim, start, end)` of a tensor x whose size along `dim` is known (an open end also
    matches when `end` is that size), else None."""
    if not (is_call(node, torch.ops.aten.slice.Tensor) and len(node.args) >= 3 and not node.kwargs):
        return None
    x = node.args[0]
    if not isinstance(x, torch.fx.Node) or "val" not in x.meta:
        return None
    d, s = node.args[1], node.args[2]
    e = node.args[3] if len(node.args) > 3 else _END[0]
    if not all(type(v) is int for v in (d, s, e)):
        return None
    size = x.meta["val"].shape[dim] if x.meta["val"].dim() > dim else None
    if d % x.meta["val"].dim() != dim or s != start or not (e == end or (end == size and e in (*_END, size))):
        return None
    return x


def rotate_half_without_cat(graph) -> int:
    """Rewrite every `cat((-x[..., h:], x[..., :h]), -1)` of `graph` (a post-grad FX graph) as indexing; returns how
    many."""
    aten, count = torch.ops.aten, 0
    for node in list(graph.nodes):
        if not is_call(node, aten.cat.default) or "val" not in node.meta:
            continue
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = node.meta["val"]
        if (len(parts) != 2 or type(dim) is not int or dim % out.dim() != out.dim() - 1
                or type(out.shape[-1]) is not int):
            continue
        width = out.shape[-1]
        half = width // 2
        neg, second = parts
        if width % 2 or not is_call(neg, aten.neg.default):
            continue
        last = out.dim() - 1
        x = _slice_of(neg.args[0], last, half, width)
        if x is None or _slice_of(second, last, 0, half) is not x or tuple(x.meta["val"].shape) != tuple(out.shape):
            continue
        call = node_maker(graph, out.fake_mode)
        with graph.inserting_before(node):
            index = call(torch.ops.prims.iota.default, width, start=0, step=1, dtype=torch.int64, device=out.device,
                         requires_grad=False)  # [2h]
            swap = call(aten.remainder.Scalar, call(aten.add.Tensor, index, half), width)  # h..2h-1, 0..h-1
            rolled = call(aten.index.Tensor, x, [None] * last + [swap])  # (x[h:], x[:h]), as indexing
            first = call(aten.lt.Scalar, index, half)
            rot = call(aten.where.self, first, call(aten.neg.default, rolled), rolled)
        node.replace_all_uses_with(rot)
        graph.erase_node(node)
        for n in (neg, neg.args[0], second):
            if not n.users:
                graph.erase_node(n)
        count += 1
    return count


__all__ = ["rotate_half_without_cat"]
