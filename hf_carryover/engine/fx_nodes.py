"""New nodes for the engine's inductor graph passes (`fuse_projections.py`, `rotate_half.py`).

Why: a post-grad pass that adds nodes must give each its fake value (`meta["val"]`): inductor's lowering reads shapes,
strides and dtypes from it. One helper makes both, so no pass can add a node without one.
"""
from __future__ import annotations

import torch


def node_maker(graph, fake_mode):
    """`call(op, *args, **kwargs)`: a new `op` node in `graph` (at its current insertion point) with its fake value,
    computed by running `op` on the arguments' fake values (nested lists too) under `fake_mode`."""
    def call(op, *args, **kwargs):
        node = graph.call_function(op, args, kwargs)
        with fake_mode:
            node.meta["val"] = op(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]), **kwargs)
        return node
    return call


__all__ = ["node_maker"]
