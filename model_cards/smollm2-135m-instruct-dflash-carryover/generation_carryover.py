"""`generate()` integration: a `CandidateGenerator` that drafts with a block drafter and feeds it carryover.

Copied verbatim into saved drafter folders (remote code); imports only `torch` and `transformers`.

How it plugs in (DESIGN.md §8). Transformers >= 5.8 lets a candidate generator ask for the target's full
verification outputs (`requires_model_outputs`), and calls `get_candidates(input_ids, model_outputs=...,
is_first_iteration=..., n_last_matches=...)`. The verification forward covers `[anchor, d_1 .. d_k]`, so its
hidden states hold `k+1` rows: rows `0..a` are now committed (anchor + accepted drafts) and rows `a+1..k`
are the carryover states. We count committed rows from the sequence length, not from `n_last_matches`, so
that transformers' own cropping at EOS or `max_length` cannot desynchronise the drafter cache.

`GenerationMixin._get_candidate_generator` has no registry, so `install_generate_hook()` wraps it once
(idempotently, across any number of copies of this module) and dispatches on the *instance method*
`assistant_model.make_candidate_generator`; `enable(target)` does the same for one target only.
Set `HF_CARRYOVER_NO_HOOK=1` to skip the import-time wrap and use `enable` instead. A drafter given a draft tree
(`drafter.use_draft_tree()`) also needs `_assisted_decoding` wrapped, which only the class-level hook does.
"""

from __future__ import annotations

import inspect
import os
import types
import warnings

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

_HOOK_MARK = "_hf_carryover_wrapped"


class CarryoverCandidateGenerator(CandidateGenerator):
    """Drafts one block per round; keeps the drafter's committed-context cache; passes carryover rows.

    Statistics of the last `generate()` call are in `self.rounds` (one dict per verification round:
    proposals, accepted) and `self.tau` (emitted tokens / verification forwards, prefill excluded).
    With `record_carryover=True` each round also stores the carryover features and positions it used.
    """

    requires_model_outputs = True
    # `True` (not a list of layers): the list form indexes differently before/after transformers 5.23.
    model_kwargs_overrides = {"output_hidden_states": True}

    def __init__(self, drafter, target, generation_config, logits_processor=None, model_kwargs=None,
                 input_ids=None, record_carryover: bool = False):
        from .modeling_drafter import DrafterContextCache  # sibling module; lazy to avoid an import cycle

        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"hf_carryover's generate() path supports batch size 1 only (transformers' assisted decoding "
                f"limit); got a batch of {input_ids.shape[0]}. Call generate() once per prompt."
            )
        self.drafter = drafter
        self.config = drafter.config
        self.cache = DrafterContextCache(len(drafter.layers))
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.eos_ids = eos_tensor(generation_config.eos_token_id)
        self.record_carryover = record_carryover
        # transformers' knob for how many tokens an assistant drafts (unset by default). A drafter proposes its whole
        # block unless the caller asks for fewer: a shorter verification, which pays where a target forward costs
        # more per token verified (a CPU) and drafts deep in the block are rarely kept
        n = getattr(generation_config, "num_assistant_tokens", None)
        if n is not None and int(n) < 1:
            raise ValueError(f"num_assistant_tokens={n}: a drafter must propose at least one token per round.")
        self.max_proposals = min(int(n), self.config.num_proposals) if n is not None else self.config.num_proposals
        # transformers' schedule for that number: "constant" (default), or "heuristic" / "heuristic_transient": +2
        # after a round that accepts every proposal, -1 after any other (at least 1, at most the block); "heuristic"
        # keeps the value on the drafter for its next generate() call, as transformers keeps it on its assistant
        self.schedule = getattr(generation_config, "num_assistant_tokens_schedule", None) or "constant"
        if self.schedule not in ("constant", "heuristic", "heuristic_transient"):
            raise ValueError(f"num_assistant_tokens_schedule={self.schedule!r}: expected 'constant', 'heuristic' or "
                             "'heuristic_transient'.")
        # transformers' prompt-lookup knob, here a hybrid: a round whose context ends in a 3- or 4-gram seen earlier
        # proposes what followed it (up to this many tokens, within the block) instead of drafting; else the drafter
        # drafts. The reference target's greedy responses loop, and its drafter continues loops poorly
        # (examples/lookup_hybrid_offline.py). Lossless: a looked-up proposal is a point mass, which the verifier
        # accepts with the target's own probability of that token. The two lengths are separate knobs, as in
        # transformers: num_assistant_tokens (and its schedule) sets drafted rounds only, so short drafts (cheap where
        # a verified row costs, e.g. on a CPU) can go with long copies.
        lt = getattr(generation_config, "prompt_lookup_num_tokens", None)
        if lt is not None and int(lt) < 1:
            raise ValueError(f"prompt_lookup_num_tokens={lt}: a lookup proposes at least one token (None: off).")
        self.lookup_tokens = None if lt is None else int(lt)
        kept = getattr(drafter, "_hf_carryover_num_proposals", None)
        if self.schedule == "heuristic" and kept is not None:
            self.max_proposals = min(int(kept), self.config.num_proposals)
        self.rounds: list[dict] = []
        self._pending = None  # number of proposals of the round being verified
        # static rounds (`StaticDraftRound`, CUDA graphs on CUDA): `drafter.static_rounds` None (default) = on CUDA
        # only; True = also on CPU, eagerly (what the tests compare); False = never. Built at the first draft, when
        # the target's feature dtype is known.
        mode = getattr(drafter, "static_rounds", None)
        self._use_static = drafter.fc.weight.is_cuda if mode is None else bool(mode)
        self.static: StaticDraftRound | None = None
        self._n_committed = 0
        self._pad_offset = 0
        mask = (model_kwargs or {}).get("attention_mask")
        if mask is not None and input_ids is not None:
            self._pad_offset = int((mask[0] == 0).sum())

    # -------------------------------------------------------------- statistics
    @property
    def tau(self) -> float:
        """Mean accepted length per verification round (accepted drafts + the bonus token)."""
        if not self.rounds:
            return float("nan")
        return sum(r["accepted"] + 1 for r in self.rounds) / len(self.rounds)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Record acceptance and follow the proposal schedule (overridden: on transformers 5.17 the base class
        method must not be used)."""
        if self._pending:
            self.rounds[-1]["accepted"] = int(num_matches)
            if self.schedule != "constant" and self.rounds[-1].get("source") != "lookup":  # drafted rounds only
                all_kept = int(num_matches) >= self.rounds[-1]["proposals"]
                self.max_proposals = (min(self.max_proposals + 2, self.config.num_proposals) if all_kept
                                      else max(1, self.max_proposals - 1))
                if self.schedule == "heuristic":
                    self.drafter._hf_carryover_num_proposals = self.max_proposals
        self._pending = None

    # -------------------------------------------------------------- drafting
    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round proposes, drafted or looked up (both stop at the drafter's `num_proposals`).
        transformers 5.25 reads it in assisted decoding to size the recurrent-state history of linear-attention
        caches, and fails without it."""
        return self.config.num_proposals

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if is_first_iteration:
            return input_ids, None  # the target prefills first; we draft from its hidden states next call
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("CarryoverCandidateGenerator needs the target's hidden states of the last forward.")
        drafter, cfg = self.drafter, self.config
        device = drafter.fc.weight.device
        hs = model_outputs.hidden_states
        n_rows = hs[0].shape[1]  # rows of the last target forward: prompt (prefill) or [anchor, d_1..d_k]
        n_committed_before = self.cache.length if self.static is None else self._n_committed
        n_new = input_ids.shape[1] - 1 - n_committed_before  # committed rows among them (anchor excluded)
        if not 0 < n_new <= n_rows:
            raise RuntimeError(f"Drafter cache out of sync: {n_new} new committed rows, {n_rows} verified rows.")
        features = drafter.target_features(hs).to(device)  # [1, n_rows, L*d_t]
        pos0 = n_committed_before - self._pad_offset
        positions = torch.arange(pos0, pos0 + n_rows, device=device)[None]
        if self._use_static and self.static is None:
            self.static = static_draft_round(drafter, self.max_length, features.dtype)
        if self.static is not None:  # stores all rows; the rejected ones stay in its buffer as carryover
            self.static.commit(features, n_new, pos0, skip=self._pad_offset if n_committed_before == 0 else 0)
            self._n_committed += n_new
        else:
            valid = None
            if n_committed_before == 0 and self._pad_offset:
                valid = torch.arange(n_new, device=device)[None] >= self._pad_offset
                positions = positions.clamp(min=0)
            drafter.append_context(self.cache, drafter.fuse(features[:, :n_new]), positions[:, :n_new], valid)

        carry = carry_pos = None
        if cfg.carryover and n_rows > n_new:
            carry, carry_pos = features[:, n_new:], positions[:, n_new:]  # rejected rows, original positions
        if self.record_carryover:
            self.rounds_carryover = getattr(self, "rounds_carryover", [])
            self.rounds_carryover.append({
                "features": None if carry is None else features[:, n_new:].detach().clone(),
                "positions": None if carry is None else carry_pos.detach().clone(),
                "committed": input_ids.shape[1] - 1,
            })

        budget = self.max_length - input_ids.shape[1] - 1  # drafts beyond this could never be emitted
        n_prop = min(self.max_proposals, budget)
        if n_prop <= 0:
            return input_ids, None
        if self.lookup_tokens:
            seq = input_ids[:, self._pad_offset :]
            num = min(self.config.num_proposals, budget, self.lookup_tokens)  # not capped by num_assistant_tokens
            look, n_look, _ = batched_context_lookup(seq, seq.new_full((1,), seq.shape[1]), num, num)
            m = int(n_look[0])  # the round's one sync for lookup
            if m:
                return self._lookup_round(input_ids, look[:, :m], model_outputs)
        anchor = input_ids[:, -1:].to(device)
        if self.static is not None:
            logits = self.static.draft(anchor)[:, :n_prop].clone()  # [1, n_prop, V]; the buffer is reused
        else:
            hidden = drafter.draft_hidden(anchor, input_ids.shape[1] - 1 - self._pad_offset, self.cache, carry,
                                          carry_pos)
            hidden = hidden[:, drafter.proposal_rows()][:, :n_prop]  # [1, n_prop, d]
            logits = drafter.lm_logits(hidden).float()
        tokens, logits = self._choose(input_ids, logits)
        tokens, logits = self._crop_at_eos(tokens, logits)
        self.rounds.append({"proposals": tokens.shape[1], "accepted": 0})
        if self.record_carryover:
            self.rounds[-1]["tokens"] = tokens[0].tolist()
        self._pending = True
        candidate = torch.cat([input_ids, tokens.to(input_ids.device)], dim=-1)
        return candidate, logits.to(input_ids.device)

    def _lookup_round(self, input_ids, look: torch.Tensor, model_outputs):
        """Propose tokens copied from the context. Their distribution is a point mass (logits 0 on the token, -inf
        elsewhere), so speculative sampling accepts each with the target's probability and resamples from the
        target's distribution without it: the target's law, as for drafted proposals."""
        logits_out = getattr(model_outputs, "logits", None)
        vocab = logits_out.shape[-1] if logits_out is not None else self.config.vocab_size
        tokens = look.to(input_ids.device)  # [1, m]
        logits = torch.full((1, tokens.shape[1], vocab), float("-inf"), device=input_ids.device)
        logits.scatter_(2, tokens[..., None], 0.0)  # [1, m, V]
        tokens, logits = self._crop_at_eos(tokens, logits)
        self.rounds.append({"proposals": tokens.shape[1], "accepted": 0, "source": "lookup"})
        self._pending = True
        return torch.cat([input_ids, tokens], dim=-1), logits

    def _choose(self, input_ids, logits):
        """Turn per-row drafter logits `[1, n, V]` into proposals and the distribution they were drawn from.

        Markov: row k's logits get `W2(W1[previous token])`, so tokens are chosen left to right. The returned
        logits are the processed (and, for Markov, corrected) ones: exactly what the proposals were sampled
        from, as lossless speculative sampling requires.
        """
        if self.config.drafter_type != "markov" and self.logits_processor is None:  # rows are independent
            tokens = (torch.multinomial(logits[0].softmax(-1), 1).T if self.do_sample else logits.argmax(-1))
            return tokens, logits
        seq = [input_ids.to(logits.device)]  # grows as proposals are chosen: processors may read it

        def pick(row):
            if self.logits_processor is not None:
                row = self.logits_processor(seq[0], row)
            token = torch.multinomial(row.softmax(-1), 1)[:, 0] if self.do_sample else row.argmax(-1)
            seq[0] = torch.cat([seq[0], token[:, None]], dim=-1)
            return row, token

        return self.drafter.propose(logits, input_ids[:, -1].to(logits.device), pick)

    def _crop_at_eos(self, tokens, logits):
        """Drop proposals after the first EOS (transformers < 5.23 would otherwise accept past it)."""
        if self.eos_ids.numel() == 0:
            return tokens, logits
        n = int(drafts_through_eos(tokens[0], self.eos_ids))
        return tokens[:, :n], logits[:, :n]


class StaticDraftRound:
    """The drafter's part of a `generate()` round on fixed shapes: a position-indexed drafter cache, a feature buffer
    of `P + 1` rows (the most a verification has) and a few device scalars, so that on CUDA each part replays as one
    captured CUDA graph.

    Why: through `generate()` the target stays eager, and on a GPU both it and an eager drafter are host-bound. On
    the H200 a verification of the reference target takes ~23 ms and a plain step ~20 ms, and the eager drafter
    (context append, three layers, the target's LM head: dozens of small kernels) added ~7 ms a round, so a round
    cost ~1.6 plain steps (`examples/profile_generate.py`). Replayed, the drafter's part costs two graph launches.

    Two graphs, each idempotent, so a capture's warm-up runs are the real work:
      * `write`: fuse the verified rows in `feat` and store their K/V at positions pos0..pos0+P. Rows past the
        committed ones land at or after the anchor, where the drafter's mask hides them until a later round
        overwrites them (the engine's rule, `DrafterStaticCache`).
      * `draft`: one block at the anchor; keys are the whole cache (visible below the anchor), then the rows
        1..P of `feat` as carryover (visible where `n_new <= j < n_rows`: the rejected rows of the last
        verification, at their own positions), then the block. Writes the proposal logits into `logits`.
    The prompt's rows (more than P + 1) are written eagerly by the same `DrafterStaticCache.write`.

    Everything else of the round (choosing proposals, logits processors, the Markov chain, the EOS crop, context
    lookup) stays eager and is shared with the dynamic path. The keys the drafter attends to are the same as the
    dynamic path's, in the same order, plus masked ones (which add exact zeros), so proposals agree with it up to
    floating-point summation order (tested on CPU, where the same code runs without capture).
    """

    def __init__(self, drafter, capacity: int, feat_dtype, device, graphs: bool):
        from .modeling_drafter import DrafterStaticCache  # sibling module; lazy to avoid an import cycle

        cfg = drafter.config
        self.drafter, self.capacity, self.graphs = drafter, capacity, graphs
        self.rows = cfg.num_proposals + 1
        d_feat = len(cfg.target_layer_ids) * cfg.hidden_size
        self.cache = DrafterStaticCache(len(drafter.layers), 1, cfg.num_key_value_heads, capacity, cfg.head_dim,
                                        drafter.fc.weight.dtype, device)
        self.steps = torch.arange(capacity, device=device)
        self.feat = torch.zeros(1, self.rows, d_feat, dtype=feat_dtype, device=device)
        self.ints = torch.zeros(3, dtype=torch.long, device=device)  # pos0, n_new, n_rows of the last verification
        self.anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
        n_prop = len(range(cfg.block_size)[drafter.proposal_rows()])
        self.logits = torch.zeros(1, n_prop, cfg.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict = {}  # "write" / "draft" -> CUDAGraph

    @torch.no_grad()
    def _write(self):
        d = self.drafter
        positions = (self.ints[0] + self.steps[: self.rows])[None]  # [1, P+1]
        self.cache.write(d, d.fuse(self.feat), positions)

    @torch.no_grad()
    def _draft(self):
        d, cfg = self.drafter, self.drafter.config
        B = cfg.block_size
        pos0, n_new, n_rows = self.ints[0], self.ints[1], self.ints[2]
        anchor_pos = pos0 + n_new
        block = d.embed_block(self.anchor)  # [1, B, d]
        visible = [(self.steps < anchor_pos)[None]]  # [1, capacity]: committed context only
        carry = carry_pos = None
        if cfg.carryover:
            j = self.steps[1 : self.rows]
            carry, carry_pos = self.feat[:, 1:], (pos0 + j)[None]  # [1, P, F], [1, P]
            visible.append(((j >= n_new) & (j < n_rows))[None])
        visible.append(torch.ones(1, B, dtype=torch.bool, device=block.device))
        mask = torch.cat(visible, 1)[:, None, None, :]  # [1, 1, 1, keys]
        hidden = d(block, (anchor_pos + self.steps[:B])[None], cache=self.cache, carryover_features=carry,
                   carryover_positions=carry_pos, attn_mask=mask)
        self.logits.copy_(d.lm_logits(hidden[:, d.proposal_rows()]).float())

    def _run(self, name: str):
        fn = self._write if name == "write" else self._draft
        if not self.graphs:
            return fn()
        graph = self._graphs.get(name)
        if graph is None:  # warm up on a side stream (lazy init, workspaces), then record; fn is idempotent
            try:
                with torch.cuda.device(self.feat.device):
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(2):
                            fn()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
            except Exception as e:  # noqa: BLE001  (any capture error: the same rounds, eagerly, from now on)
                warnings.warn(f"CUDA-graph capture of the drafter's {name} round failed; drafting eagerly on static "
                              f"shapes instead: {type(e).__name__}: {e}", stacklevel=2)
                self.graphs = False
                return fn()
            self._graphs[name] = graph
        graph.replay()

    def _set(self, pos0: int, n_new: int, n_rows: int):
        self.ints.copy_(torch.tensor([pos0, n_new, n_rows]), non_blocking=True)

    def commit(self, features: torch.Tensor, n_new: int, pos0: int, skip: int = 0):
        """Store a verification's rows `features [1, n_rows, F]` (raw target features) that start at position pos0;
        the first n_new are committed, the rest are next round's carryover. A prefill (more rows than a block, or
        `skip` left-padding rows to leave out) is written eagerly, the real prompt rows at positions 0.."""
        n_rows = features.shape[1]
        if skip or n_rows > self.rows:
            if n_rows != n_new:
                raise RuntimeError(f"A verification of {n_rows} rows exceeds the drafter's block ({self.rows} rows).")
            real = features[:, skip:]
            positions = self.steps[: real.shape[1]][None]
            self.cache.write(self.drafter, self.drafter.fuse(real), positions)
            self._set(real.shape[1] - 1, 1, 1)  # next draft: anchor right after the prompt, no carryover rows
            return
        self.feat[:, :n_rows].copy_(features)
        self._set(pos0, n_new, n_rows)
        self._run("write")

    def draft(self, anchor: torch.Tensor) -> torch.Tensor:
        """Proposal logits `[1, P, V]` (float32) of one block at `anchor [1, 1]`, after the last `commit`."""
        self.anchor.copy_(anchor)
        self._run("draft")
        return self.logits


def static_draft_round(drafter, max_length: int, feat_dtype) -> StaticDraftRound:
    """The drafter's `StaticDraftRound` for generations up to `max_length` tokens, reused across generate() calls
    (its graphs are captured once). Capacity is rounded up to 256 positions so nearby lengths share one. A graph
    holds the addresses of the drafter's weights and of the bound target's embedding and LM head, so the entry is
    rebuilt when any of those change (another target bound, the drafter moved or cast)."""
    device = drafter.fc.weight.device
    parts = drafter._require_target()
    need = max_length + 2 * drafter.config.block_size
    key = (device, feat_dtype, id(parts["lm_head"]), id(parts["embed"]),
           tuple(p.data_ptr() for p in drafter.parameters()))
    held = getattr(drafter, "_static_draft_round", None)
    if held is not None and held[0] == key and held[1].capacity >= need:
        return held[1]
    capacity = -(-need // 256) * 256
    entry = StaticDraftRound(drafter, capacity, feat_dtype, device, graphs=device.type == "cuda")
    drafter._static_draft_round = (key, entry)
    return entry


def batched_context_lookup(seq: torch.Tensor, length: torch.Tensor, k: int, num: int, max_ngram: int = 4,
                           min_ngram: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context lookup for a batch of committed sequences: per row, up to min(k, num) tokens that followed the earliest
    earlier occurrence of the row's last n tokens (n = max_ngram down to min_ngram; a longer match wins), copied from
    the row's committed sequence only. The earliest match is transformers' prompt-lookup choice too; in a loop it
    gives the longest continuation.

    seq `[b, S]`: committed tokens at their positions (anything past a row's length is ignored); length `[b]`: the
    row's committed tokens, the anchor included. Returns (tokens `[b, k]`, n `[b]`, ngram `[b]`): the first n tokens of
    a row are the lookup (n = 0: no match; the rest is filler that must never be accepted), found by an ngram-token
    match (0: none).

    Every row compares its last n tokens with all windows at once: a few broadcast compares over `[b, S]`, no host
    sync and no shape that depends on the match, so the engine's captured round runs it as is, and the generate()
    path pays one small kernel sequence per round instead of a Python scan of the whole sequence."""
    b, S = seq.shape
    steps = torch.arange(max(S, k, max_ngram), device=seq.device)
    # [b, S + max_ngram]: windows past S read padding (a pad, which a compiled round reads in place; a cat with
    # zeros was two kernels)
    padded = torch.nn.functional.pad(seq, (0, max_ngram))
    found = torch.zeros(b, dtype=torch.bool, device=seq.device)
    start = torch.zeros(b, dtype=torch.long, device=seq.device)  # where the copied continuation starts (s + n)
    ngram = torch.zeros(b, dtype=torch.long, device=seq.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = seq.gather(1, (length[:, None] - n + steps[:n]).clamp(0, S - 1))  # [b, n]: the row's last n tokens
        match = steps[None, :S] <= (length - 1 - n)[:, None]  # [b, S]: windows [s, s+n) ending before the last token
        for i in range(n):
            match &= padded[:, i : i + S] == suffix[:, i : i + 1]
        hit = match.any(1) & ~found
        start = torch.where(hit, match.long().argmax(1) + n, start)  # argmax: the earliest True
        ngram = torch.where(hit, torch.full_like(ngram, n), ngram)
        found |= hit
    n_tok = torch.where(found, (length - start).clamp(max=min(k, num)), torch.zeros_like(start))
    tokens = seq.gather(1, (start[:, None] + steps[:k]).clamp(max=S - 1))  # [b, k]
    return tokens, n_tok, ngram


def context_lookup(tokens: list[int], num: int, max_ngram: int = 4, min_ngram: int = 3) -> tuple[list[int], int]:
    """`batched_context_lookup` for one token list: (the looked-up tokens, the matched n-gram size), or ([], 0)."""
    if not tokens or num < 1:
        return [], 0
    look, n_tok, ngram = batched_context_lookup(torch.tensor([tokens]), torch.tensor([len(tokens)]), num, num,
                                                max_ngram, min_ngram)
    m = int(n_tok[0])
    return (look[0, :m].tolist(), int(ngram[0])) if m else ([], 0)


def eos_tensor(eos_token_id) -> torch.Tensor:
    """EOS id(s) as a long tensor `[n]`, n >= 0 (a generation config holds None, an int or a list)."""
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(eos, dtype=torch.long)


def drafts_through_eos(tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """How many of the drafts `tokens [..., k]` (k >= 1) are proposed: up to and including the first EOS, else all k.

    The one rule for drafts after a drafted EOS: generate() crops them (`_crop_at_eos`), so they are never verified
    and leave no carryover rows; the engine's rounds and stage-2 training follow it. One broadcast compare and no
    host sync, so it also runs inside a captured CUDA graph."""
    hit = (tokens[..., None] == eos_ids.to(tokens.device)).any(-1)  # [..., k]
    return torch.where(hit.any(-1), hit.long().argmax(-1) + 1, torch.full_like(hit[..., 0], tokens.shape[-1],
                                                                              dtype=torch.long))


def accepted_as_generate_counts(accepted: torch.Tensor, drafts: torch.Tensor, eos_ids: torch.Tensor,
                                budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's leading matches `accepted [b]` of drafts `[b, k]`, counted as `generate()` counts them, and how many
    drafts it verifies: `(accepted [b], n_drafted [b])`.

    generate() verifies the drafts through the first EOS and no more than `budget [b]` (tokens that can still be
    emitted after the anchor; <= 0: no drafts, hence no draft round), so matches past those do not count. And a
    draft that ends in EOS and is accepted whole counts one less: transformers lets the target emit that EOS itself
    (the emitted tokens are the same). The engine's rounds and the offline replay follow this one rule; no host
    sync, so it also runs inside a captured CUDA graph."""
    n_drafted = torch.minimum(drafts_through_eos(drafts, eos_ids), budget.clamp(min=0))
    accepted = torch.minimum(accepted, n_drafted)
    last = drafts.gather(1, (n_drafted - 1).clamp(min=0)[:, None])[:, 0]  # the last draft verified
    ends_in_eos = (last[:, None] == eos_ids.to(last.device)).any(-1) & (n_drafted > 0)
    return accepted - (ends_in_eos & (accepted == n_drafted)).long(), n_drafted


# ---------------------------------------------------------------------- hooking into generate()
def _dispatch(original):
    def _get_candidate_generator(self, *args, **kwargs):
        assistant = kwargs.get("assistant_model")
        make = getattr(assistant, "make_candidate_generator", None)
        own_dflash = getattr(kwargs.get("generation_config"), "speculation_type", None) == "dflash"
        if make is not None and getattr(assistant, "_is_carryover_drafter", False) and not own_dflash:
            return make(
                target=self,
                generation_config=kwargs["generation_config"],
                logits_processor=kwargs.get("logits_processor"),
                model_kwargs=kwargs.get("model_kwargs"),
                input_ids=kwargs.get("input_ids"),
            )
        return original(self, *args, **kwargs)

    setattr(_get_candidate_generator, _HOOK_MARK, True)
    return _get_candidate_generator


def _dispatch_trees(original):
    """`_assisted_decoding` for a drafter with `use_draft_tree(...)` set: greedy calls (left-padded batches too) run the
    package's tree rounds (`hf_carryover.engine.hf_generate`); any other call keeps transformers' loop (linear
    blocks), with one warning naming what stood in the way."""
    sig = inspect.signature(original)

    def _assisted_decoding(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        drafter = a.get("assistant_model")
        own_dflash = getattr(a["generation_config"], "speculation_type", None) == "dflash"  # transformers' own loop
        if (getattr(drafter, "_is_carryover_drafter", False) and getattr(drafter, "draft_tree", None) is not None
                and not own_dflash):
            from hf_carryover.engine.hf_generate import tree_blockers, tree_generate

            extra = a.get("model_kwargs", {})
            why = tree_blockers(drafter, a["input_ids"], a["generation_config"], a.get("logits_processor"),
                                a.get("stopping_criteria"), a.get("streamer"), a.get("synced_gpus", False),
                                extra.get("attention_mask"))
            if not why:
                drafter.bind_target(self)
                return tree_generate(self, drafter, a["input_ids"], a["generation_config"], extra.get("attention_mask"))
            warnings.warn("draft tree not used for this generate() call (" + "; ".join(why) + "): it verifies "
                          "linear blocks", stacklevel=4)
        return original(self, *args, **kwargs)

    setattr(_assisted_decoding, _HOOK_MARK, True)
    return _assisted_decoding


def install_generate_hook(force: bool = False) -> bool:
    """Wrap `GenerationMixin._get_candidate_generator` once so `generate(assistant_model=drafter)` works, and
    `_assisted_decoding` so a drafter with a draft tree (`use_draft_tree`) verifies trees.

    Returns True if the wrap is in place. Idempotent even when several copies of this module exist
    (the package and a remote-code copy), because the mark is on the wrapped function itself.
    """
    if os.environ.get("HF_CARRYOVER_NO_HOOK") == "1" and not force:
        return False
    current = GenerationMixin._get_candidate_generator
    if not getattr(current, _HOOK_MARK, False):
        GenerationMixin._get_candidate_generator = _dispatch(current)
    current = GenerationMixin._assisted_decoding
    if not getattr(current, _HOOK_MARK, False):
        GenerationMixin._assisted_decoding = _dispatch_trees(current)
    return True


def tree_hook_installed() -> bool:
    """generate() looks `_assisted_decoding` up on the class, so draft trees need the class-level hook (not the
    per-target `enable`)."""
    return getattr(GenerationMixin._assisted_decoding, _HOOK_MARK, False)


def enable(target):
    """Per-target switch: route `target.generate(assistant_model=drafter)` to the Carryover generator,
    without touching the class (for users who set `HF_CARRYOVER_NO_HOOK=1`)."""
    current = type(target)._get_candidate_generator
    if not getattr(target.__dict__.get("_get_candidate_generator"), _HOOK_MARK, False):
        target._get_candidate_generator = types.MethodType(_dispatch(current), target)
    return target


__all__ = ["CarryoverCandidateGenerator", "StaticDraftRound", "static_draft_round", "install_generate_hook", "enable",
           "tree_hook_installed",
           "eos_tensor", "drafts_through_eos",
           "accepted_as_generate_counts", "batched_context_lookup", "context_lookup"]
