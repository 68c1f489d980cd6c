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
batch-1 plain step of the 135M target took 0.948 ms against 1.040 (examples/results/h200-2026-12-05b). The rewrite
keeps a GEMM's arithmetic (fp32 products and sums, one rounding at the end), in another order.
"""
from __future__ import annotations

import torch

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

    def __init__(self, gemv_rows: int = 0):
        self.fused = 0
        self.graphs = 0
        self.gemv_rows = int(gemv_rows)
        self.gemvs = 0  # mm nodes rewritten as reductions (gemv_rows), over every graph seen

    def uuid(self):  # the FX graph cache's key: this file's code and the options that change what it does
        if get_hash_for_files is None:
            return None
        code = get_hash_for_files((__file__,))
        return (code.hex() if isinstance(code, bytes) else str(code), self.gemv_rows)

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            return
        self.graphs += 1
        mm = torch.ops.aten.mm.default
        groups: dict = {}  # (x node, in width, dtype, device) -> mm nodes in graph order
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not mm or node.kwargs:
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
        if self.gemv_rows:
            self.gemvs += _as_reductions(graph, self.gemv_rows)
        graph.lint()

    @staticmethod
    def _fuse(gm, graph, x, nodes) -> None:
        weights = [n.args[1] for n in nodes]
        # the constants are [in, out_i] views of [out_i, in] weights; concatenate the stored rows and view the result
        # the same way, so the merged GEMM reads memory in the layout the separate ones did
        w_cat = torch.cat([getattr(gm, w.target).t() for w in weights], 0).t()  # [in, sum(out_i)]
        name = f"_fused_{weights[0].target}"
        gm.register_buffer(name, w_cat)
        fake_mode = x.meta["val"].fake_mode
        widths = [w.meta["val"].shape[1] for w in weights]
        first = nodes[0]
        with graph.inserting_before(first):
            w_node = graph.get_attr(name)
            w_node.meta["val"] = fake_mode.from_tensor(w_cat)
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
            if not w.users:  # the separate constant is dead: free its memory
                graph.erase_node(w)
                if hasattr(gm, w.target):
                    delattr(gm, w.target)


def _as_reductions(graph, rows: int) -> int:
    """Rewrite `mm(x [M, K], W [K, N])` with a constant W and M <= rows as `sum(x[:, :, None] * W[None], 1)` in float32
    (float64 for float64 models), cast back to the mm's dtype. Returns how many were rewritten."""
    mm, count = torch.ops.aten.mm.default, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not mm or node.kwargs:
            continue
        x, w = node.args
        if _constant(x) or not _constant(w) or "val" not in x.meta or "val" not in w.meta:
            continue
        xv, wv = x.meta["val"], w.meta["val"]
        if xv.dim() != 2 or wv.dim() != 2 or not isinstance(xv.shape[0], int) or xv.shape[0] > rows:
            continue
        fake_mode, dtype = xv.fake_mode, node.meta["val"].dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32  # what a GEMM accumulates in

        def call(op, *args):
            out = graph.call_function(op, args)
            with fake_mode:
                out.meta["val"] = op(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
            return out

        with graph.inserting_before(node):
            x32 = call(torch.ops.prims.convert_element_type.default, x, acc)
            w32 = call(torch.ops.prims.convert_element_type.default, w, acc)
            prod = call(torch.ops.aten.mul.Tensor, call(torch.ops.aten.unsqueeze.default, x32, 2),
                        call(torch.ops.aten.unsqueeze.default, w32, 0))  # [M, K, 1] * [1, K, N] -> [M, K, N]
            out = call(torch.ops.prims.convert_element_type.default,
                       call(torch.ops.aten.sum.dim_IntList, prod, [1]), dtype)  # [M, N]
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    return count


__all__ = ["FuseSharedInputMatmuls"]
