"""The engine's static decoding state: every tensor a round reads and writes besides the weights and the caches.

Why a class of its own: a captured CUDA graph replays reads and writes at fixed addresses, so these tensors are
allocated once per shape and only ever updated in place (`DecodeState.tensors` lists what a capture snapshots).
The rounds (`linear_round.py`, `tree_round.py`) and the continuous-batching refill (`refill.py`) all work on it.
"""

from __future__ import annotations

import torch


def is_eos(tokens, eos):
    """`tokens` `[...]` in the EOS id list `eos` `[n]` (n may be 0): one broadcast compare, shape-static."""
    return (tokens[..., None] == eos).any(-1)


class DecodeState:
    """Everything a round reads and writes besides the weights: allocated once per (b, k, cap, n_eos) and only
    ever updated in place, because a captured graph holds these exact addresses. `reset` loads a new prompt's
    state after its (eager) prefill; positions the last call left in the caches are never visible (see
    `static_cache.py`: every position below a row's anchor is rewritten by that row's prefill or accepted
    verifications before any query can see it), so the caches are reused without clearing."""

    def __init__(self, b, k, max_new, n_eos, caches, n_feat, feat_dtype, device, seq_len, n_noise=None):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.b, self.k, self.max_new, self.cap = b, k, max_new, max_new + k + 1
        self.cache, self.dcache = caches
        self.rows = self.cache.rows  # [b, 1] `arange(b)`: the batch index of index_put_ writes (the caches' own)
        self.anchor, self.anchor_pos, self.n_out = zeros(b), zeros(b), zeros(b)  # token, its position, emitted
        self.done = zeros(b, dtype=torch.bool)
        self.out = zeros(b, self.cap)  # generated tokens; a round addresses slots n_out..n_out+k, hence k+1 spare
        # accepted drafts per row and round (-1 where the row was already done); an active row emits >= 1 token
        # a round and starts with 1, so at most max_new - 1 rounds run
        self.accepted = zeros(b, max(max_new, 1))
        self.round = zeros(b)  # per row: rounds since its prompt was loaded, the column of `accepted` to write
        self.seq = zeros(b, seq_len)  # committed tokens at their positions (prompt, anchor, emitted): for lookup
        self.looked = zeros(b, max(max_new, 1), dtype=torch.bool)  # per row and round: proposals came from lookup
        # the next round's context lookup, computed at the end of the previous round (or after the prefill), so that
        # the host learns whether that round needs the drafter from the same read that tells it whether to go on
        self.look, self.n_look = zeros(b, k), zeros(b)
        # [every row done, every unfinished row looks up, row 0 done, ..., row b-1 done]: the one read of a round (the
        # per-row flags tell continuous batching which rows to refill)
        self.flags = zeros(2 + b, dtype=torch.bool)
        self.eos = zeros(n_eos)
        self.carry = zeros(b, k, n_feat, dtype=feat_dtype) if n_feat else None  # last verification's rows 1..k
        self.carry_valid = zeros(b, k, dtype=torch.bool)
        self.carry_pos = zeros(b, k)
        # sampled rounds: the round's uniforms (k draft draws, k acceptance tests, 1 correction/bonus draw; a
        # sampled tree round one draw per verified row, `n_noise`) and the temperature live here, filled from the
        # call's Generator *outside* the round, so the round itself has no Generator argument: torch.compile does
        # not split it and a CUDA graph can replay it
        self.noise = zeros(b, n_noise or 2 * k + 1, dtype=torch.float32)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        # a call's prompts, staged for `start`: token ids (zeros past each prompt), lengths, first generated tokens.
        # Static so that the start of a call (136 small ops with a tree and the first lookup) can be one replayed graph
        self.prompt, self.plen, self.first = zeros(b, seq_len), zeros(b), zeros(b)
        self.loading = zeros(b, dtype=torch.bool)  # continuous batching: the rows `restart` loads

    def stage(self, prompts: list[list[int]], eos) -> None:
        """Stage a call's first b prompts (token-id lists, one per row) as `stage_rows` stages refills, and its EOS ids
        `[n_eos]`. The prefill reads `prompt`; `start` reads all of them and `first`."""
        self.stage_rows(list(range(len(prompts))), prompts)
        self.eos.copy_(eos)

    def stage_rows(self, rows: list[int], prompts: list[list[int]]) -> None:
        """Stage new prompts for rows `rows` (continuous batching: their previous requests were read out) and flag
        those rows for `restart`; `first` of each row is set by the caller from its prefill, which reads the staged
        prompt from `prompt`. One host-to-device copy whatever the number of rows, from pinned memory and
        asynchronous on CUDA. Why: a plain upload waits for the GPU to finish all it was given (the round queued ahead
        of the host), and the GPU then idles while the host queues the rest of the refill; here nothing in a refill
        waits, so the prefill and the restart land behind the queued round without a gap."""
        pad = self.prompt.shape[1]
        host = torch.zeros(len(rows), pad + 2, dtype=torch.long, pin_memory=self.prompt.is_cuda)  # [n, prompt|len|row]
        for j, (r, p) in enumerate(zip(rows, prompts)):
            host[j, : len(p)] = torch.as_tensor(p, dtype=torch.long)
            host[j, pad], host[j, pad + 1] = len(p), r
        data = host.to(self.prompt.device, non_blocking=True)  # (pinned: the allocator keeps it until copied)
        idx = data[:, pad + 1]
        self.prompt.index_copy_(0, idx, data[:, :pad])
        self.plen.index_copy_(0, idx, data[:, pad])
        self.loading.zero_().index_fill_(0, idx, True)

    def start(self) -> None:
        """Every row starts its staged prompt (after the call's prefill has set `first`). Reads and writes only this
        state's static tensors, so the engine replays it as a captured graph."""
        self._load(torch.ones_like(self.done))

    def restart(self) -> None:
        """The rows flagged in `loading` start their staged prompts, as `start` starts every row; the other rows are
        untouched. Static tensors only, so one captured graph serves every refill of a state. Why not row by row
        from the host: run eagerly, the reset and the lookup after it were ~150 small ops a refill (each a launch on
        the H200's host, with every row waiting), about as long as two tree rounds at batch 8."""
        self._load(self.loading)

    def _load(self, rows: torch.Tensor) -> None:
        """Rows flagged in `rows` `[b]` (bool) take their staged prompt: each tensor is rewritten in place, keeping its
        other rows (`torch.where` on a row mask, shape-static), then the flags."""
        first, plen = self.first, self.plen

        def put(t, new):  # t[rows] <- new[rows] (new broadcast over t's shape)
            t.copy_(torch.where(rows.view(-1, *[1] * (t.dim() - 1)), new, t))

        put(self.seq, self.prompt.scatter(1, plen[:, None], first[:, None]))  # prompt, then the first token
        put(self.looked, False)
        put(self.anchor, first)
        put(self.anchor_pos, plen)  # position of the first generated token
        put(self.out, torch.cat([first[:, None], torch.zeros_like(self.out[:, 1:])], 1))
        put(self.n_out, 1)
        put(self.done, is_eos(first, self.eos) | (self.max_new <= 1))  # the first token may end the row
        put(self.look, 0)
        put(self.n_look, 0)
        put(self.accepted, -1)
        put(self.round, 0)
        if self.carry is not None:  # nothing valid in the first round; any positions do
            put(self.carry, 0)
            put(self.carry_valid, False)
            put(self.carry_pos, plen[:, None] + torch.arange(1, self.k + 1, device=plen.device))
        self.set_flags(torch.zeros_like(self.done[0]))

    def set_flags(self, all_look: torch.Tensor) -> None:
        """`flags` from `done` and the lookup flag (a 0-d bool tensor), in place (also inside a round)."""
        self.flags.copy_(torch.cat([torch.stack([self.done.all(), all_look]), self.done]))

    def draw(self, gen: torch.Generator) -> None:
        """This round's uniforms from the call's generator (eager, before the round or its graph replay)."""
        self.noise.uniform_(0.0, 1.0, generator=gen)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a round writes (state and both caches): what capture must snapshot and restore."""
        own = [self.anchor, self.anchor_pos, self.n_out, self.done, self.out, self.accepted, self.round,
               self.carry_valid, self.carry_pos, self.seq, self.looked, self.look, self.n_look, self.flags]
        own += [self.carry] if self.carry is not None else []
        caches = self.cache.k + self.cache.v
        if self.dcache is not None:
            caches += self.dcache.keys + self.dcache.values
        return own + caches
