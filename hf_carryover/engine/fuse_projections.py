"""One GEMM for the projections that read the same input, in frozen compiled rounds.

Why: at batch 1 a target step is launch-bound; each decoder layer's q, k and v projections are three small GEMMs
of the same normalised hidden states. Inductor's own freezing pattern merges such GEMMs only when their weights have
equal shapes (torch 2.11 on the H200), which grouped-query k/v never have next to q: on the H200 freezing merged
gate/up and left q/k/v as 90 of a plain step's 182 GEMMs (examples/results/h200-2026-12-02d).

`FuseSharedInputMatmuls` is an inductor post-grad pass. With `freezing=True` the weights are graph constants
(`get_attr` nodes), so every `mm(x, W_i)` with the same `x` and constant `W_i [in, out_i]` becomes one
`mm(x, W_cat)` with `W_cat = cat(W_i, dim=1)` computed once at compile time, followed by column slices. It is
generic: any target or drafter whose projections share an input, whatever their widths. Without freezing the
weights are graph inputs, not constants, and the pass changes nothing (a per-step `cat` would cost more than it
saves). `SpeculativeEngine` installs it with `freezing=True` unless `compile_options` name the slot themselves.
On the H200 it took a plain step of the 135M target from 182 GEMMs and 1.254 ms to 122 and 1.051 ms, and a 31-node
tree round with lookup from 1.986 to 1.802 ms (examples/results/h200-2026-12-02e).

`gemv_rows=N` (off at 0) also rewrites every constant-weight `mm` of at most N rows, after the merge, as a broadcast
multiply and a sum over the input width (`x[:, :, None] * W[None] -> sum(1)`), in float32 (float64 models: float64).
Why: at one row a GEMM is a matrix-vector product that reads 0.1-1 MB and costs about 4 us in cuBLAS, mostly fixed
cost (12-03c: 122 of them were 0.485 ms of a 1.0 ms plain step). As a reduction, inductor generates the product
itself and can fuse what surrounds it into the same kernel (a normalisation's scale before it). On the H200 a
batch-1 plain step of the 135M target took 0.948 ms against 1.040 (examples/results/h200-2026-12-05b). At 16 and 32
rows (a tree round's drafter and verify GEMMs) it lost: 2.196 and 5.212 ms a round against 1.475 (h200-2026-12-05g),
probably because the reduction reads each weight once per row where a GEMM reads it once (not profiled). The rewrite
keeps a GEMM's arithmetic (fp32 products and sums, one rounding at the end), in another order. `gemv_fusion` (off by
default) also folds the RMSNorm before such a GEMM into it, and splits a merged gate/up (`_FoldedNorm`,
`_equal_slices`): fewer kernels, but on an H100 a slower step (0.960 -> 1.034 ms, examples/results/h100-2026-12-05d).
`gemv_fusion="norms"` folds the norms only.

With inductor's programmatic dependent launch on (`compile_options={"triton.enable_pdl": True}`; Hopper and newer)
each generated kernel may start while the one before it finishes, and waits (`gdc_wait`) before its first read of what
that kernel wrote. The rewrite then puts the weight first in each product (`weights_first`), so inductor emits the
weight's load, the kernel's largest and never written by the graph, ahead of that wait; otherwise it comes after the
input's loads and so after the wait. A kernel after one inductor did not generate (each o_proj, after attention) waits
before every load either way. The products are the same numbers either way (multiplication commutes exactly).
Timed on an H100 with the option (`examples/results/h100-2026-12-06b`): a plain step 3.9 % cheaper, a tree round
3.9 % dearer; not a default.

`skinny_rows=N` (off at 0) hands every constant-weight `mm` of more than `gemv_rows` and at most N rows and at most
`skinny_gemm.MAX_COLS` output columns to `skinny_gemm.skinny_mm`, a Triton GEMM that gives each program 16 columns
for all rows (a tree round's 32 verified rows, the drafter's 16). Why: cuBLAS took 3.0-4.9 us for such GEMMs on an
H100, the kernel 2.7-4.4 (`examples/gemm_bench.py`, `h100-2026-12-06c`), a fixed cost paid 90+ times a round. On the
real target's tree rounds that saving did not show (1.410 against 1.418 ms, `h100-2026-12-06d`): off by default.

`fused_rows=N` (off at 0; the engine's `fused_linear_rows`) hands every constant-weight `mm` of at most N rows, after
the merge and before the GEMV and skinny rewrites, to `fused_linear.py`'s kernel with the RMSNorm before it and the
SiLU(gate) * up or residual add after it (`fold_linears.py`).

The pass also writes RoPE's `rotate_half` concatenations as indexing (`rotate_half.py`), in every frozen graph.
"""
from __future__ import annotations

import torch

from . import fx_nodes, rotate_half, skinny_gemm
from .fx_nodes import constant_node, drop_constant, erase_unused, is_call, node_maker

try:  # a CustomGraphPass with a uuid keeps inductor's FX graph cache usable
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover  (older torch: a plain callable also works, without the cache)
    CustomGraphPass, get_hash_for_files = object, None


def _constant(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "get_attr"


class FuseSharedInputMatmuls(CustomGraphPass):
    """Merge `aten.mm(x, W_i)` nodes that share `x` and have constant 2-D weights with the same input width.
    `self.fused` counts the GEMMs removed over every graph the pass has seen (tests and profiles read it), `self.graphs`
    the graphs it has seen. A graph inductor does not compile again (taken from one of its caches) does not pass
    through it, so both can read 0 while the loaded code is merged all the same (the H200 rows of 2026-12-05 read 0)."""

    def __init__(self, gemv_rows: int = 0, gemv_fusion: bool | str = False, weights_first: bool = False,
                 skinny_rows: int = 0, fused_rows: int = 0):
        self.fused = 0
        self.graphs = 0
        self.gemv_rows = int(gemv_rows)
        self.gemv_fusion = gemv_fusion if gemv_fusion == "norms" else bool(gemv_fusion)
        self.weights_first = bool(weights_first)  # the weight's load ahead of PDL's wait (module docstring)
        self.gemvs = 0  # mm nodes rewritten as reductions (gemv_rows), over every graph seen
        self.gemv_norms = 0  # of them, those with their RMSNorm folded in (gemv_fusion)
        self.rotations = 0  # RoPE rotate_half concatenations written as indexing (`rotate_half.py`)
        self.skinny_rows = int(skinny_rows)
        self.skinny = 0  # mm nodes handed to skinny_gemm (skinny_rows), over every graph seen
        self.fused_rows = int(fused_rows)
        # mm nodes handed to fused_linear (fused_rows) and the norms, SiLU * up and residual adds folded into them
        self.folded = {"linears": 0, "norms": 0, "glus": 0, "residuals": 0}

    def record(self) -> dict:
        """What a benchmark or profile row records of the pass: GEMMs merged (`fused_gemms`), rotate_half cats written
        as indexing (`rope_rotations`) and, with `gemv_rows`, the options and the GEMMs rewritten. Counts read None
        where the pass saw no graph (every one came from inductor's caches: see the class), where 0 would mislead."""
        seen = bool(self.graphs)
        res = {"fused_gemms": self.fused if seen else None, "rope_rotations": self.rotations if seen else None}
        if self.gemv_rows:
            res.update(gemv_rows=self.gemv_rows, gemvs=self.gemvs if seen else None, gemv_fusion=self.gemv_fusion,
                       gemv_norms=self.gemv_norms if seen else None, gemv_weights_first=self.weights_first)
        if self.skinny_rows:
            res.update(skinny_rows=self.skinny_rows, skinny_gemms=self.skinny if seen else None)
        if self.fused_rows:
            res.update(fused_linear_rows=self.fused_rows,
                       **{f"fused_{key}": value if seen else None for key, value in self.folded.items()})
        return res

    def uuid(self):  # the FX graph cache's key: this file's code and the options that change what it does
        if get_hash_for_files is None:
            return None
        from . import fold_linears, fused_linear

        code = get_hash_for_files((__file__, rotate_half.__file__, fx_nodes.__file__, skinny_gemm.__file__,
                                   fold_linears.__file__, fused_linear.__file__))
        return (code.hex() if isinstance(code, bytes) else str(code), self.gemv_rows, self.gemv_fusion,
                self.weights_first, self.skinny_rows, self.fused_rows)

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            return
        self.graphs += 1
        mm = torch.ops.aten.mm.default
        groups: dict = {}  # (x node, in width, dtype, device) -> mm nodes in graph order
        for node in graph.nodes:
            if not is_call(node, mm) or node.kwargs:
                continue
            x, w = node.args
            if _constant(x) or not _constant(w) or "." in w.target or "val" not in w.meta or "val" not in x.meta:
                continue
            wv = w.meta["val"]
            if wv.dim() != 2:
                continue
            groups.setdefault((x, wv.shape[0], wv.dtype, wv.device), []).append(node)
        for (x, _, _, _), nodes in groups.items():
            if len(nodes) > 1:
                self._fuse(gm, graph, x, nodes)
                self.fused += len(nodes) - 1
        self.rotations += rotate_half.rotate_half_without_cat(graph)
        if self.fused_rows:  # before the GEMV rewrite: what this folds is no longer an mm there
            from .fold_linears import fold_linears

            for key, value in fold_linears(graph, self.fused_rows).items():
                self.folded[key] += value
        if self.gemv_rows:
            gemvs, norms = _as_reductions(graph, self.gemv_rows, fold=bool(self.gemv_fusion),
                                          split=self.gemv_fusion is True, weights_first=self.weights_first)
            self.gemvs += gemvs
            self.gemv_norms += norms
        if self.skinny_rows:
            self.skinny += _as_skinny(graph, self.gemv_rows, self.skinny_rows)
        graph.lint()

    @staticmethod
    def _fuse(gm, graph, x, nodes) -> None:
        weights = [n.args[1] for n in nodes]
        # the constants are [in, out_i] views of [out_i, in] weights; concatenate the stored rows and view the result
        # the same way, so the merged GEMM reads memory in the layout the separate ones did
        w_cat = torch.cat([getattr(gm, w.target).t() for w in weights], 0).t()  # [in, sum(out_i)]
        fake_mode = x.meta["val"].fake_mode
        widths = [w.meta["val"].shape[1] for w in weights]
        first = nodes[0]
        with graph.inserting_before(first):
            w_node = constant_node(graph, f"_fused_{weights[0].target}", w_cat, fake_mode)
            fused = graph.call_function(torch.ops.aten.mm.default, (x, w_node))
            with fake_mode:
                fused.meta["val"] = torch.ops.aten.mm.default(x.meta["val"], w_node.meta["val"])
            start = 0
            for node, width in zip(nodes, widths):
                part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, 1, start, start + width))
                with fake_mode:
                    part.meta["val"] = torch.ops.aten.slice.Tensor(fused.meta["val"], 1, start, start + width)
                node.replace_all_uses_with(part)
                start += width
        for node, w in zip(nodes, weights):
            graph.erase_node(node)
            drop_constant(graph, w)  # the separate constant, once dead: free its memory


def _constant_weight_mms(graph):
    """`(node, x, W, x's fake value, W's)` for every `mm(x [M, K], W [K, N])` of `graph` with a constant 2-D W and all
    four sizes plain ints, over a snapshot of the nodes (the rewrites below replace them as they go)."""
    mm = torch.ops.aten.mm.default
    for node in list(graph.nodes):
        if not is_call(node, mm) or node.kwargs:
            continue
        x, w = node.args
        if _constant(x) or not _constant(w) or "val" not in x.meta or "val" not in w.meta:
            continue
        xv, wv = x.meta["val"], w.meta["val"]
        if xv.dim() != 2 or wv.dim() != 2 or not all(type(d) is int for d in (*xv.shape, *wv.shape)):
            continue
        yield node, x, w, xv, wv


def _as_reductions(graph, rows: int, fold: bool = False, split: bool = False,
                   weights_first: bool = False) -> tuple[int, int]:
    """Rewrite `mm(x [M, K], W [K, N])` with a constant W and M <= rows as `sum(x[:, :, None] * W[None], 1)` in float32
    (float64 for float64 models), cast back to the mm's dtype. With `fold`, an RMSNorm that makes x is computed inside
    the reduction (`_rms_norm`); with `split` (and fold), an mm read only through column slices of one width (gate/up)
    becomes one reduction per slice. With `weights_first` the product is `W[None] * x[:, :, None]`: inductor emits
    loads in the order a product reads its operands, so W's load comes ahead of PDL's wait (module docstring).
    Returns (GEMMs rewritten, norms folded).

    Why both can be chosen: on the CPU proxy (`examples/kernel_census.py`), folding kept q/k/v's reduction persistent
    (K loaded once), while the split gate/up, its norm recomputed per slice, became a looped reduction (three sums over
    K in two loops); with both, an H100 step was slower than with neither (examples/results/h100-2026-12-05d)."""
    count, folded = 0, 0
    for node, x, w, xv, wv in _constant_weight_mms(graph):
        if xv.shape[0] > rows:
            continue
        call = node_maker(graph, xv.fake_mode)
        dtype = node.meta["val"].dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32  # what a GEMM accumulates in
        norm = _rms_norm(x) if fold else None
        pieces = _equal_slices(node) if fold and split else None  # [(slice, start, end)] or None: whole output
        with graph.inserting_before(node):
            w32 = call(torch.ops.prims.convert_element_type.default, w, acc)
            if norm is None:
                x3 = call(torch.ops.aten.unsqueeze.default, call(torch.ops.prims.convert_element_type.default, x, acc),
                          2)  # [M, K, 1]
            for piece, start, end in pieces or [(node, 0, wv.shape[1])]:
                wp = w32 if pieces is None else call(torch.ops.aten.slice.Tensor, w32, 1, start, end)  # [K, n]
                if norm is not None:  # the normalised input again for every output column (a [M, K, n] expression)
                    x3 = call(torch.ops.prims.convert_element_type.default, norm(call, end - start), acc)
                w3 = call(torch.ops.aten.unsqueeze.default, wp, 0)  # [1, K, n]
                prod = call(torch.ops.aten.mul.Tensor, *((w3, x3) if weights_first else (x3, w3)))
                out = call(torch.ops.prims.convert_element_type.default,
                           call(torch.ops.aten.sum.dim_IntList, prod, [1]), dtype)  # [M, K, n] -> [M, n]
                piece.replace_all_uses_with(out)
        for piece, _, _ in pieces or []:
            graph.erase_node(piece)
        graph.erase_node(node)
        count += 1
        if norm is not None:
            folded += 1
            norm.erase_dead()
    return count, folded


def _as_skinny(graph, above: int, rows: int) -> int:
    """Rewrite `mm(x [M, K], W [K, N])` with a constant W, `above` < M <= `rows` and N <= `skinny_gemm.MAX_COLS` as
    `skinny_mm(x, W.T)` with the kernel's settings for M and K (`skinny_gemm.settings`). Returns the GEMMs rewritten."""
    op, count = torch.ops.hf_carryover.skinny_mm.default, 0
    for node, x, w, xv, wv in _constant_weight_mms(graph):
        m, (k, n) = xv.shape[0], wv.shape
        if (not above < m <= min(rows, skinny_gemm.MAX_ROWS) or n > skinny_gemm.MAX_COLS
                or skinny_gemm.available(xv.device)):
            continue
        call = node_maker(graph, xv.fake_mode)
        with graph.inserting_before(node):
            wt = call(torch.ops.aten.permute.default, w, [1, 0])  # [N, K]: the kernel reads W's rows
            out = call(op, x, wt, *skinny_gemm.settings(m, k))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    return count


def _equal_slices(node):
    """[(slice node, start, end)] when every user of the mm `node` is a column slice and all are one width (a merged
    gate/up), else None. As separate reductions of one width they fuse into one kernel, and with them what reads both
    (SiLU(gate) * up); the merged reduction's output would have to be written and read back."""
    users = list(node.users)
    if len(users) < 2 or any(not is_call(u, torch.ops.aten.slice.Tensor) or len(u.args) != 4 or u.args[1] != 1
                             or u.kwargs or not all(type(a) is int for a in u.args[2:]) for u in users):
        return None
    pieces = [(u, u.args[2], u.args[3]) for u in users]
    widths = {end - start for _, start, end in pieces}
    if len(widths) != 1 or sum(end - start for _, start, end in pieces) != node.meta["val"].shape[1]:
        return None
    return pieces


class _FoldedNorm:
    """x = reshape(w * cast?(h * rsqrt(mean(h ** 2, -1, keepdim) + eps)), [M, K]), an RMSNorm as transformers writes
    it (Llama, Qwen, Mistral...), found in the post-grad graph. Called with a width n, it builds the same expression
    as [M, K, n] with its mean taken over K for every output column: inductor then computes the mean and the GEMV in
    one kernel (two loops over K), where it launched a reduction for the mean alone. The mean is recomputed per column
    (K products of a vector that stays in cache); the arithmetic per element is the norm's own, with its casts."""

    def __init__(self, h, eps, weight, weight_first, h_first, cast, chain, m, k):
        self.h, self.eps, self.weight, self.weight_first, self.h_first = h, eps, weight, weight_first, h_first
        self.cast, self.chain, self.m, self.k = cast, chain, m, k

    def __call__(self, call, n):
        """A new expression each call: one node read by two reductions would be written out whole ([M, K, n])."""
        aten = torch.ops.aten
        hm = call(aten.reshape.default, self.h, [self.m, self.k])  # [..., K] -> [M, K]
        sq = call(aten.expand.default, call(aten.unsqueeze.default, call(aten.pow.Tensor_Scalar, hm, 2), 2),
                  [self.m, self.k, n])  # [M, K, n]
        var = call(aten.mean.dim, sq, [1], True)  # [M, 1, n]
        r = call(aten.rsqrt.default, call(aten.add.Tensor, var, self.eps))
        h3 = call(aten.unsqueeze.default, hm, 2)  # [M, K, 1]
        y = call(aten.mul.Tensor, h3, r) if self.h_first else call(aten.mul.Tensor, r, h3)  # [M, K, n]
        if self.cast is not None:
            y = call(torch.ops.prims.convert_element_type.default, y, self.cast)
        w3 = call(aten.reshape.default, self.weight, [1, self.k, 1])
        return call(aten.mul.Tensor, w3, y) if self.weight_first else call(aten.mul.Tensor, y, w3)

    def erase_dead(self):
        erase_unused(self.chain)  # the norm's own nodes that nothing reads any more


def _rms_norm(x):
    """The `_FoldedNorm` that makes the mm input `x`, or None when x is anything else."""
    aten, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default
    chain = []
    if not is_call(x, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    m, k = x.meta["val"].shape
    chain.append(x)
    scaled = x.args[0]
    if not is_call(scaled, aten.mul.Tensor) or len(scaled.users) != 1:
        return None
    chain.append(scaled)
    a, b = scaled.args
    weight_first = _constant(a) and a.meta.get("val") is not None and a.meta["val"].dim() == 1
    weight, y = (a, b) if weight_first else (b, a)
    if not (_constant(weight) and weight.meta["val"].shape == (k,)) or not isinstance(y, torch.fx.Node):
        return None
    cast = None
    if is_call(y, convert):
        if len(y.users) != 1:
            return None
        chain.append(y)
        cast, y = y.args[1], y.args[0]
    if not is_call(y, aten.mul.Tensor) or len(y.users) != 1:
        return None
    chain.append(y)
    for h_first, (h, r) in ((True, y.args), (False, y.args[::-1])):  # y = h * r or r * h
        if not (is_call(r, aten.rsqrt.default) and is_call(r.args[0], aten.add.Tensor)):
            continue
        mean, eps = r.args[0].args  # r = rsqrt(mean + eps)
        if not (is_call(mean, aten.mean.dim) and isinstance(eps, float)
                and is_call(mean.args[0], aten.pow.Tensor_Scalar) and mean.args[0].args == (h, 2)):
            continue
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        hv = h.meta["val"]
        norm_nodes = [r, r.args[0], mean, mean.args[0]]
        if (keepdim is not True or list(mean.args[1]) not in ([-1], [hv.dim() - 1]) or hv.shape[-1] != k
                or hv.numel() != m * k or any(len(n.users) != 1 for n in norm_nodes)):
            return None
        return _FoldedNorm(h, eps, weight, weight_first, h_first, cast, chain + norm_nodes, m, k)
    return None


__all__ = ["FuseSharedInputMatmuls"]
