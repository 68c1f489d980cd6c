"""The decoding call of `SpeculativeEngine` (a mixin): `generate()`, which prefills the prompts, starts the rows,
launches rounds (replayed, compiled or eager) with one host read per round, and with continuous batching reads out
finished rows and refills them.

Kept apart from `engine.py`, which holds the engine's options, static buffers and target forward: the loop only
orders what those provide (`_state`, `_row_prefill`, `_start`, `_graph`, `_round_fn`, `_target_forward`,
`_lookup_next`), so it reads as one procedure. The module docstring of `engine.py` describes a round.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..generation_carryover import eos_tensor
from .graphs import run_ahead
from .inputs import check_decoding, prompt_lists
from .one_row import OneRowSwitch, one_row_kernel
from .refill import ReadOut
from .sampling import inverse_cdf
from .state import DecodeState
from .timing import PhaseClock
from .tree import check_tree


def _decoding(method):
    """Decoding runs the target and drafter in eval mode (no dropout) and the target on the engine's attention
    function (`attention.py`: GQA inside SDPA, no K/V copies), and the caller's models get their own modes and
    attention back afterwards, submodule by submodule: building or running an engine (generate()'s tree path does
    both) leaves the models as it found them, as transformers' generate() does (it never switches modes).

    Models already in eval mode everywhere (the usual case) are only scanned: switching and restoring every
    submodule of the reference target and a 3-layer drafter (448) cost 6.9 ms a call on a 2-core CPU against 1.0 ms
    for the scan (`examples/host_overhead.py`, `h200-2026-12-02f`), several plain steps of a captured engine."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        models = [m for m in (self.target, self.drafter) if m is not None]
        training = [[sub for sub in m.modules() if sub.training] for m in models]
        for m, subs in zip(models, training):
            if subs:
                m.eval()
        try:
            with self.attention_context():
                return method(self, *args, **kwargs)
        finally:
            for sub in (sub for subs in training for sub in subs):
                sub.training = True
    return run



class DecodeLoop:
    """`generate()` for `SpeculativeEngine`, which provides the models, options, buffers and round functions."""

    @torch.no_grad()
    @_decoding
    def generate(self, prompts, max_new_tokens=256, do_sample=False, temperature=1.0, eos_token_id=None, seed=0,
                 prompt_lookup_num_tokens=None, tree=None, tree_nodes=None, batch_size=None):
        """prompts: token-id lists or a [batch, length] tensor (`inputs.prompt_lists`). Returns, in prompt order,
        the generated token lists (prompt excluded).

        prompt_lookup_num_tokens=N: context lookup (module docstring), transformers' argument name as in the
        generate() path; with a drafter it proposes at most its block, without one N tokens a round. After the call
        `self.lookup_rounds` holds, per prompt, which logged rounds proposed looked-up tokens.

        tree: a `TreeSpec` or a list of rank paths (`tree.py`): every round verifies that draft tree instead of the
        linear block (DFlash drafters). Output is still the target's greedy output, or at do_sample=True a draw from
        the target's distribution (each verified row's token drawn, `_tree_round`); `self.rounds` then
        logs, per round, the tokens emitted minus one, so `tau` is tokens per verification. tree_nodes=N: each row
        verifies only the N nodes of `tree` its drafter finds likeliest that round (a dynamic tree; `tree` is then
        the superset, e.g. a calibrated one from `examples/calibrate_tree.py`).

        batch_size=b (continuous batching): decode the prompts through b rows; as soon as a row's prompt finishes,
        its output is read out and the next waiting prompt is prefilled into that row alone, while the other rows go
        on (rows are independent: a row's output and rounds do not depend on what the other rows hold, tested). Why:
        with one static batch the call lasts as long as its slowest row, and speculative rows finish at very
        different rounds (their τ differs by prompt), so the rows that finish early would sit idle. None: all
        prompts in one batch. A refill prefills its row through a batch-1 staging cache (`refill.py`), one captured
        graph per prompt-width bucket when the rounds are captured."""
        lookup = 0
        if prompt_lookup_num_tokens is not None:
            if int(prompt_lookup_num_tokens) < 1:
                raise ValueError(f"prompt_lookup_num_tokens={prompt_lookup_num_tokens}: a lookup proposes at least "
                                 "one token (None: off).")
            lookup = int(prompt_lookup_num_tokens)
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size}: at least one row (None: every prompt in one batch).")
        t = self.target
        prompts = prompt_lists(prompts, t.get_input_embeddings().num_embeddings)  # bad prompts refused by name
        check_decoding(max_new_tokens, do_sample, temperature)
        dev = next(t.parameters()).device
        dtype = next(t.parameters()).dtype
        gen = torch.Generator(device=dev).manual_seed(seed)
        n = len(prompts)
        b = n if batch_size is None else min(int(batch_size), n)
        longest = max(len(p) for p in prompts)
        k = self.drafter.config.num_proposals if self.drafter is not None else lookup  # plain decoding: k = 0
        if longest + max_new_tokens + k + 2 > self.max_len:
            raise ValueError(f"max_len={self.max_len} is too small for prompts of {longest} tokens + "
                             f"{max_new_tokens} new tokens + a block of {k}.")
        eos = eos_tensor(eos_token_id).to(dev)
        tree = check_tree(tree, self.drafter, longest + max_new_tokens, self.max_len, tree_nodes)
        if tree is not None:  # the tree's tensors made here, not on the first round: made inside a compiled round,
            tree.tensors(dev)  # their Python loop over nodes broke its graph in two places (three inductor graphs)
        n_noise = (tree.num_nodes if tree_nodes is None else tree_nodes) + 1 if tree is not None and do_sample else None
        st = self._state(b, k, max_new_tokens, eos.numel(), dev, dtype, n_noise)

        def first_token(last):  # [r, V] logits at each prompt's end -> its first generated token [r]
            if do_sample:
                return inverse_cdf((last / temperature).softmax(-1), torch.rand(last.shape[0], generator=gen,
                                                                                  device=dev))
            return last.argmax(-1)

        # prefill (batched: eager; row by row: compiled with the rounds): prompts left-aligned at position 0; positions
        # past a row's prompt hold padding for now, overwritten by that row's rounds before any query can see them
        st.stage(prompts[:b], eos)
        can_capture = self.cuda_graphs and self._on_cuda(dev) and not self.profile
        if self.row_prefill if self.row_prefill is not None else can_capture:
            # row by row through the refill's width-bucket graphs (`refill.py`): an eager prefill of the 135M
            # reference target took 45-84 ms on the H200's host (launch-bound), 26-50 captured plain decoding steps
            prefill = self._row_prefill(st, b, can_capture)
            if b == 1:  # the prefill's own logits buffer [1, V], read before anything overwrites it
                st.first.copy_(first_token(prefill(0, st.prompt[:1], len(prompts[0]))))
            else:  # `prefill_ahead=N`: N rows a forward; each row's logits a copy (`RowPrefill.rows`)
                st.first.copy_(first_token(torch.cat(prefill.rows([(r, st.prompt[r : r + 1], len(p))
                                                                   for r, p in enumerate(prompts[:b])]))))
        else:
            width = max(len(p) for p in prompts[:b])
            pos = self._steps[:width][None].expand(b, -1)
            logits, feats = self._target_forward(st.cache, st.prompt[:, :width], pos)
            st.first.copy_(first_token(logits[torch.arange(b, device=dev), st.plen - 1]))
            if self.drafter is not None:
                st.dcache.write(self.drafter, self.drafter.fuse(feats), pos)
        st.temperature.fill_(temperature)
        self._start(st, lookup, can_capture)

        def refill(rows):  # continuous batching: the rows' next prompts staged, each prefilled into its row
            st.stage_rows(rows, [prompts[slot[r]] for r in rows])  # (`refill.py`), then all restarted at once
            if switch is not None:
                for r in rows:
                    switch.start(r, len(prompts[slot[r]]))
            # rows whose prompt was prefilled ahead take it; the others are prefilled now (after those copy-ins, which
            # read the staging caches that this forward rewrites; their logits copied first, for the same reason)
            last = {r: prefill.load(r, slot[r]) for r in rows if slot[r] in prefill.staged}
            cold = [r for r in rows if r not in last]
            if cold:
                last = {r: x.clone() for r, x in last.items()}
                last.update(zip(cold, prefill.rows([(r, st.prompt[r : r + 1], len(prompts[slot[r]])) for r in cold])))
            for r in rows:  # row order: a sampled first token draws as the plain refill does
                st.first[r : r + 1].copy_(first_token(last[r]))
            self._start(st, lookup, graphs[True] is not None, rows=True)
            stage_ahead()

        def stage_ahead():  # `prefill_ahead`: the next waiting prompts' forward, beside the rounds
            if self.prefill_ahead and waiting and not prefill.staged:
                keys = waiting[: prefill.slots]
                prefill.ahead(keys, [prompts[i] for i in keys])

        reader = ReadOut(st, n)  # outputs and round logs, read out row by row as rows finish
        slot = list(range(b))  # the prompt each row decodes (None: idle, its output read out)
        waiting = list(range(b, n))
        # `attention_one_row_keys`: plain steps on the kernel while every row's keys in use are few (`one_row.py`)
        keys = self.one_row_keys(b)
        switch = OneRowSwitch(keys, [len(p) for p in prompts[:b]]) if keys and k == 0 and tree is None else None

        def read_out(rows):  # finished rows' outputs queued for the host (`ReadOut`: no wait), their rows freed
            reader.take(rows, [slot[r] for r in rows])
            for r in rows:
                slot[r] = None
                if switch is not None:
                    switch.stop(r)

        # round variants: drafted (True) and, with lookup and a drafter, one that skips the drafter (False)
        skip_ok = bool(lookup) and self.drafter is not None and self.lookup_skips_drafter and tree is None
        graphs, modes = {}, {}
        for draft in (True, False) if skip_ok else (True,):
            graphs[draft], modes[draft] = self._graph(st, dev, do_sample, lookup, draft, tree, tree_nodes)
        if switch is not None and switch.can_start_on_kernel([len(p) for p in prompts]):
            with one_row_kernel():
                graphs["kernel"], _ = self._graph(st, dev, do_sample)
        self.last_mode = modes[True]
        if n > b:  # continuous batching: the row prefill, with graphs when the rounds have them
            prefill = self._row_prefill(st, b, graphs[True] is not None)
            prefill.drop()  # (a prompt an interrupted call staged is not one of this call's)
            stage_ahead()
        step = self._round_fn(do_sample, tree)
        if graphs[True] is None and step in (self._compiled_round, self._compiled_tree_round) and step is not None:
            self.last_mode += " +compile"
        clock = PhaseClock(self.profile, dev, self.timing)
        self.skipped_drafts = 0

        def launch(draft=True):  # one round: its uniforms, then the replay or the eager round
            if do_sample:
                st.draw(gen)  # outside the graph: the generator advances exactly as in the eager loop
            kernel = switch is not None and switch.next_on_kernel()
            graph = graphs.get("kernel") if kernel else graphs[draft]
            if graph is not None:
                graph.replay()
            elif tree is not None:
                step(st, tree, lookup, tree_nodes, do_sample)
            else:
                with one_row_kernel() if kernel else contextlib.nullcontext():
                    step(st, do_sample, clock, lookup, draft)
            if self.round_hook is not None:
                self.round_hook(st)

        def refill_finished(flags) -> bool:  # continuous batching: finished rows read out, the next prompts in
            reader.collect()  # earlier read-outs that have landed (host work while the GPU runs)
            finished = [r for r in range(b) if flags[2 + r] and slot[r] is not None] if waiting else []
            if finished:
                read_out(finished)
                rows = finished[: len(waiting)]  # (waiting is not empty here)
                for r in rows:
                    slot[r] = waiting.pop(0)
                refill(rows)
            return bool(finished)

        # one round queued ahead of the host (`graphs.run_ahead`) unless the next round depends on the host's read of
        # the last one (the drafter-skipping lookup variant) or the loop is watched (phase timing, a round hook)
        if self.run_ahead and not skip_ok and not self.profile and self.round_hook is None:
            self.last_launched = run_ahead(launch, st.flags, refill_finished)
        else:
            self.last_launched = 0
            while True:
                flags = st.flags.tolist()  # the one host sync per round (outputs stay on the device)
                if refill_finished(flags):
                    continue
                if flags[0]:  # every row done
                    break
                draft = not (skip_ok and flags[1])  # flags[1]: every row takes a lookup draft this round
                self.skipped_drafts += not draft
                launch(draft)
                self.last_launched += 1
        read_out([r for r in range(b) if slot[r] is not None])
        reader.collect(wait=True)
        self.kernel_steps = switch.kernel_steps if switch is not None else None
        self.rounds, self.lookup_rounds = reader.rounds, reader.looked
        return reader.outputs

    def _begin(self, st: DecodeState, lookup: int, rows: bool = False) -> None:
        """Start every row on its staged prompt (rows=True: those flagged in `st.loading`), then the next lookup."""
        st.restart() if rows else st.start()
        if lookup:
            st.flags[1] = self._lookup_next(st, lookup)

    @property
    def tau(self) -> float:
        acc = [a for r in self.rounds for a in r]
        return (sum(acc) + len(acc)) / max(len(acc), 1)


__all__ = ["DecodeLoop"]
