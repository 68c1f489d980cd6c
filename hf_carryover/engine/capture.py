"""Compiled and captured rounds of `SpeculativeEngine` (a mixin): which function runs a round, its CUDA graph per
shape, the graph of a call's start, and the row prefill.

Kept apart from `engine.py`, which holds the engine's options and its decode loop; these methods only decide *how* a
round runs (compiled or not, replayed or eager), never what it computes. A capture that fails is remembered and that
shape runs eagerly with a warning, never with a broken graph.
"""

from __future__ import annotations

import functools
import warnings

from .attention import TRITON_SETTINGS
from .compiling import compile_round
from .graphs import capture_round
from .refill import RowPrefill
from .state import DecodeState


class CapturedRounds:
    """`_start`, `_row_prefill`, `_compiled`, `_round_fn`, `_graph` and `_capture_once` for `SpeculativeEngine`, which
    provides `cuda_graphs`, `profile`, `compile`, `prefill_ahead`, the rounds (`_round`, `_tree_round`, their compiled
    forms), `_begin`, `_on_cuda` and the caches of graphs and prefills (`_graphs`, `_prefills`)."""

    def _start(self, st: DecodeState, lookup: int, use_graphs: bool, rows: bool = False) -> None:
        """`_begin`, as a graph captured once per state, lookup and `rows` where the rounds are captured. Why: eagerly
        it is 136 small ops at batch 1 with a tree and lookup (`examples/host_overhead.py`), each a host-side launch:
        about 7 ms a call on the H200's host (`h200-2026-12-02f`), a tenth of a batch-1 tree call."""
        begin = functools.partial(self._begin, st, lookup, rows)
        graph = None
        if use_graphs:
            graph = self._capture_once(("restart" if rows else "start", id(st), lookup), st, lambda: begin,
                                       "CUDA-graph capture of a call's start failed; starting eagerly")
        if graph is not None and not isinstance(graph, str):
            graph.replay()
        else:
            begin()

    def _row_prefill(self, st: DecodeState, b: int, use_graphs: bool) -> RowPrefill:
        """The row prefill of batch b (staging caches for `prefill_ahead` prompts, 1 where it is a bool; one graph per
        prompt-width bucket), made once per setting."""
        slots = 1 if isinstance(self.prefill_ahead, bool) else self.prefill_ahead
        key = (b, use_graphs, slots)
        if key not in self._prefills:
            self._prefills[key] = RowPrefill(self, st, use_graphs=use_graphs, slots=slots)
        return self._prefills[key]

    def _compiled(self, fn, dynamic: bool | None = False):
        """`fn` through torch.compile with this engine's backend and inductor options (`compiling.compile_round`)."""
        return compile_round(fn, self._compile_backend, self.compile_options, self._inductor_patch, dynamic)

    def _round_fn(self, do_sample, tree=None):
        """The compiled round where it applies (greedy or sampled; not when profiling: the clock's syncs would split
        the graph). `do_sample` is a Python bool, so greedy and sampled rounds compile separately."""
        if tree is not None:
            if self.compile and not self.profile:
                if self._compiled_tree_round is None:
                    self._compiled_tree_round = self._compiled(self._tree_round)
                return self._compiled_tree_round
            return self._tree_round
        if self._compiled_round is not None and not self.profile:
            return self._compiled_round
        return self._round

    def _graph(self, st: DecodeState, dev, do_sample, lookup=0, draft=True, tree=None, nodes=None):
        """(captured round or None, mode string). Captures on the first call for this shape; a failed capture is
        remembered (and warned about once), and that shape then decodes eagerly, never with a broken graph."""
        if not self.cuda_graphs:
            return None, "eager"
        if not self._on_cuda(dev):
            return None, "eager (no CUDA)"
        if self.profile:  # phase timing needs syncs inside the round
            return None, "eager (profile)"
        shape = None if tree is None else (tuple(tree.paths), nodes)
        # (the one-row attention setting too: `one_row.py` captures a plain step on the kernel beside the one on SDPA)
        key = (st.b, st.k, st.cap, st.eos.numel(), do_sample, lookup, draft, shape, TRITON_SETTINGS["min_rows"])
        if key not in self._graphs and bool(st.done.all()):  # nothing to decode: do not capture on a finished state
            return None, "eager (nothing to decode)"

        def make():  # the round to capture (made on a capture only)
            step = self._round_fn(do_sample, tree)
            return (lambda: step(st, tree, lookup, nodes, do_sample)) if tree is not None else (
                lambda: step(st, do_sample, None, lookup, draft))
        entry = self._capture_once(key, st, make, f"CUDA-graph capture failed for batch {st.b}; decoding eagerly")
        if isinstance(entry, str):
            return None, f"eager (capture failed: {entry})"
        return entry, "cuda_graph+compile" if self.compile else "cuda_graph"

    def _capture_once(self, key, st: DecodeState, make, failure: str):
        """The CUDA graph of `key` (a round shape, or a call's start), captured on its first use from the function
        `make()` returns, which reads and writes `st` and its caches; or, where that capture raised, the error's text:
        remembered, so the key runs eagerly from then on (never with a broken graph), and warned about once
        ("`failure`: error")."""
        if key not in self._graphs:
            try:
                self._graphs[key] = capture_round(make(), st.tensors())
            except Exception as e:  # noqa: BLE001  (any capture error: run eagerly instead)
                self._graphs[key] = f"{type(e).__name__}: {e}"
                warnings.warn(f"{failure}: {self._graphs[key]}", stacklevel=3)
        return self._graphs[key]


__all__ = ["CapturedRounds"]
