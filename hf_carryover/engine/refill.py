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

Two steps, each its own compiled function and graph: the staging forward (`_forward`, one graph per width bucket)
and the copy of the staging caches into the batch row (`_copy_in`, one graph). Why apart: with `prefill_ahead` the
forward of the next waiting prompt runs on a side stream while the rounds go on (`RowPrefill.ahead`); it touches only
the staging caches, so it cannot race with a round, and only the copy-in, a few microseconds, waits in the rounds'
queue.

The staging caches hold `slots` prompts (the engine's `prefill_ahead=N`; 1 otherwise): one forward then prefills up to
N prompts, each in a slot of its own, and each copy-in takes one slot to one row. Why: a prefill of this size is
mostly fixed cost (1.57 ms of GPU time for one prompt on the H200, `h200-2026-12-03d`, against about 1 ms for a plain
decoding step of 320 kernels), and under continuous batching every refill pays it beside the rounds; N prompts in one
forward pay it about once. The slots are independent rows of the forward (batch rows of the target), so a prompt's
cache and logits are the same whichever slot or group it was prefilled in (tested on CPU against one prompt at a time).
"""

from __future__ import annotations

import warnings

import torch

from ..modeling_drafter import DrafterStaticCache
from .graphs import capture_round
from .static_cache import TargetStaticCache
from .triton_attention import counter_lane

# prompt widths are padded up to a multiple of this: one captured graph per bucket (and, with compile and without
# `dynamic_prefill`, one compile per bucket, about as long as compiling a round). 128 rather than 64: the first 32
# HumanEval / MT-Bench prompts (49-243 tokens) fall in 2 buckets instead of 3 / 4, and padded rows cost a launch-bound
# prefill next to nothing
WIDTH_ALIGN = 128


def width_bucket(n: int, max_len: int) -> int:
    """The padded width a prompt of n tokens is prefilled at (its captured graph's), at most the caches' length."""
    return min(-(-n // WIDTH_ALIGN) * WIDTH_ALIGN, max_len)


class RowPrefill:
    """Staging caches (batch `slots`), one forward graph per width bucket and one copy-in graph, for refilling rows of
    the batch-b caches (which every `DecodeState` of batch b shares, so one RowPrefill serves them all).

    Ways in: `__call__` prefills a prompt into a row at once and `rows` several (forwards of up to `slots` prompts,
    then copy-ins, in the current stream's order); `ahead` + `load` (the engine's `prefill_ahead`) run the forward of
    the next waiting prompts early, on a side stream, and later copy each into whichever row it is given to."""

    def __init__(self, engine, st, use_graphs: bool, slots: int = 1):
        tc, dev = engine.target.config.get_text_config(), st.anchor.device
        big = st.cache.k[0]  # [b, kv_heads, max_len, head_dim]
        self.engine, self.st, self.use_graphs, self.slots = engine, st, use_graphs, int(slots)
        self.cache = TargetStaticCache(tc.num_hidden_layers, self.slots, big.shape[1], big.shape[2], big.shape[3],
                                       big.dtype, dev, engine._steps)
        self.dcache = None
        if st.dcache is not None:
            dk = st.dcache.keys[0]
            self.dcache = DrafterStaticCache(len(st.dcache.keys), self.slots, dk.shape[1], dk.shape[2], dk.shape[3],
                                             dk.dtype, dev)
        self.row = torch.zeros(1, dtype=torch.long, device=dev)  # the batch row to fill
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # the staging slot it is filled from
        self.last = torch.zeros(self.slots, dtype=torch.long, device=dev)  # each slot's last prompt position
        self.tokens: dict[int, torch.Tensor] = {}  # width -> [slots, width] padded prompts
        self.logits: dict[int, torch.Tensor] = {}  # width -> [slots, vocab] float32 logits at each slot's `last`
        # width -> CUDAGraph of the staging forward, "copy" -> CUDAGraph of the copy-in; None where capture failed
        self.graphs: dict = {}
        cuda = self.row.is_cuda
        # The forward's graphs are captured on a stream of their own: cuBLAS keeps one workspace per (handle, stream),
        # and graphs captured on torch's shared capture stream (the rounds') share it, so a forward replayed on the
        # side stream beside a round would write the round's GEMM workspace. (The Triton attention's split counters
        # are kept apart the same way: `counter_lane`.)
        self.capture_stream = torch.cuda.Stream(device=dev) if cuda else None
        self.side = torch.cuda.Stream(device=dev) if cuda else None  # where `ahead` runs its forward
        self.ready = torch.cuda.Event() if cuda else None  # recorded on `side` after the staged forward
        self.released = torch.cuda.Event() if cuda else None  # the current stream's last use of the staging buffers
        self.staged: dict = {}  # key -> (slot, n, width) of the prompts `ahead` staged, until loaded or dropped
        # compiled as the engine compiles its rounds: the captured eager forward still launches every unfused kernel
        # of an HF decoder layer, and on the H200 a 135M prefill replayed in 4.2-4.4 ms (`examples/profile_engine.py`,
        # h200-2026-12-03), four plain decoding steps, paid once per prompt and, under continuous batching, by every
        # row while one refills. With `engine.dynamic_prefill` one compile serves every width (the padded prompt's
        # width marked dynamic, all else static): per width, a cold benchmark row paid one compile per bucket, 3 on
        # 80 HumanEval prompts and a 4th on MT-Bench's, each about as long as a round's. Graphs stay one per width.
        compiled = engine.compile and not engine.profile
        self.dynamic_width = engine.dynamic_prefill and compiled
        self._forward_fn = (engine._compiled(self._forward, None if self.dynamic_width else False) if compiled
                            else self._forward)
        self._copy_fn = engine._compiled(self._copy_in) if compiled else self._copy_in

    def width(self, n: int) -> int:
        return width_bucket(n, self.engine.max_len)

    def _forward(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Staging forward of the padded prompts `tokens` `[slots, w]` into the staging caches, and each slot's last
        prompt position's logits into `logits` `[slots, vocab]` (in place). Writes nothing a round reads. The width
        comes from `tokens`, not from an argument, so a compile that leaves it dynamic serves every width."""
        eng = self.engine
        n, w = tokens.shape
        # [slots, w]: 0..w-1 in every row, so the keys' end is its last column (`ordered`); a reduction over the dynamic
        # width (amax) failed inductor's GPU compile ("dynamic shape on reduction dimension", h100-2026-12-06e)
        pos = eng._steps[:w][None].expand(n, -1)
        self.cache.positions = pos
        out = eng.target(input_ids=tokens, position_ids=pos, attention_mask=self.cache.causal_mask(pos),
                         use_cache=True, output_hidden_states=eng.drafter is not None, logits_to_keep=self.last,
                         **{eng._cache_kw: self.cache}, **eng._key_end(pos, ordered=True))
        # out.logits [slots, slots, vocab]: every slot's row at every slot's `last`; slot j's own is [j, j]
        logits.copy_(out.logits.diagonal(0, 0, 1).t().float())
        if eng.drafter is not None:
            feats = eng.target_features(out.hidden_states)
            self.dcache.write(eng.drafter, eng.drafter.fuse(feats), pos)

    def _pairs(self) -> list:
        """(batch cache, staging cache) tensor pairs, target K/V then the drafter's."""
        st = self.st
        pairs = list(zip(st.cache.k + st.cache.v, self.cache.k + self.cache.v))
        if self.dcache is not None:
            pairs += list(zip(st.dcache.keys + st.dcache.values, self.dcache.keys + self.dcache.values))
        return pairs

    def _copy_in(self) -> None:
        """The staging caches into batch row `row`, whole (`[b, h, L, d] <- [1, h, L, d]`): one shape for every width,
        so one graph. Positions past the prompt get stale staging rows, which are as harmless as the pad rows (the
        row's rounds overwrite them before any query sees them)."""
        for big, small in self._pairs():
            big.index_copy_(0, self.row, small if self.slots == 1 else small.index_select(0, self.slot))

    def __call__(self, r: int, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Prefill the first n tokens of `tokens` `[1, >= width]` (a state's staged prompt row, on the device, zeros
        past the prompt) into batch row r (caches only; the caller restarts the row's state). Returns the logits
        `[1, vocab]` (float32) at the prompt's last position, from which the row's first token is chosen: a view of
        a buffer that the next forward of the same width overwrites. Nothing here waits for the GPU (device-to-device
        copies and fills only), so a refill queues behind running rounds. Prompts staged by `ahead` and not loaded
        are dropped (their forward is waited for: it used the same buffers)."""
        return self.rows([(r, tokens, n)])[0]

    def rows(self, items: list) -> list[torch.Tensor]:
        """`__call__` for several rows, `items` = [(row, tokens `[1, >= width]`, n)], in forwards of up to `slots`
        prompts (each padded to the widest bucket of its group). Returns each row's logits `[1, vocab]`, copies where
        there are several (a later group's forward would overwrite the buffer)."""
        self.drop()
        out = []
        for i in range(0, len(items), self.slots):
            group = items[i : i + self.slots]
            w = max(self._buffers(n) for _, _, n in group)
            for j, (_, tokens, _) in enumerate(group):
                self.tokens[w][j : j + 1].copy_(tokens[:, :w])
            self._forward_at(w, None, [n for _, _, n in group])
            for j, (r, _, _) in enumerate(group):
                last = self._copy_into(r, j, w)
                out.append(last.clone() if len(items) > 1 else last)
        return out

    def ahead(self, keys: list, prompts: list[list[int]]) -> None:
        """Run the staging forward of `prompts` (token-id lists, at most `slots`) now, on the side stream where there
        is one, behind everything the current stream was given so far; `load` copies each into a row later. `keys`
        name the prompts for the caller (`staged`). Why: under continuous batching a refill's forward (1.6 ms of GPU
        time on the H200, `h200-2026-12-03d`) otherwise runs in the rounds' stream with every other row waiting; the
        rounds of a small target leave most of the GPU idle, so beside them it costs the rows little. Off CUDA it runs
        in order, now, which is what the tests compare: the forward writes only the staging buffers, so when it runs
        cannot change what the rounds compute."""
        if not 1 <= len(prompts) <= self.slots or len(keys) != len(prompts):
            raise ValueError(f"RowPrefill.ahead: 1 to {self.slots} prompts with one key each, got {len(prompts)} "
                             f"prompts and {len(keys)} keys")
        self.drop()
        lengths = [len(p) for p in prompts]
        w = max(self._buffers(n) for n in lengths)
        host = torch.zeros(self.slots, w, dtype=torch.long, pin_memory=self.side is not None)  # [slots, w] padded
        for j, p in enumerate(prompts):
            host[j, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        if self.side is None:
            self._forward_at(w, host, lengths)
        else:
            self.released.record()  # copy-ins and first-token reads queued so far come first
            with torch.cuda.stream(self.side):
                self.side.wait_event(self.released)
                self._forward_at(w, host, lengths)  # (pinned `host`: kept by the allocator until copied)
                self.ready.record()
        self.staged = {key: (j, n, w) for j, (key, n) in enumerate(zip(keys, lengths))}

    def load(self, r: int, key=None) -> torch.Tensor:
        """The prompt `ahead` staged as `key` (None: the first staged), into batch row r: the current stream waits
        for its forward (on the GPU, not the host), then copies. Returns its last position's logits `[1, vocab]` as
        `__call__` does. The other staged prompts stay staged."""
        if not self.staged:
            raise RuntimeError("RowPrefill.load: no prompt was staged with ahead()")
        if key is None:
            key = next(iter(self.staged))
        if key not in self.staged:
            raise KeyError(f"RowPrefill.load: {key!r} was not staged (staged: {list(self.staged)})")
        j, _, w = self.staged.pop(key)
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        return self._copy_into(r, j, w)

    def drop(self) -> None:
        """Forget the staged prompts; the current stream waits for their forward, which writes the staging buffers."""
        if self.staged and self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        self.staged = {}

    def _forward_at(self, w: int, tokens: torch.Tensor | None, lengths: list[int]) -> None:
        """The staging forward of prompts of `lengths` tokens: `tokens` `[slots, w]` (padded; on the device, or pinned
        host memory copied without a wait), or None where the caller filled `self.tokens[w]`; on the current
        stream. Slots past `lengths` keep the tokens they held and read position 0 (their rows are computed and never
        read; a stale position could lie past this width). Fills, not an upload: nothing waits."""
        if tokens is not None:
            self.tokens[w].copy_(tokens, non_blocking=True)
        for j in range(self.slots):
            self.last[j : j + 1].fill_(lengths[j] - 1 if j < len(lengths) else 0)
        self._replay(w)

    def _copy_into(self, r: int, j: int, w: int) -> torch.Tensor:
        """Staging slot j into batch row r; returns that slot's last-position logits `[1, vocab]` (a view)."""
        self.row.fill_(r)
        if self.slots > 1:
            self.slot.fill_(j)
        self._replay("copy")
        return self.logits[w][j : j + 1]

    def _buffers(self, n: int) -> int:
        """The width bucket of a prompt of n tokens, its token and logits buffers made on first use."""
        w = self.width(n)
        if w not in self.tokens:
            self.tokens[w] = torch.zeros(self.slots, w, dtype=torch.long, device=self.row.device)
            self.logits[w] = torch.zeros(self.slots, self.engine.target.config.get_text_config().vocab_size,
                                         dtype=torch.float32, device=self.row.device)
        return w

    def _replay(self, key) -> None:
        """The forward at width `key` (an int) or the copy-in ("copy"): its graph, captured on first use where graphs
        are on, else the compiled or eager function. The Triton attention inside uses the prefill's own split counters
        (`counter_lane`), since `ahead` runs beside the rounds."""
        forward = key != "copy"
        run = (lambda: self._run(self.tokens[key], self.logits[key])) if forward else self._copy_fn
        with counter_lane("row_prefill"):
            if self.use_graphs and key not in self.graphs:
                try:
                    # what it writes: the staging buffers (forward); the batch's caches (copy-in, every state's)
                    pairs = self._pairs()
                    own = ([self.last, self.tokens[key], self.logits[key]] + [small for _, small in pairs] if forward
                           else [self.row, self.slot] + [big for big, _ in pairs])
                    self.graphs[key] = capture_round(run, own, stream=self.capture_stream if forward else None)
                except Exception as e:  # noqa: BLE001  (as for rounds: what cannot be captured runs eagerly)
                    # a failed capture is a property of the model, not of the width: stop trying (one warning, no
                    # further capture attempts, each of which runs the prefill several times)
                    self.graphs[key] = None
                    self.use_graphs = False
                    warnings.warn(f"CUDA-graph capture of the row prefill ({'width ' + str(key) if forward else key}) "
                                  f"failed; prefilling eagerly from now on: {type(e).__name__}: {e}", stacklevel=4)
            graph = self.graphs.get(key) if self.use_graphs else None
            if graph is not None:
                graph.replay()
            else:
                run()

    def _run(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """`_forward` through its compiled function; a failed compile over a dynamic width falls back to compiling per
        width (warned once). A forward is idempotent (it writes the same rows again), so the retry loses nothing."""
        try:
            if self.dynamic_width:  # a fresh view is marked, not the staging tensor: a fallback compiles that static
                tokens = tokens.view(tokens.shape)
                torch._dynamo.maybe_mark_dynamic(tokens, 1)
            self._forward_fn(tokens, logits)
        except Exception as e:  # noqa: BLE001  (whatever the dynamic compile raised; the static one may still work)
            if not self.dynamic_width:  # (set only for a compiled prefill)
                raise
            warnings.warn(f"compiling the row prefill over a dynamic prompt width failed; compiling it per width "
                          f"bucket from now on: {type(e).__name__}: {e}", stacklevel=4)
            self.dynamic_width = False
            self._forward_fn = self.engine._compiled(self._forward)
            self._forward_fn(self.tokens[tokens.shape[1]], logits)


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
