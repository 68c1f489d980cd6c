"""Fast decoding engine: static caches, fixed shapes, batched rows that advance independently.

Every round, for all b rows at once:
  1. the drafter drafts one block at each row's anchor (committed context visible by position, plus the
     fixed-size carryover buffer with a validity mask);
  2. the target verifies exactly k+1 tokens per row `[anchor, d_1..d_k]` through its own HF forward, with a
     position-indexed static cache (`TargetStaticCache`) and a by-position causal mask;
  3. per row: greedy acceptance (leading matches of the target's argmax) or lossless speculative sampling;
  4. the drafter's context cache receives all k+1 verified rows at their positions (rows past the accepted
     prefix stay invisible and are overwritten later); rows a+1..k become the next round's carryover.
No tensor changes shape between rounds; rollback is moving a row's position. Without a drafter the same loop
is plain autoregressive decoding (k = 0). This is the eager reference; CUDA-graph capture builds on it.
Sampling supports temperature only (no top-k/top-p/penalties yet); greedy needs no processors.
"""

from __future__ import annotations

import inspect
import time

import torch

from .static_cache import DrafterStaticCache, TargetStaticCache


class SpeculativeEngine:
    def __init__(self, target, drafter=None, max_len: int = 2048, profile: bool = False):
        """profile=True synchronises around the draft and verify phases and sums their wall time in
        `self.timing` (seconds: draft, verify, other) — for the latency model, at the cost of extra syncs."""
        self.profile = profile
        self.timing = {"draft": 0.0, "verify": 0.0, "other": 0.0, "rounds": 0}
        self.target = target.eval()
        self.drafter = drafter.eval() if drafter is not None else None
        if drafter is not None:
            drafter.bind_target(target)
        self.max_len = max_len
        params = inspect.signature(target.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
        self.rounds: list[list[int]] = []

    # ------------------------------------------------------------------ target
    def _target_forward(self, cache, tokens, positions):
        cache.positions = positions
        out = self.target(input_ids=tokens, position_ids=positions, attention_mask=cache.causal_mask(positions),
                          use_cache=True, output_hidden_states=self.drafter is not None,
                          **{self._cache_kw: cache})
        feats = self.drafter.target_features(out.hidden_states) if self.drafter is not None else None
        return out.logits.float(), feats

    # ------------------------------------------------------------------ drafter
    def _draft(self, dcache, anchor_tok, anchor_pos, carry, carry_pos, carry_valid, gen, temperature, do_sample):
        d, cfg = self.drafter, self.drafter.config
        B, b = cfg.block_size, anchor_tok.shape[0]
        block = d.embed_block(anchor_tok[:, None])  # [b, B, d]
        positions = anchor_pos[:, None] + torch.arange(B, device=anchor_pos.device)
        ctx = torch.arange(self.max_len, device=anchor_pos.device)[None] < anchor_pos[:, None]  # [b, max_len]
        mask = torch.cat([ctx, carry_valid, torch.ones(b, B, dtype=torch.bool, device=ctx.device)], 1)
        hidden = d(block, positions, cache=dcache, carryover_features=carry, carryover_positions=carry_pos,
                   attn_mask=mask[:, None, None, :])
        logits = d.lm_logits(hidden[:, d.proposal_rows()]).float()  # [b, P, V]
        if cfg.drafter_type != "markov" and not do_sample:
            return logits.argmax(-1), None  # greedy DFlash: rows are independent, no distribution needed

        def pick(row):
            if not do_sample:
                return row, row.argmax(-1)
            probs = (row / temperature).softmax(-1)
            return probs, torch.multinomial(probs, 1, generator=gen)[:, 0]

        tokens, dists = d.propose(logits, anchor_tok, pick)  # [b, k], [b, k, V]
        return tokens, (dists if do_sample else None)

    # ------------------------------------------------------------------ acceptance
    @staticmethod
    def _accept(drafts, q, logits, do_sample, temperature, gen):
        """Accepted count a `[b]` and the token emitted after them `[b]` (correction or bonus)."""
        b, k = drafts.shape
        if not do_sample:
            choice = logits.argmax(-1)  # [b, k+1]
            a = torch.cumprod((drafts == choice[:, :k]).long(), 1).sum(1)
            return a, choice.gather(1, a[:, None])[:, 0]
        p = (logits / temperature).softmax(-1)  # [b, k+1, V]
        q = p[:, :0] if q is None else q  # plain AR: no drafts, [b, 0, V], so the bonus slot samples p itself
        pd = p[:, :k].gather(2, drafts[..., None])[..., 0]
        qd = q.gather(2, drafts[..., None])[..., 0]
        u = torch.rand(b, k, generator=gen, device=drafts.device)
        ok = u * qd <= pd  # accept with probability min(1, p/q)
        a = torch.cumprod(ok.long(), 1).sum(1)
        rows = torch.arange(b, device=drafts.device)
        p_a = p[rows, a]  # target distribution at the first rejected (or bonus) slot
        q_a = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, a]  # bonus slot: residual is p itself
        resid = (p_a - q_a).clamp(min=0)
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)
        nxt = torch.multinomial(resid / resid.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
        return a, nxt

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens=256, do_sample=False, temperature=1.0, eos_token_id=None, seed=0):
        """prompts: list of token-id lists. Returns a list of generated token lists (prompt excluded)."""
        t = self.target
        dev = next(t.parameters()).device
        dtype = next(t.parameters()).dtype
        gen = torch.Generator(device=dev).manual_seed(seed)
        b = len(prompts)
        plen = torch.tensor([len(p) for p in prompts], device=dev)
        k = self.drafter.config.num_proposals if self.drafter is not None else 0
        if int(plen.max()) + max_new_tokens + k + 2 > self.max_len:
            raise ValueError(f"max_len={self.max_len} is too small for prompts of {int(plen.max())} tokens + "
                             f"{max_new_tokens} new tokens + a block of {k}.")
        eos = torch.tensor([] if eos_token_id is None else
                           ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)),
                           dtype=torch.long, device=dev)
        tc = t.config.get_text_config()
        hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        kvh = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        cache = TargetStaticCache(tc.num_hidden_layers, b, kvh, self.max_len, hd, dtype, dev)

        # prefill: prompts left-aligned at position 0; positions past a row's prompt hold padding for now
        width = int(plen.max())
        toks = torch.zeros(b, width, dtype=torch.long, device=dev)
        for r, p in enumerate(prompts):
            toks[r, : len(p)] = torch.tensor(p, device=dev)
        pos = torch.arange(width, device=dev)[None].expand(b, -1)
        logits, feats = self._target_forward(cache, toks, pos)
        last = logits[torch.arange(b, device=dev), plen - 1]
        if do_sample:
            anchor = torch.multinomial((last / temperature).softmax(-1), 1, generator=gen)[:, 0]
        else:
            anchor = last.argmax(-1)
        anchor_pos = plen.clone()  # position of the first generated token
        cap = max_new_tokens + k + 1
        out = torch.zeros(b, cap, dtype=torch.long, device=dev)  # generated tokens, device-side
        out[:, 0] = anchor
        n_out = torch.ones(b, dtype=torch.long, device=dev)
        done = torch.isin(anchor, eos) | (n_out >= max_new_tokens)
        accepted_log = []  # per round: accepted drafts per row, -1 where the row was already done

        if self.drafter is not None:
            d = self.drafter
            dcfg = d.config
            dcache = DrafterStaticCache(len(d.layers), b, dcfg.num_key_value_heads, self.max_len, dcfg.head_dim,
                                        d.fc.weight.dtype, dev)
            dcache.write(d, d.fuse(feats), pos)
            n_feat = feats.shape[-1]
            carry = torch.zeros(b, k, n_feat, dtype=feats.dtype, device=dev)
            carry_valid = torch.zeros(b, k, dtype=torch.bool, device=dev)
            j = torch.arange(1, k + 1, device=dev)
            carry_pos = anchor_pos[:, None] + j  # nothing valid in the first round; any positions do

        clock = _Clock(self.profile, dev, self.timing)
        while not bool(done.all()):  # the one host sync per round (outputs stay on the device)
            clock.start()
            if self.drafter is not None:
                drafts, q = self._draft(dcache, anchor, anchor_pos, carry if dcfg.carryover else None,
                                        carry_pos, carry_valid if dcfg.carryover else carry_valid[:, :0],
                                        gen, temperature, do_sample)
            else:
                drafts = torch.zeros(b, 0, dtype=torch.long, device=dev)
                q = None
            clock.lap("draft")
            block = torch.cat([anchor[:, None], drafts], 1)  # [b, k+1]
            bpos = anchor_pos[:, None] + torch.arange(k + 1, device=dev)
            logits, feats = self._target_forward(cache, block, bpos)
            clock.lap("verify")
            a, nxt = self._accept(drafts, q, logits, do_sample, temperature, gen)
            if self.drafter is not None:
                dcache.write(d, d.fuse(feats), bpos)
                carry = feats[:, 1:]
                carry_valid = (j[None] > a[:, None]) & ~done[:, None]
                carry_pos = bpos[:, 1:]
            emitted = torch.cat([drafts, torch.zeros_like(nxt)[:, None]], 1)
            emitted.scatter_(1, a[:, None], nxt[:, None])  # accepted drafts, then the correction/bonus
            # keep the first a+1 tokens, within the length budget, up to and including the first EOS
            idx = torch.arange(k + 1, device=dev)[None]
            keep = (idx <= a[:, None]) & (idx < (max_new_tokens - n_out)[:, None]) & ~done[:, None]
            is_eos = torch.isin(emitted, eos) & keep
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full_like(a, k + 1))
            keep &= idx <= first_eos[:, None]
            slots = (n_out[:, None] + idx).clamp(max=cap - 1)
            out.scatter_(1, slots, torch.where(keep, emitted, out.gather(1, slots)))
            n_out = n_out + keep.sum(1)
            accepted_log.append(torch.where(done, torch.full_like(a, -1), a))
            done = done | (n_out >= max_new_tokens) | is_eos.any(1)
            anchor = torch.where(done, anchor, nxt)
            anchor_pos = torch.where(done, anchor_pos, anchor_pos + a + 1)
            clock.lap("other")
        log = torch.stack(accepted_log, 1).tolist() if accepted_log else [[] for _ in range(b)]
        self.rounds = [[x for x in row if x >= 0] for row in log]
        n_out = n_out.tolist()
        return [row[:n] for row, n in zip(out.tolist(), n_out)]

    @property
    def tau(self) -> float:
        acc = [a for r in self.rounds for a in r]
        return (sum(acc) + len(acc)) / max(len(acc), 1)


class _Clock:
    """Phase timer for `profile=True` (synchronising, so only for measurement runs); a no-op otherwise."""

    def __init__(self, enabled, device, totals):
        self.enabled, self.device, self.totals = enabled, device, totals
        self.t = 0.0

    def _now(self):
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self):
        if self.enabled:
            self.t = self._now()
            self.totals["rounds"] += 1

    def lap(self, phase):
        if self.enabled:
            now = self._now()
            self.totals[phase] += now - self.t
            self.t = now


def predicted_speedup(tau: float, t_draft: float, t_verify: float, t_ar_step: float) -> float:
    """Latency model: tokens per second of speculative decoding over plain decoding,
    (τ / (T_draft + T_verify)) / (1 / T_ar_step); with T_ar_step ≈ T_verify it is τ·T_verify/(T_draft+T_verify)."""
    return tau * t_ar_step / (t_draft + t_verify)


__all__ = ["SpeculativeEngine", "predicted_speedup"]
