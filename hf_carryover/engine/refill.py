"""Prefill of one row while the other rows keep decoding: the refill step of continuous batching.

Why a module of its own: an eager HF forward of a small target is launch-bound. Refilled eagerly, a row cost 16-19 ms
on the H200 with SmolLM2-135M (the extra time of the continuous AR row over the static one, over 24 refills; eight or
nine batch-8 decoding steps), which made continuous batching slower than static batches
(examples/results/h200-2026-12-01g, call 6). Here the prompt is padded to a width bucket (a multiple of
`WIDTH_ALIGN`), run through a batch-1 *staging* cache, and its K/V (and the drafter's context K/V) are copied into
the batch's row `row`, a device tensor; so one CUDA graph per width bucket serves every row and every prompt of
that bucket, replayed like a round.

Padding is harmless for the same reason stale cache rows are (`static_cache.py`): the pad tokens sit after the
prompt, so causal attention keeps them out of every prompt position's output, and their K/V land at positions at or
past the row's anchor, which no query sees before the row's own rounds overwrite them. Only the last prompt
position's logits are computed (`logits_to_keep`), not a `[W, vocab]` block.
"""

from __future__ import annotations

import warnings

import torch

from ..modeling_drafter import DrafterStaticCache
from .graphs import capture_round
from .static_cache import TargetStaticCache

# prompt widths are padded up to a multiple of this: one captured graph per bucket (and, with compile and without
# `dynamic_prefill`, one compile per bucket, about as long as compiling a round). 128 rather than 64: the first 32
# HumanEval / MT-Bench prompts (49-243 tokens) fall in 2 buckets instead of 3 / 4, and padded rows cost a launch-bound
# prefill next to nothing
WIDTH_ALIGN = 128


def width_bucket(n: int, max_len: int) -> int:
    """The padded width a prompt of n tokens is prefilled at (its captured graph's), at most the caches' length."""
    return min(-(-n // WIDTH_ALIGN) * WIDTH_ALIGN, max_len)


class RowPrefill:
    """Staging caches (batch 1) and one graph per width bucket for refilling rows of the batch-b caches (which every
    `DecodeState` of batch b shares, so one RowPrefill serves them all)."""

    def __init__(self, engine, st, use_graphs: bool):
        tc, dev = engine.target.config.get_text_config(), st.anchor.device
        big = st.cache.k[0]  # [b, kv_heads, max_len, head_dim]
        self.engine, self.st, self.use_graphs = engine, st, use_graphs
        self.cache = TargetStaticCache(tc.num_hidden_layers, 1, big.shape[1], big.shape[2], big.shape[3], big.dtype,
                                       dev, engine._steps)
        self.dcache = None
        if st.dcache is not None:
            dk = st.dcache.keys[0]
            self.dcache = DrafterStaticCache(len(st.dcache.keys), 1, dk.shape[1], dk.shape[2], dk.shape[3], dk.dtype,
                                             dev)
        self.row = torch.zeros(1, dtype=torch.long, device=dev)  # the batch row to fill
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # the prompt's last position (its logits)
        self.tokens: dict[int, torch.Tensor] = {}  # width -> [1, width] padded prompt
        self.logits: dict[int, torch.Tensor] = {}  # width -> [1, vocab] float32 logits at `last`
        self.graphs: dict[int, object] = {}  # width -> CUDAGraph, or None where capture failed (eager)
        # compiled as the engine compiles its rounds: the captured eager forward still launches every unfused kernel
        # of an HF decoder layer, and on the H200 a 135M prefill replayed in 4.2-4.4 ms (`examples/profile_engine.py`,
        # h200-2026-12-03), four plain decoding steps, paid once per prompt and, under continuous batching, by every
        # row while one refills. With `engine.dynamic_prefill` one compile serves every width (the padded prompt's
        # width marked dynamic, all else static): per width, a cold benchmark row paid one compile per bucket, 3 on
        # 80 HumanEval prompts and a 4th on MT-Bench's, each about as long as a round's. Graphs stay one per width.
        compiled = engine.compile and not engine.profile
        self.dynamic_width = engine.dynamic_prefill and compiled
        self._fill_fn = engine._compiled(self._fill, None if self.dynamic_width else False) if compiled else self._fill

    def width(self, n: int) -> int:
        return width_bucket(n, self.engine.max_len)

    def _fill(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Staging forward of the padded prompt `tokens` `[1, w]`, then its rows copied into batch row `row`, and the
        last prompt position's logits into `logits` `[1, vocab]` (all in place). The width comes from `tokens`, not
        from an argument, so a compile that leaves it dynamic serves every width."""
        eng, st = self.engine, self.st
        w = tokens.shape[1]
        pos = eng._steps[:w][None]  # [1, w]
        self.cache.positions = pos
        out = eng.target(input_ids=tokens, position_ids=pos, attention_mask=self.cache.causal_mask(pos),
                         use_cache=True, output_hidden_states=eng.drafter is not None, logits_to_keep=self.last,
                         **{eng._cache_kw: self.cache})
        logits.copy_(out.logits[:, -1].float())
        pairs = list(zip(st.cache.k + st.cache.v, self.cache.k + self.cache.v))
        if eng.drafter is not None:
            feats = eng.drafter.target_features(out.hidden_states)
            self.dcache.write(eng.drafter, eng.drafter.fuse(feats), pos)
            pairs += list(zip(st.dcache.keys + st.dcache.values, self.dcache.keys + self.dcache.values))
        for big, small in pairs:  # [b, h, L, d] <- [1, h, L, d], positions < w only
            big.narrow(2, 0, w).index_copy_(0, self.row, small.narrow(2, 0, w))

    def __call__(self, r: int, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Prefill the first n tokens of `tokens` `[1, >= width]` (a state's staged prompt row, on the device, zeros
        past the prompt) into batch row r (caches only; the caller restarts the row's state). Returns the logits
        `[1, vocab]` (float32) at the prompt's last position, from which the row's first token is chosen. Nothing
        here waits for the GPU (device-to-device copies and fills only), so a refill queues behind running rounds."""
        w = self.width(n)
        if w not in self.tokens:
            self.tokens[w] = torch.zeros(1, w, dtype=torch.long, device=self.row.device)
            self.logits[w] = torch.zeros(1, self.engine.target.config.get_text_config().vocab_size,
                                         dtype=torch.float32, device=self.row.device)
        self.tokens[w].copy_(tokens[:, :w])
        self.row.fill_(r)
        self.last.fill_(n - 1)
        if self.use_graphs and w not in self.graphs:
            try:
                # what `_fill` writes: the staging buffers and the batch's caches (shared by every state of batch b)
                own = [self.row, self.last, self.tokens[w], self.logits[w]] + self.cache.k + self.cache.v
                own += self.st.cache.k + self.st.cache.v
                if self.dcache is not None:
                    own += self.dcache.keys + self.dcache.values + self.st.dcache.keys + self.st.dcache.values
                self.graphs[w] = capture_round(lambda: self._run(self.tokens[w], self.logits[w]), own)
            except Exception as e:  # noqa: BLE001  (as for rounds: what cannot be captured runs eagerly)
                # a failed capture is a property of the model, not of the width: stop trying (one warning, no
                # further capture attempts, each of which runs the prefill several times)
                self.graphs[w] = None
                self.use_graphs = False
                warnings.warn(f"CUDA-graph capture of the row prefill (width {w}) failed; prefilling eagerly from now "
                              f"on: {type(e).__name__}: {e}", stacklevel=3)
        graph = self.graphs.get(w) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._run(self.tokens[w], self.logits[w])
        return self.logits[w]

    def _run(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """`_fill` through its compiled function; a failed compile over a dynamic width falls back to compiling per
        width (warned once). A fill is idempotent (it writes the same rows again), so the retry loses nothing."""
        try:
            if self.dynamic_width:  # a fresh view is marked, not the staging tensor: a fallback compiles that static
                tokens = tokens.view(tokens.shape)
                torch._dynamo.maybe_mark_dynamic(tokens, 1)
            self._fill_fn(tokens, logits)
        except Exception as e:  # noqa: BLE001  (whatever the dynamic compile raised; the static one may still work)
            if not self.dynamic_width:  # (set only for a compiled prefill)
                raise
            warnings.warn(f"compiling the row prefill over a dynamic prompt width failed; compiling it per width "
                          f"bucket from now on: {type(e).__name__}: {e}", stacklevel=3)
            self.dynamic_width = False
            self._fill_fn = self.engine._compiled(self._fill)
            self._fill_fn(self.tokens[tokens.shape[1]], logits)


class ReadOut:
    """Finished rows' outputs and round logs on their way to the host (continuous batching). `take` queues one copy of
    the rows (behind the rounds already queued, ahead of the refill that restarts them), to pinned memory on CUDA;
    `collect` turns the copies that have landed into token lists. Why not a plain read: it waits for the GPU to drain
    the round queued ahead of the host, and the GPU then idles while the host queues the refill."""

    def __init__(self, st, n: int):
        self.st = st
        self.outputs, self.rounds, self.looked = [None] * n, [None] * n, [None] * n
        self.pending: list = []  # (prompt indices, host tensor [rows, cap + 2m + 2], event or None)

    def take(self, rows: list[int], prompts: list[int]) -> None:
        """Queue the read-out of batch rows `rows`, which decoded prompts `prompts` (indices into the call's list)."""
        if not rows:
            return
        st = self.st
        packed = torch.cat([st.out, st.accepted, st.looked.long(), st.n_out[:, None], st.round[:, None]], 1)
        rows_out = torch.stack([packed[r] for r in rows])  # [rows, cap + 2m + 2]: views, no index tensor to upload
        event = None
        if rows_out.is_cuda:
            host = torch.empty(rows_out.shape, dtype=rows_out.dtype, pin_memory=True)
            host.copy_(rows_out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = rows_out
        self.pending.append((prompts, host, event))

    def collect(self, wait: bool = False) -> None:
        """Decode the read-outs whose copies have landed; with wait=True all of them (waiting for the copies)."""
        cap, m = self.st.out.shape[1], self.st.accepted.shape[1]
        left = []
        for prompts, host, event in self.pending:
            if event is not None and not (wait or event.query()):
                left.append((prompts, host, event))
                continue
            if event is not None:
                event.synchronize()
            for i, row in zip(prompts, host.tolist()):
                out, acc, lk = row[:cap], row[cap : cap + m], row[cap + m : cap + 2 * m]
                n_out, cols = row[-2], min(row[-1], m)
                self.outputs[i] = out[:n_out]
                self.rounds[i] = [x for x in acc[:cols] if x >= 0]
                self.looked[i] = [q for x, q in zip(acc[:cols], lk[:cols]) if x >= 0]
        self.pending = left


__all__ = ["ReadOut", "RowPrefill", "WIDTH_ALIGN", "width_bucket"]
