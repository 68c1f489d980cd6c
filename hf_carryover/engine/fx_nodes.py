"""Finding and making nodes for the engine's inductor graph passes (`fuse_projections.py`, `rotate_half.py`,
`fold_linears.py`).

Why: a post-grad pass that adds nodes must give each its fake value (`meta["val"]`): inductor's lowering reads shapes,
strides and dtypes from it. One helper makes both, so no pass can add a node without one.
"""
from __future__ import annotations

import torch


def is_call(node, *targets) -> bool:
    """Whether `node` is an FX node calling one of `targets` (an argument may be a constant, or a node of another
    kind): the test every pattern the passes look for starts with."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def node_maker(graph, fake_mode):
    """`call(op, *args, **kwargs)`: a new `op` node in `graph` (at its current insertion point) with its fake value,
    computed by running `op` on the arguments' fake values (nested lists too) under `fake_mode`."""
    def call(op, *args, **kwargs):
        node = graph.call_function(op, args, kwargs)
        with fake_mode:
            node.meta["val"] = op(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]), **kwargs)
        return node
    return call


def constant_node(graph, name: str, value: torch.Tensor, fake_mode):
    """A `get_attr` node (at the graph's insertion point) for `value`, registered once on the graph's module as buffer
    `name`, with its fake value (its sizes are constants): a constant a pass computed at compile time."""
    gm = graph.owning_module
    if not hasattr(gm, name):
        gm.register_buffer(name, value)
    node = graph.get_attr(name)
    node.meta["val"] = fake_mode.from_tensor(getattr(gm, name), static_shapes=True)
    return node


def drop_constant(graph, node) -> None:
    """Erase the `get_attr` `node` if nothing reads it any more, and free its tensor unless another node names it."""
    if node.users:
        return
    graph.erase_node(node)
    gm = graph.owning_module
    if hasattr(gm, node.target) and not any(n.op == "get_attr" and n.target == node.target for n in graph.nodes):
        delattr(gm, node.target)


def erase_unused(nodes) -> None:
    """Erase each node of `nodes` that nothing reads, repeated until none is left to erase (a node read only by
    another of `nodes` goes once that one has): what a rewrite leaves of the pattern it replaced, in any order."""
    pending = list(dict.fromkeys(nodes))
    while dead := [node for node in pending if not node.users]:
        for node in dead:
            node.graph.erase_node(node)
            pending.remove(node)


__all__ = ["constant_node", "drop_constant", "erase_unused", "is_call", "node_maker"]
