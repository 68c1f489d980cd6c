"""Finding and making nodes for the engine's inductor graph passes (`fuse_projections.py`, `rotate_half.py`).

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


__all__ = ["is_call", "node_maker"]
