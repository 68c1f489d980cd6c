"""The few-row projections of frozen compiled graphs, with the RMSNorm before them and the SiLU(gate) * up or residual
add after them, handed to one Triton kernel each (`fused_linear.py`; `SpeculativeEngine(fused_linear_rows=N)`).

Why: see `fused_linear.py`. Inductor could not do this itself: a norm's mean is a reduction over the row and the
projection another, and its own attempt to fold the norm into a reduction-written GEMV (`gemv_fusion`) recomputed the
mean for every output column and made a step slower (`h100-2026-12-05d`, `h100-2026-12-05f`).

`fold_linears(graph, rows)` runs in the engine's post-grad pass after q/k/v (and gate/up) were merged
(`fuse_projections.py`). For every `mm(x [M, K], W [K, N])` with a constant W and M <= rows (not a multi-row one
wider than `fused_linear.TILED_MAX_N`: a vocabulary head, faster on cuBLAS) it looks for three patterns, in the
forms transformers' Llama-style layers take after inductor's decompositions:
  * x made by an RMSNorm (`fuse_projections._rms_norm`: `reshape(w * cast(h * rsqrt(mean(h^2) + eps)))`): the kernel
    reads h and the norm's weight, and the norm's nodes go;
  * the mm read only as two equal column halves (two slices, or inductor's `split` of its own gate/up merge, either
    half first) that meet in `silu(gate) * up`, silu written as `g / (1 + exp(-g))` or `g * sigmoid(g)`, with casts
    between (`_glu_product`): the kernel writes the product;
  * otherwise, the mm read only by `reshape` -> `add(other, that)` of the same shape (a residual add): the kernel adds.
Everything else the mm feeds stays as it was. A graph with none of the patterns still gets every such mm on the kernel
(a plain projection). Returns the counts of each, for the engine's records.
"""
from __future__ import annotations

import operator

import torch

from . import fused_linear
from .fuse_projections import _constant_weight_mms, _equal_slices, _rms_norm
from .fx_nodes import constant_node, drop_constant, erase_unused, is_call, node_maker

_aten = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default
_VIEWS = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def _through(node, kinds):
    """Follow single-user nodes of `kinds` (reshapes, casts) from `node`; the last node reached and the chain."""
    chain = []
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not is_call(user, *kinds) or user.args[0] is not node:
            break
        chain.append(user)
        node = user
    return node, chain


def _silu_of(node):
    """The node computing silu(g) from g = `node` (`g / (1 + exp(-g))` or `g * sigmoid(g)`, each possibly followed by
    one cast), and the nodes in between, or (None, None)."""
    users = list(node.users)
    if len(users) != 2:
        return None, None
    neg = next((u for u in users if is_call(u, _aten.neg.default)), None)
    sig = next((u for u in users if is_call(u, _aten.sigmoid.default)), None)
    other = next((u for u in users if u is not (neg or sig)), None)
    if neg is not None and len(neg.users) == 1:
        exp = next(iter(neg.users))
        if is_call(exp, _aten.exp.default) and len(exp.users) == 1:
            one = next(iter(exp.users))
            if (is_call(one, _aten.add.Tensor) and one.args == (exp, 1) and len(one.users) == 1
                    and is_call(other, _aten.div.Tensor) and other.args == (node, one)):
                out, casts = _through(other, (_CONVERT,))
                return out, [neg, exp, one, other, *casts]
    if sig is not None and len(sig.users) == 1 and is_call(other, _aten.mul.Tensor) and set(other.args) == {node, sig}:
        out, casts = _through(other, (_CONVERT,))
        return out, [sig, other, *casts]
    return None, None


def _halves(mm):
    """(gate, up, nodes) when `mm`'s output is read only as two equal column halves: two slices (the engine's own
    merge, `fuse_projections.py`) or one `split` / `split_with_sizes` and its two items (inductor's freezing merge of
    equal-shape weights, gate/up on CUDA); else None."""
    pieces = _equal_slices(mm)
    if pieces is not None and len(pieces) == 2:
        (gate, _, _), (up, _, _) = sorted(pieces, key=lambda p: p[1])
        return gate, up, []
    if len(mm.users) != 1:
        return None
    split = next(iter(mm.users))
    width = mm.meta["val"].shape[1]
    if not (is_call(split, _aten.split_with_sizes.default, _aten.split.Tensor) and split.args[0] is mm
            and len(split.args) == 3 and not split.kwargs and split.args[2] in (1, -1)):
        return None
    sizes = split.args[1]
    if not (sizes == [width // 2] * 2 or sizes == width // 2) or width % 2:
        return None
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if len(items) != 2 or len(split.users) != 2 or set(items) != {0, 1}:
        return None
    return items[0], items[1], [split]


def _glu_product(mm):
    """(`silu(gate) * up`, the nodes between it and `mm`, whether up is the first half) when `mm`'s output is read
    only as gate and up halves (a merged gate/up), else (None, None, False)."""
    halves = _halves(mm)
    if halves is None:
        return None, None, False
    first, second, split = halves
    for gate, up, swapped in ((first, second, False), (second, first, True)):  # inductor's merge may put up first
        g, g_chain = _through(gate, (*_VIEWS, _CONVERT))
        u, u_chain = _through(up, (*_VIEWS, _CONVERT))
        silu, silu_chain = _silu_of(g)
        if silu is not None:
            break
    if silu is None or len(silu.users) != 1:
        return None, None, False
    prod = next(iter(silu.users))
    if not (is_call(prod, _aten.mul.Tensor) and set(prod.args) == {silu, u} and len(u.users) == 1):
        return None, None, False
    if prod.meta["val"].dtype != mm.meta["val"].dtype:
        return None, None, False
    return prod, [*split, gate, up, *g_chain, *u_chain, *silu_chain, prod], swapped


def _residual_add(mm):
    """(`add(other, reshape(mm))`, other, the reshapes between) when that is all `mm` feeds and both operands have one
    shape and dtype, else (None, None, None)."""
    view, chain = _through(mm, _VIEWS)
    if not chain or len(view.users) != 1:
        return None, None, None
    add = next(iter(view.users))
    if not is_call(add, _aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None, None, None
    other = add.args[1] if add.args[0] is view else add.args[0]
    if not isinstance(other, torch.fx.Node) or other is view or "val" not in other.meta:
        return None, None, None
    ov, vv = other.meta["val"], view.meta["val"]
    if ov.shape != vv.shape or ov.dtype != vv.dtype or add.meta["val"].shape != vv.shape:
        return None, None, None
    return add, other, chain


def _rows_of(graph, call, fake_mode, w, swap_halves=False):
    """A constant holding the weight `w` [K, N] as `[N, K]` rows with K contiguous (what the kernel reads in whole
    rows): the stored rows themselves where w is a transposed view of an nn.Linear weight, else a transposed copy made
    once at compile time (inductor's freezing merge concatenates gate/up as `[K, 2N]` with N contiguous). With
    `swap_halves` the copy has its two halves of rows swapped (a merged up/gate becomes gate/up, the kernel's order)."""
    gm = graph.owning_module
    value = getattr(gm, w.target).t()  # [N, K]
    if swap_halves:
        half = value.shape[0] // 2
        value = torch.cat([value[half:], value[:half]])  # [N, K], contiguous
    if value.stride(1) == 1 and not swap_halves:
        return call(_aten.permute.default, w, [1, 0])
    return constant_node(graph, f"_rows_{w.target}" + "_swapped" * swap_halves, value.contiguous(), fake_mode)


def fold_linears(graph, rows: int) -> dict:
    """Hand every constant-weight mm of at most `rows` rows to `fused_linear` with what it can fold (module
    docstring). Returns {"linears": mm nodes handed over, "norms", "glus", "residuals": patterns folded}."""
    op = torch.ops.hf_carryover.fused_linear.default
    counts = {"linears": 0, "norms": 0, "glus": 0, "residuals": 0}
    for node, x, w, xv, wv in _constant_weight_mms(graph):
        m, (k, n) = xv.shape[0], wv.shape
        if m > min(rows, fused_linear.MAX_ROWS) or fused_linear.available(xv.device) or xv.dtype != wv.dtype:
            continue
        call = node_maker(graph, xv.fake_mode)
        norm, h, upcast = _rms_norm(x), None, None
        if norm is not None:
            h = norm.h  # the norm's input, or its float32 copy (LlamaRMSNorm upcasts) whose source the kernel reads
            if is_call(h, _CONVERT) and h.args[1] == torch.float32 and xv.dtype != torch.float32:
                upcast, h = h, h.args[0]
            if norm.cast not in (None, xv.dtype) or h.meta["val"].dtype != xv.dtype:
                norm = None  # a norm whose input or output dtype is not the GEMM's: left as it is
        prod, glu_nodes, up_first = _glu_product(node)
        add, other, views = (None, None, None) if prod is not None else _residual_add(node)
        out_n = n // 2 if prod is not None else n
        if out_n > fused_linear.TILED_MAX_N and m > 1:  # a multi-row vocabulary head: cuBLAS was faster
            continue
        # where the new nodes go: before the node they replace, which comes after everything they read (the
        # residual may be computed after the mm, e.g. where a layer adds its input back last)
        with graph.inserting_before(prod if prod is not None else add if add is not None else node):
            xin = call(_aten.reshape.default, h, [m, k]) if norm is not None else x  # [..., K] -> [M, K]
            wt = _rows_of(graph, call, xv.fake_mode, w, up_first)  # [N, K], K contiguous: the kernel reads W's rows
            resid = call(_aten.reshape.default, other, [m, n]) if add is not None else None  # [..., N] -> [M, N]
            out = call(op, xin, wt, norm.weight if norm is not None else None, norm.eps if norm is not None else 1e-6,
                       resid, prod is not None, *fused_linear.settings(m, out_n, k, prod is not None))
        if prod is not None:
            with graph.inserting_after(out):
                shaped = call(_aten.reshape.default, out, list(prod.meta["val"].shape))
            prod.replace_all_uses_with(shaped)
            erase_unused([*reversed(glu_nodes), node])
        elif add is not None:
            with graph.inserting_after(out):
                shaped = call(_aten.reshape.default, out, list(add.meta["val"].shape))
            add.replace_all_uses_with(shaped)
            erase_unused([add, *views[::-1], node])
        else:
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        if norm is not None:
            norm.erase_dead()
            if upcast is not None and not upcast.users:
                graph.erase_node(upcast)
        drop_constant(graph, w)  # a weight copied into rows (`_rows_of`): the [K, N] constant, once dead, freed
        counts["linears"] += 1
        counts["norms"] += norm is not None
        counts["glus"] += prod is not None
        counts["residuals"] += add is not None
    return counts


__all__ = ["fold_linears"]
