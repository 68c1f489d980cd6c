"""Compiled and captured rounds of `SpeculativeEngine` (a mixin): the compile options, which function runs a round,
its CUDA graph per shape, the graph of a call's start, and the row prefill.

Kept apart from `engine.py`, which holds the engine's other options and its decode loop; these methods only decide
*how* a round runs (compiled or not, replayed or eager), never what it computes. A capture that fails is remembered
and that shape runs eagerly with a warning, never with a broken graph.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .attention import TRITON_SETTINGS
from .compiling import check_inductor_options, compile_round
from .fuse_projections import FuseSharedInputMatmuls
from .graphs import capture_round
from .refill import RowPrefill
from .state import DecodeState
from .triton_attention import available as triton_available  # where the engine's Triton kernels run


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def runs_own_pass(compile, compile_options: dict) -> bool:
    """Whether the engine's frozen-weight inductor pass (`fuse_projections.py`: merged projections, `gemv_rows`)
    runs: compiled with `freezing=True`, the pass's slot not set by the caller's options."""
    return (bool(compile) and bool(compile_options.get("freezing"))
            and "post_grad_custom_pre_pass" not in compile_options)


def pdl_on(compile_options: dict) -> bool:
    """Whether inductor generates kernels with programmatic dependent launch: `triton.enable_pdl` in the options, else
    inductor's own setting (its environment variable TORCHINDUCTOR_ENABLE_PDL). It takes effect on CUDA devices of
    compute capability 9 and newer; elsewhere inductor leaves it out, and the weights-first order it asks of the
    GEMV rewrite (`fuse_projections.py`) changes nothing but the order of two loads."""
    import torch._inductor.config as inductor_config

    return bool(compile_options.get("triton.enable_pdl", getattr(inductor_config.triton, "enable_pdl", False)))


def kernel_rows(option: str, rows, device, compile, compile_options: dict, auto: bool = False) -> int:
    """`rows` of an engine option that hands the frozen weights' GEMMs of up to that many rows to one of the engine's
    Triton kernels in its own inductor pass (`skinny_rows`, `fused_linear_rows`), checked: a whole number, 0 (off) or
    more, and where it is on, a device the kernel runs on and compile=True with frozen weights. `auto`: the option
    also takes "auto" (resolved before this check), which the message names."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        also = "'auto', or " if auto else ""
        raise ValueError(f"{option}={rows!r}: {also}a number of rows, 0 (off) or more.")
    why = triton_available(device) if rows else None
    if rows and (why or not runs_own_pass(compile, compile_options)):
        raise ValueError(f"{option}={rows} hands the frozen weights' GEMMs to a Triton kernel in the engine's own "
                         f"inductor pass: {why or 'it needs compile=True with freezing=True'}.")
    return rows


def auto_gemv_rows(compile, device, compile_options: dict, config) -> int:
    """`gemv_rows="auto"`: 1 (batch-1 plain steps' GEMMs as generated reductions) only where it was timed faster, a
    CUDA target of hidden size <= 1024 where the engine's own pass runs (`runs_own_pass`); else 0."""
    return int(runs_own_pass(compile, compile_options) and _is_cuda(device)
               and getattr(config, "hidden_size", 1 << 30) <= 1024)


def auto_fused_linear_rows(compile, device, compile_options: dict, config) -> int:
    """`fused_linear_rows="auto"`: 32 (GEMMs of at most 32 rows on `fused_linear.py`'s kernels, norms, SiLU * up and
    residual adds folded in) where it was timed faster, else 0: a CUDA target with Triton where the engine's own pass
    runs (`runs_own_pass`), whose widest projection input (hidden or intermediate size) is at most 2048. Why that
    bound: the kernels load a program's weight rows and x whole, K padded to a power of two; they were timed at the
    reference target's 576 and 1536, and at a 4B target's 9728 a program's tile would be eight times wider, untimed.
    Timed on the reference target (an H100; `examples/results/`): a batch-1 plain step (one row, the one-row kernel
    whatever N) 20.9 % cheaper on MT-Bench and 20.4 % on HumanEval (`h100-2026-12-06h`); a batch-1 tree 31 + lookup
    round 2.2 % cheaper on MT-Bench (`h100-2026-12-07h`) and 3.3 % on HumanEval (`h100-2026-12-07i`); at batch 8
    (continuous, MT-Bench, `h100-2026-12-07j`) a plain step 0.5 % and a tree round 0.2 % cheaper, tokens/s +1.0 and
    +1.8 %. The GPU's compiled fp32 check passed for batch-1 plain steps and batch-1 tree rounds with 32 (the tiled
    kernel), not yet at batch 8. Linear rounds (16 verified rows) were not timed with it. Until 2026-12-07 "auto"
    was 1: the tiled form had lost a tree round (+3.2 %, `h100-2026-12-06g`, the vocabulary head on it) and a batch-8
    step (+3.3 %, `h100-2026-12-06h`) before the heads went back to cuBLAS and the norm pass of `dc0a7fe`. Any dtype:
    the bf16 rows were timed, and fp32 engines take the same path so that the compiled fp32 check covers the
    default."""
    widest = max(getattr(config, "hidden_size", 1 << 30), getattr(config, "intermediate_size", 0) or 0)
    on = (runs_own_pass(compile, compile_options) and _is_cuda(device) and triton_available(device) is None
          and widest <= 2048)
    return 32 if on else 0


class CapturedRounds:
    """`_start`, `_row_prefill`, `_compiled`, `_round_fn`, `_graph` and `_capture_once` for `SpeculativeEngine`, which
    provides `cuda_graphs`, `profile`, `compile`, `prefill_ahead`, the rounds (`_round`, `_tree_round`, their compiled
    forms), `_begin`, `_on_cuda` and the caches of graphs and prefills (`_graphs`, `_prefills`)."""

    def _setup_compile(self, compile, compile_options, gemv_rows, gemv_fusion, target, skinny_rows=0,
                       fused_linear_rows=0) -> None:
        """The constructor's compile options (`SpeculativeEngine`'s docstring says what each does and what it was
        measured at), checked and resolved: the backend, inductor's options, `gemv_rows` ("auto" resolved),
        `gemv_fusion`, `fused_linear_rows` ("auto" resolved), and the engine's own
        inductor pass where the weights are frozen."""
        self.compile = bool(compile)
        self._compile_backend = compile if isinstance(compile, str) else "inductor"
        if compile_options and (not compile or self._compile_backend != "inductor"):
            raise ValueError(f"compile_options={compile_options} are inductor options: they need compile=True "
                             f"(the inductor backend), not compile={compile!r}.")
        self.compile_options = dict(compile_options or {})
        if gemv_rows == "auto":
            gemv_rows = auto_gemv_rows(compile, target.device, self.compile_options, target.config)
        elif not isinstance(gemv_rows, int) or isinstance(gemv_rows, bool) or gemv_rows < 0:
            raise ValueError(f"gemv_rows={gemv_rows!r}: 'auto', or a number of rows, 0 (off) or more.")
        self.gemv_rows = gemv_rows
        if not (isinstance(gemv_fusion, bool) or gemv_fusion == "norms"):
            raise ValueError(f"gemv_fusion={gemv_fusion!r}: True, False or 'norms'.")
        if gemv_rows and not runs_own_pass(compile, self.compile_options):
            raise ValueError(f"gemv_rows={gemv_rows} rewrites the frozen weights' GEMMs in the engine's own inductor "
                             "pass: it needs compile=True with compile_options={'freezing': True} (and the pass's slot "
                             "left to the engine).")
        self.skinny_rows = kernel_rows("skinny_rows", skinny_rows, target.device, compile, self.compile_options)
        if fused_linear_rows == "auto":
            fused_linear_rows = auto_fused_linear_rows(compile, target.device, self.compile_options, target.config)
        self.fused_linear_rows = kernel_rows("fused_linear_rows", fused_linear_rows, target.device, compile,
                                             self.compile_options, auto=True)
        if self.compile_options:
            check_inductor_options(self.compile_options)
        # with frozen weights, q/k/v (and any projections sharing an input) become one GEMM whatever their widths
        # (`fuse_projections.py`); `compile_options` that set the slot themselves (None: off) keep their choice
        self.fused_projections = None
        self._inductor_patch = dict(self.compile_options)  # what `_compiled` sets: the options, and the pass
        if runs_own_pass(compile, self.compile_options):
            self.fused_projections = FuseSharedInputMatmuls(gemv_rows=gemv_rows, gemv_fusion=gemv_fusion,
                                                            weights_first=pdl_on(self.compile_options),
                                                            skinny_rows=skinny_rows, fused_rows=fused_linear_rows)
            self._inductor_patch["post_grad_custom_pre_pass"] = self.fused_projections
        self._compiled_round = self._compiled(self._round) if compile else None
        self._compiled_tree_round = None  # compiled on first use of a tree
        if compile:  # every engine and batch shape recompiles the round; past dynamo's limit (8) it would quietly
            cfg = torch._dynamo.config  # fall back to eager while last_mode still said "+compile"
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, name, max(getattr(cfg, name), 64))

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
