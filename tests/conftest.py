"""Shared builders for the core tests: tiny Llama / Qwen3 targets and drafters, built in-process, fp32, seeded.

Everything here is CPU-only and offline. The targets are initialised with `initializer_range=0.3` (not HF's
0.02) so that greedy argmax margins are ~1e-2, far above fp32 noise: an exactness test must not hinge on a
coin flip between two nearly-equal logits (`assert_clear_argmax` guards this). Drafters get non-zero
`carryover_embedding` and Markov `markov_out` weights: both are zero-initialised by design, and a zero would
hide a bug that drops them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_carryover  # noqa: F401  (installs the generate() hook)
from hf_carryover import CarryoverCandidateGenerator, Drafter

# Tiny ops: handing them to a second thread costs far more than it saves (measured: 10x slower per
# speculative generate() on a loaded 2-core machine).
torch.set_num_threads(1)

ARCHS = ("llama", "qwen3")
DRAFTER_TYPES = ("dflash", "markov")
VOCAB = 96
NUM_TARGET_LAYERS = 6
# Tapped target layers for test drafters: distinct, spread, never the last (post-norm) one.
TARGET_LAYER_IDS = [0, 2, 4]


def build_target(arch: str = "llama", *, vocab_size: int = VOCAB, num_layers: int = NUM_TARGET_LAYERS,
                 seed: int = 0, initializer_range: float = 0.3, eos_token_id=None, pad_token_id=None):
    """A tiny fp32 causal LM (hidden 32, 4 heads, 2 KV heads). Qwen3 gets head_dim 16 != hidden/heads."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=initializer_range, bos_token_id=None, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(arch)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def build_drafter(target, drafter_type: str = "dflash", carryover: bool = True, *, seed: int = 1,
                  block_size: int = 4, num_layers: int = 2, target_layer_ids=None, **overrides) -> Drafter:
    """A randomly initialised drafter for `target`, with its zero-initialised extras made non-zero."""
    torch.manual_seed(seed)
    overrides.setdefault("mask_token_id", target.config.vocab_size - 1)
    d = Drafter.from_target(
        target, drafter_type=drafter_type, carryover=carryover, block_size=block_size,
        num_hidden_layers=num_layers, target_layer_ids=list(target_layer_ids or TARGET_LAYER_IDS), **overrides,
    ).eval()
    with torch.no_grad():
        if d.carryover_embedding is not None:
            d.carryover_embedding.normal_(std=1.0)
        if d.mask_embedding is not None:
            d.mask_embedding.normal_(std=1.0)
        if drafter_type == "markov":
            d.markov_out.weight.normal_(std=1.0)
    return d


def make_prompt(length: int, vocab_size: int = VOCAB, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + length)
    return torch.randint(0, vocab_size - 1, (1, length), generator=g)  # never the mask row (vocab-1)


def left_padded_prompt(n_pad: int, length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch-1 prompt of `length` tokens after `n_pad` pad tokens, and its attention mask `[1, n_pad + length]`."""
    ids = torch.cat([torch.full((1, n_pad), pad), make_prompt(length)], dim=1)
    mask = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), torch.ones(1, length, dtype=torch.long)], dim=1)
    return ids, mask


def greedy(target, ids, max_new_tokens: int, **kwargs) -> torch.Tensor:
    return target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def speculative(target, drafter, ids, max_new_tokens: int, **kwargs) -> torch.Tensor:
    kwargs.setdefault("do_sample", False)
    return target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, **kwargs)


@torch.no_grad()
def assert_clear_argmax(target, seq: torch.Tensor, prompt_len: int, min_margin: float = 1e-4) -> None:
    """Every greedy choice in `seq` (after the prompt) beats the runner-up by `min_margin` (test well-posed)."""
    if seq.shape[1] <= prompt_len:
        return
    logits = target(seq).logits[0, prompt_len - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin > min_margin, f"reference run has a near-tie (margin {margin:.2e}); pick another seed"


def check_round_stats(gen, num_proposals: int) -> None:
    """Per-round statistics are self-consistent."""
    for r in gen.rounds:
        assert 1 <= r["proposals"] <= num_proposals, r
        assert 0 <= r["accepted"] <= r["proposals"], r


def oracle_choose(reference: torch.Tensor, vocab_size: int, corrupt=None):
    """A `CarryoverCandidateGenerator._choose` replacement that proposes the true greedy continuation
    (read from `reference`), with position j of round r replaced by a wrong token when `corrupt(r, j)`."""

    def _choose(self, input_ids, logits):
        n, start = logits.shape[1], input_ids.shape[1]
        tokens = reference[:, start:start + n].clone()
        assert tokens.shape[1] == n, "oracle asked beyond the reference"
        r = len(self.rounds)
        for j in range(n):
            if corrupt is not None and corrupt(r, j):
                tokens[0, j] = (tokens[0, j] + 1) % vocab_size
        return tokens, logits

    return _choose


@pytest.fixture
def record_calls(monkeypatch):
    """Wrap `get_candidates`: returns a list of dicts (input_ids, candidate, cache_length after the call)."""
    calls = []
    original = CarryoverCandidateGenerator.get_candidates

    def wrapped(self, input_ids, *args, **kwargs):
        candidate, logits = original(self, input_ids, *args, **kwargs)
        calls.append({"input_ids": input_ids.clone(), "candidate": candidate.clone(),
                      "cache_length": self.cache.length, "first": kwargs.get("is_first_iteration", False)})
        return candidate, logits

    monkeypatch.setattr(CarryoverCandidateGenerator, "get_candidates", wrapped)
    return calls
