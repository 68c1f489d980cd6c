"""Context lookup for the engine: the batched, fixed-shape twin of `generation_carryover.context_lookup`.

The reference target's greedy responses loop, and a block drafter continues a loop poorly; copying what followed
the last n-gram's earliest earlier occurrence does (examples/lookup_hybrid_offline.py: +35 % τ at T=0). The
generate() path scans a Python list each round; a captured round cannot, so here every row compares its last n
tokens with every window of its committed sequence at once: `n` broadcast compares over `[b, S]` per n-gram
size, no host sync, no shape that depends on where a match is. At S = 2048 that is a few µs of GPU time.

The rule is exactly `context_lookup`'s (tests/test_engine_lookup.py compares them on random sequences): n from
`max_ngram` down to `min_ngram`, the earliest start s whose window ends before the sequence's last token, and at
most `num` tokens that follow it *inside* the committed sequence.
"""

from __future__ import annotations

import torch


def batched_context_lookup(seq: torch.Tensor, length: torch.Tensor, k: int, num: int, max_ngram: int = 4,
                           min_ngram: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, up to min(k, num) tokens copied from the row's committed sequence.

    seq `[b, S]`: committed tokens at their positions (anything past a row's length is ignored);
    length `[b]`: committed tokens per row, the anchor included (the anchor sits at length - 1).
    Returns (tokens `[b, k]`, n `[b]`): the first n of a row's tokens are the lookup (n = 0: no match; the other
    tokens are filler that a round must never accept).
    """
    b, S = seq.shape
    steps = torch.arange(S, device=seq.device)
    padded = torch.cat([seq, seq.new_zeros(b, max_ngram)], 1)  # [b, S + max_ngram]: windows past S read padding
    found = torch.zeros(b, dtype=torch.bool, device=seq.device)
    start = torch.zeros(b, dtype=torch.long, device=seq.device)  # where the copied continuation starts (s + n)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = seq.gather(1, (length[:, None] - n + steps[:n]).clamp(min=0))  # [b, n]: the row's last n tokens
        match = steps[None] <= (length - 1 - n)[:, None]  # [b, S]: windows [s, s+n) ending before the last token
        for i in range(n):
            match &= padded[:, i : i + S] == suffix[:, i : i + 1]
        hit = match.any(1) & ~found  # a longer n-gram's match wins
        start = torch.where(hit, match.long().argmax(1) + n, start)  # argmax: the earliest True
        found |= hit
    n_tok = torch.where(found, (length - start).clamp(max=min(k, num)), torch.zeros_like(start))
    tokens = seq.gather(1, (start[:, None] + steps[:k]).clamp(max=S - 1))  # [b, k]
    return tokens, n_tok


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The proposal distribution of looked-up tokens `[b, k]`: all mass on the token, `[b, k, vocab]` float32. A
    scatter rather than `one_hot`, whose value checks would sync on some devices."""
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


__all__ = ["batched_context_lookup", "point_mass"]
