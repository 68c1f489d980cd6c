"""Block drafter (DFlash / Markov) with Carryover, built from Transformers' Qwen3 blocks.

Copied verbatim into saved drafter folders (remote code): it imports only `transformers`, `torch` and its
siblings `configuration_drafter` / `generation_carryover`, which `save_pretrained` copies alongside.

One forward drafts a whole block `[anchor, mask x (B-1)]` at positions p..p+B-1. Every layer attends from
the block (queries) to three kinds of keys, concatenated in this order:

    committed context | carryover rows | block
    (cached K/V of      (temporary K/V of the rejected     (bidirectional)
     accepted target     rows of the last verification,
     hidden states)      this round only)

Context and carryover rows are the target's hidden states at `target_layer_ids`, concatenated on the feature
axis and fused by `fc` + `hidden_norm` (computed once per position); carryover rows additionally get one
learned vector (`carryover_embedding`) so the drafter can tell "computed on a wrong prefix" from "committed".
Choices the papers leave open, made here:
  * the carryover marker is added after fusion, before each layer's k/v projection;
  * carryover keys keep their original RoPE positions (they overlap the new block's positions);
  * block queries see every valid carryover row (no causal restriction: the rows are all in the past of
    the verification, and the block is bidirectional anyway).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from .configuration_drafter import DrafterConfig, default_target_layer_ids, target_fingerprint
from .generation_carryover import CarryoverCandidateGenerator, install_generate_hook

install_generate_hook()
logger = logging.get_logger(__name__)


class DrafterContextCache:
    """Per-layer K/V of committed context rows (post k-norm, post RoPE), `[batch, kv_heads, n, head_dim]`.

    Only accepted positions are ever appended; rejected rows never enter it (they travel as carryover).
    `valid` marks padded prompt positions (batch 1 with a left-padded attention mask) as invisible.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid: torch.Tensor | None = None  # [batch, n] bool

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)

    def append_valid(self, valid: torch.Tensor) -> None:
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)


def put_positions(buf: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """`buf[r, :, positions[r, j]] = values[r, :, j]` in place, for a cache `[b, kv_heads, max_len, head_dim]`;
    `rows` is `arange(b)[:, None]`, `positions` `[b, n]`, `values` `[b, kv_heads, n, head_dim]`.

    Why `index_put_` and not `scatter_`: torch.compile (inductor, torch 2.13) writes an `index_put_` into its input
    in place, but makes a `scatter_` into an input a copy of the whole buffer, scattered, then copied back: two passes
    over every layer's cache for each write of a few rows (`tests/test_engine_tree.py` counts the buffers)."""
    buf.transpose(1, 2).index_put_((rows, positions), values.transpose(1, 2).to(buf.dtype))  # [b, max_len, kvh, hd]


class DrafterStaticCache:
    """Committed-context K/V of the drafter, per layer `[b, kv_heads, max_len, head_dim]`, indexed by position.

    Looks like `DrafterContextCache` to `Drafter.forward` (`keys`, `values`, `length`); the fast engine and the
    generate() path's static rounds (`StaticDraftRound`) pass a mask that shows row r only positions < its anchor, so
    stale rows written by earlier rounds (rejected rows, an earlier prompt) are never read.
    """

    def __init__(self, num_layers, batch, kv_heads, max_len, head_dim, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = max_len
        self.rows = torch.arange(batch, device=device)[:, None]  # [b, 1]: the batch index of `put_positions`

    @torch.no_grad()
    def write(self, drafter, fused: torch.Tensor, positions: torch.Tensor) -> None:
        """Project fused context rows `[b, n, d]` through every layer's k/v and store them at `positions` `[b, n]`."""
        cos, sin = drafter.rotary_emb(fused, positions)
        for i, layer in enumerate(drafter.layers):
            k, v = layer.self_attn.project_kv(fused, cos, sin)  # [b, kvh, n, hd]
            put_positions(self.keys[i], self.rows, positions, k)
            put_positions(self.values[i], self.rows, positions, v)


_FLEX = []


def _flex_attention():
    """Compiled FlexAttention, built on first use (only the GPU training path passes a BlockMask)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


class DrafterAttention(nn.Module):
    """Qwen3-style attention whose keys/values are `[external K/V pieces | own block K/V]` (KV injection).

    `kernel`: None (SDPA), or a function `(q, k_pieces, v_pieces, mask, key_bias)` that a decoding engine sets for its
    calls (`hf_carryover.engine.attention.DrafterKernel`: a kernel that reads only the keys in use of a static cache).
    It gets the grouped K/V pieces in order, block last, and the boolean mask, and returns `[b, q, heads, head_dim]`,
    or None where it does not take the inputs (SDPA then)."""

    kernel = None

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim).transpose(1, 2)  # [b, n, h*hd] -> [b, h, n, hd]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V of `x` `[b, n, d]` at the positions encoded by cos/sin: `[b, kv_heads, n, head_dim]` each."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, hidden, cos, sin, kv_pieces, attn_mask, kv_store=None, key_bias=None):
        """hidden `[b, q, d]`; kv_pieces: list of (k, v) placed before the block's own; attn_mask `[b|1, 1, q, keys]`
        bool. `kv_store(k, v) -> (k_all, v_all)` lets an external cache keep the new keys (transformers' DFlash).
        key_bias: `(bias [heads], start, n)` adds bias[h] to the attention logits of keys start..start+n-1 (the
        carryover gate); the span is a Python range, so shapes stay static for CUDA graphs."""
        q = self.q_norm(self._heads(self.q_proj(hidden), self.num_heads))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k_blk, v_blk = self.project_kv(hidden, cos, sin)
        boolean = isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool
        if self.kernel is not None and kv_store is None and boolean:
            out = self.kernel(q, [kv[0] for kv in kv_pieces] + [k_blk], [kv[1] for kv in kv_pieces] + [v_blk],
                              attn_mask, key_bias)
            if out is not None:  # [b, q, heads, hd] -> [b, q, heads * hd]
                return self.o_proj(out.flatten(2))
        k = torch.cat([kv[0] for kv in kv_pieces] + [k_blk], dim=2)
        v = torch.cat([kv[1] for kv in kv_pieces] + [v_blk], dim=2)
        if kv_store is not None:
            k, v = kv_store(k, v)
        if self.num_kv_heads != self.num_heads:  # GQA: [b, kvh, n, hd] -> [b, kvh, rep, n, hd] -> [b, h, n, hd]
            # expand + reshape, not repeat_interleave: same values, but no index tensor whose size some ATen
            # versions check with a host sync (the engine captures this forward in a CUDA graph)
            rep = self.num_heads // self.num_kv_heads
            k, v = (x[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2) for x in (k, v))
        if key_bias is not None and key_bias[2] > 0:
            bias, start, n = key_bias
            bias = bias.to(q.dtype)
            if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):  # FlexAttention: a score_mod
                def gate(score, b, h, q_idx, kv_idx):
                    return score + torch.where((kv_idx >= start) & (kv_idx < start + n), bias[h], 0.0)

                out = _flex_attention()(q, k, v, score_mod=gate, block_mask=attn_mask)
            else:  # SDPA: the boolean mask becomes an additive one, [b|1, 1, q|1, keys] -> [b|1, heads, q|1, keys]
                kv_idx = torch.arange(k.shape[2], device=q.device)
                in_span = (kv_idx >= start) & (kv_idx < start + n)
                add = torch.where(in_span, bias[:, None], torch.zeros((), dtype=q.dtype, device=q.device))
                add = add[None, :, None, :]  # [heads, keys] -> [1, heads, 1, keys]
                if attn_mask is not None:  # broadcast both: [b|1, heads, q|1, keys]
                    add = torch.where(attn_mask, add, torch.full((), float("-inf"), dtype=q.dtype, device=q.device))
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
        elif attn_mask is not None and not isinstance(attn_mask, torch.Tensor):  # FlexAttention BlockMask (training)
            out = _flex_attention()(q, k, v, block_mask=attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer: attention (block queries, injected context keys) + SwiGLU MLP."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden, cos, sin, kv_pieces, attn_mask, kv_store=None, key_bias=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_pieces, attn_mask, kv_store,
                                         key_bias)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


_NEEDS_ENGINE = "draft trees in generate() run on hf_carryover's engine: pip install hf_carryover"  # use_draft_tree


class Drafter(PreTrainedModel):
    """A block-parallel drafter for one target. Use `Drafter.from_target(target, ...)` to build one.

    The target's embedding and LM head are used but never stored: `bind_target(target)` attaches them
    (outside the module tree, so they are neither saved nor trained), after checking the fingerprint.
    """

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "block_embeds"
    _no_split_modules = ["DrafterLayer"]
    _supports_sdpa = True
    _is_carryover_drafter = True  # duck-typed marker: remote code lives under a hashed module name

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        if not config.learned_mask_embedding and config.mask_token_id is None:
            raise ValueError(
                "This drafter needs `mask_token_id` (a target vocabulary row the target never emits, e.g. an "
                "unused special token) or `learned_mask_embedding=True`."
            )
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if config.learned_mask_embedding else None
        self.carryover_embedding = nn.Parameter(torch.zeros(d)) if config.carryover else None
        gated = config.carryover and config.carryover_gate is not None
        # [layers, heads]: the carryover keys' attention-logit bias (see DrafterConfig.carryover_gate)
        self.carryover_gate = (nn.Parameter(torch.full((config.num_hidden_layers, config.num_attention_heads),
                                                       float(config.carryover_gate))) if gated else None)
        if config.drafter_type == "markov":
            self.markov_in = nn.Embedding(config.vocab_size, config.markov_rank)
            self.markov_out = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        self._target_parts: dict = {}  # plain dict: not a submodule, never saved
        self.last_candidate_generator = None
        self.draft_tree = None  # (TreeSpec, nodes per round) once use_draft_tree() is called
        self.draft_tree_compile = False  # use_draft_tree(compile=True): the engine compiles its tree round
        self.draft_tree_compile_options = {}  # use_draft_tree(compile_options=...): inductor options of that compile
        self.post_init()

    # ------------------------------------------------------------------ construction and binding
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear) and module is getattr(self, "markov_out", None):
            nn.init.zeros_(module.weight)  # start as a plain block drafter; the bigram term is learned from zero
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Qwen3RotaryEmbedding):
            # inv_freq is a non-persistent buffer: from_pretrained allocates it empty and relies on this hook to
            # recompute it (transformers' base implementation does); skipping it leaves garbage RoPE frequencies.
            super()._init_weights(module)
        elif isinstance(module, Drafter):
            if module.mask_embedding is not None:
                nn.init.normal_(module.mask_embedding, std=std)
            if module.carryover_embedding is not None:
                nn.init.zeros_(module.carryover_embedding)
            if module.carryover_gate is not None:
                nn.init.constant_(module.carryover_gate, float(module.config.carryover_gate))

    @classmethod
    def from_target(cls, target, drafter_type: str = "dflash", carryover: bool = False, **overrides):
        """A randomly initialised drafter sized for `target` (hidden size, heads, RoPE base, vocabulary)."""
        tc = target.config.get_text_config()
        fp = target_fingerprint(target.config)
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        num_features = overrides.pop("num_target_features", 5)
        kwargs = dict(
            drafter_type=drafter_type,
            carryover=carryover,
            vocab_size=fp["vocab_size"],
            hidden_size=fp["hidden_size"],
            intermediate_size=getattr(tc, "intermediate_size", 4 * fp["hidden_size"]),
            num_attention_heads=fp["num_attention_heads"],
            num_key_value_heads=fp["num_key_value_heads"],
            head_dim=fp["head_dim"],
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            num_target_layers=fp["num_hidden_layers"],
            target_layer_ids=default_target_layer_ids(fp["num_hidden_layers"], num_features),
            target_fingerprint=fp,
        )
        kwargs.update(overrides)
        if kwargs.get("mask_token_id") is None and not kwargs.get("learned_mask_embedding"):
            logger.warning("No mask_token_id given: using a learned mask embedding (DFlash serving formats, and "
                           "transformers' own DFlash loop, need a target row instead).")
            kwargs["learned_mask_embedding"] = True
        bad = [i for i in kwargs["target_layer_ids"] if not 0 <= i < fp["num_hidden_layers"] - 1]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a {fp['num_hidden_layers']}-layer target "
                             "(the last layer is post-norm in HF and cannot be tapped).")
        drafter = cls(DrafterConfig(**kwargs))
        drafter.to(dtype=next(target.parameters()).dtype)
        drafter.bind_target(target)
        return drafter

    def bind_target(self, target) -> None:
        """Attach `target`'s frozen embedding and LM head after checking that it is the target we belong to."""
        # id() alone is not enough: a freed target's id can be reused by the next one, and a target's embedding
        # or head can be replaced. The parts we hold stay alive, so their identity is a safe check.
        parts = self._target_parts
        if (parts.get("target_id") == id(target) and parts.get("embed") is target.get_input_embeddings()
                and parts.get("lm_head") is target.get_output_embeddings()):
            return
        fp = target_fingerprint(target.config)
        expected = self.config.target_fingerprint
        if expected is not None and fp != expected:
            diff = {k: (expected.get(k), fp.get(k)) for k in set(fp) | set(expected) if fp.get(k) != expected.get(k)}
            raise ValueError(
                f"This drafter was built for a target with fingerprint {expected}, but it is being bound to "
                f"{type(target).__name__} with fingerprint {fp} (differs in {diff})."
            )
        if fp["vocab_size"] != self.config.vocab_size:
            raise ValueError(f"Vocabulary mismatch: drafter vocab_size={self.config.vocab_size}, "
                             f"target vocab_size={fp['vocab_size']}.")
        self._target_parts = {
            "target_id": id(target),
            "embed": target.get_input_embeddings(),
            "lm_head": target.get_output_embeddings(),
        }

    def _require_target(self) -> dict:
        if not self._target_parts:
            raise RuntimeError("Drafter is not bound to a target: call `drafter.bind_target(target)` first "
                               "(generate() does this for you).")
        return self._target_parts

    # ------------------------------------------------------------------ pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features `[b, n, L*d_t]` -> drafter context rows `[b, n, d]`."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def target_features(self, hidden_states, rows: slice | None = None) -> torch.Tensor:
        """Concatenate the tapped layers of an HF `hidden_states` tuple (layer i is entry i+1) on the feature axis."""
        rows = rows if rows is not None else slice(None)
        return torch.cat([hidden_states[i + 1][:, rows] for i in self.config.target_layer_ids], dim=-1)

    def embed_block(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor ids `[b, n]` -> block input embeddings `[b, n*B, d]` (anchor row, then B-1 mask rows)."""
        embed = self._require_target()["embed"]
        b, n = anchor_ids.shape
        B, dtype = self.config.block_size, self.fc.weight.dtype
        anchor = embed(anchor_ids).to(dtype)  # [b, n, d]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(dtype).expand(b, n, B - 1, -1)
        else:
            mask_ids = torch.full((b, n, B - 1), self.config.mask_token_id, device=anchor_ids.device)
            mask = embed(mask_ids).to(dtype)
        block = torch.cat([anchor[:, :, None], mask], dim=2)  # [b, n, B, d]
        return block.reshape(b, n * B, -1)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head on drafter hidden states (the drafter has no head of its own)."""
        head = self._require_target()["lm_head"]
        return head(hidden.to(head.weight.dtype))

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Rank-r bigram correction `W2(W1[x_prev])` for each previous token: `[...] -> [..., V]`."""
        return self.markov_out(self.markov_in(prev_ids))

    def propose(self, logits: torch.Tensor, prev: torch.Tensor, pick):
        """Choose proposals left to right from per-row logits `[..., P, V]` (float), `prev` = anchor tokens `[...]`.

        Markov rows first get `W2(W1[previous token])`, which is why the choice is sequential. `pick(row)` returns
        `(row_used, token)`: greedy, sampling, logits processors — each caller's rule. Returns the tokens
        `[..., P]` and the rows they were chosen from `[..., P, V]` (the draft distribution verification needs).
        """
        rows, tokens = [], []
        for j in range(logits.shape[-2]):
            row = logits[..., j, :]
            if self.config.drafter_type == "markov":
                row = row + self.markov_bias(prev.to(self.fc.weight.device)).float().to(row.device)
            row, prev = pick(row)
            rows.append(row)
            tokens.append(prev)
        return torch.stack(tokens, -1), torch.stack(rows, -2)

    def proposal_rows(self) -> slice:
        """Block rows whose outputs are proposals: 1..B-1 for DFlash, 0..B-1 for Markov."""
        return slice(1, None) if self.config.drafter_type == "dflash" else slice(0, None)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        block_embeds: torch.Tensor | None = None,
        block_positions: torch.Tensor | None = None,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: DrafterContextCache | None = None,
        carryover_features: torch.Tensor | None = None,
        carryover_positions: torch.Tensor | None = None,
        attn_mask=None,
        **hf_dflash_inputs,
    ) -> torch.Tensor:
        """Drafter hidden states (after the final norm) for the block rows, `[b, q, d]`.

        block_embeds `[b, q, d]` at block_positions `[b, q]`. Keys, in this order:
          * `cache`: K/V of committed rows projected earlier (inference);
          * `context_features` `[b, n, L*d_t]` (raw target features, fused here) at context_positions — the
            training path passes every position of the sequence and masks per anchor;
          * `carryover_features` `[b, m, L*d_t]` (raw, fused here, marker added) at carryover_positions;
          * the block itself.
        attn_mask: boolean `[b|1, 1, q, keys]` (or a FlexAttention BlockMask); None = all visible.
        """
        if "noise_embeds" in hf_dflash_inputs:
            return self._transformers_dflash_forward(cache=cache, **hf_dflash_inputs)
        hidden = block_embeds
        cos, sin = self.rotary_emb(hidden, block_positions)
        context = ctx_cs = carry = co_cs = None
        if context_features is not None:
            context = self.fuse(context_features)
            ctx_cs = self.rotary_emb(hidden, context_positions)
        if carryover_features is not None and carryover_features.shape[1] > 0:
            if self.carryover_embedding is None:
                raise ValueError("carryover_features given to a drafter built with carryover=False.")
            carry = self.fuse(carryover_features) + self.carryover_embedding.to(hidden.dtype)
            co_cs = self.rotary_emb(hidden, carryover_positions)
        for i, layer in enumerate(self.layers):
            pieces = []
            if cache is not None and cache.length > 0:
                pieces.append((cache.keys[i], cache.values[i]))
            if context is not None:
                pieces.append(layer.self_attn.project_kv(context, *ctx_cs))
            key_bias = None
            if carry is not None:
                if self.carryover_gate is not None:  # the carryover keys follow the cache and context keys
                    key_bias = (self.carryover_gate[i], sum(kv[0].shape[2] for kv in pieces), carry.shape[1])
                pieces.append(layer.self_attn.project_kv(carry, *co_cs))
            hidden = layer(hidden, cos, sin, pieces, attn_mask, key_bias=key_bias)
        return self.norm(hidden)

    def _transformers_dflash_forward(self, noise_embeds, context_hidden_states, position_ids, cache=None,
                                     attention_mask=None, past_key_values=None, **unused):
        """transformers' own DFlash loop (`generate(..., speculation_type="dflash")`, >= 5.15) calls the drafter
        with the new accepted rows' raw features, the embedded block and a `DFlashCache` that must receive both
        the context and the block K/V (it crops the block next round). Same computation as our path, minus
        Carryover; transformers reads proposals from block rows 1.., so only DFlash drafters qualify."""
        from transformers.modeling_outputs import BaseModelOutput

        if self.config.drafter_type != "dflash":
            raise ValueError("transformers' DFlash path reads proposals from block rows 1..B-1: it can drive a "
                             "'dflash' drafter only, not a 'markov' one.")
        if self.config.mask_token_id is None:
            raise ValueError("transformers' DFlash path embeds the mask with the target's row `mask_token_id`; this "
                             "drafter uses a learned mask embedding instead.")
        cache = cache if cache is not None else past_key_values  # the keyword was renamed in transformers 5.24
        n_ctx = context_hidden_states.shape[1]
        hidden = noise_embeds.to(self.fc.weight.dtype)
        context = self.fuse(context_hidden_states)
        ctx_cs = self.rotary_emb(hidden, position_ids[:, :n_ctx])
        cos, sin = self.rotary_emb(hidden, position_ids[:, n_ctx:])
        for i, layer in enumerate(self.layers):
            pieces = [layer.self_attn.project_kv(context, *ctx_cs)]
            hidden = layer(hidden, cos, sin, pieces, None, kv_store=lambda k, v, i=i: cache.update(k, v, i))
        return BaseModelOutput(last_hidden_state=self.norm(hidden))

    @torch.no_grad()
    def append_context(self, cache: DrafterContextCache, context: torch.Tensor, positions: torch.Tensor,
                       valid: torch.Tensor | None = None) -> None:
        """Project fused committed rows `[b, n, d]` through every layer's k/v and append them to `cache`."""
        cos, sin = self.rotary_emb(context, positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(context, cos, sin)
            cache.append(i, k, v)
        if valid is None:
            valid = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)
        cache.append_valid(valid)

    @torch.no_grad()
    def draft_hidden(self, anchor_id: torch.Tensor, anchor_position: int, cache: DrafterContextCache,
                     carryover_features: torch.Tensor | None = None, carryover_positions: torch.Tensor | None = None):
        """Inference: hidden states `[b, B, d]` of one block anchored at `anchor_id` `[b, 1]`.

        carryover_features: raw target features `[b, m, L*d_t]` of last round's rejected rows."""
        B = self.config.block_size
        device = anchor_id.device
        block = self.embed_block(anchor_id)
        positions = torch.arange(anchor_position, anchor_position + B, device=device)[None].expand(block.shape[0], -1)
        n_carry = 0 if carryover_features is None else carryover_features.shape[1]
        visible = [cache.valid] if cache.length > 0 else []
        visible.append(torch.ones(block.shape[0], n_carry + B, dtype=torch.bool, device=device))
        attn_mask = torch.cat(visible, dim=1)[:, None, None, :]  # [b, 1, 1, keys]: every block row sees all keys
        return self(block, positions, cache=cache, carryover_features=carryover_features,
                    carryover_positions=carryover_positions, attn_mask=attn_mask)

    def use_draft_tree(self, tree="auto", nodes: int | None = 63, compile: bool = False,
                       compile_options: dict | None = None):
        """Have greedy `generate(assistant_model=self)` calls verify a draft tree each round instead of the block.

        A DFlash drafter drafts every block position from one forward, so its second- and third-ranked tokens cost
        nothing; a tree of them covers where the top-1 chain breaks, and one target forward verifies it (τ 2.2 ->
        3.9 with context lookup on the reference target, examples/results/h200-2026-12-01f). tree: "auto" (the
        `draft_tree.json` shipped beside these weights), a file, a list of rank paths, a `TreeSpec`, or None (off).
        nodes: per round, the N nodes of that tree the drafter finds likeliest (None: the whole tree). Runs on
        hf_carryover's engine (the package must be installed), which also takes left-padded batches (rows advance
        independently); calls it cannot serve (sampling, right padding, logits processors, a streamer, dict outputs)
        verify linear blocks, with a warning that says why. compile=True: the engine runs its tree round through
        `torch.compile` (fused kernels), at the cost of a compile (about a minute on the H200) on the first call of
        each batch shape. On the H200 (examples/results/h200-2026-12-01h, 10 prompts, batch 1) compiled `generate()`
        with a 31-node tree + lookup ran at 1082.8 tok/s on MT-Bench (2.03x the engine's plain decoding) and 928.2
        on HumanEval; uncompiled, a 63-node tree ran at 506 (12-01g, 4 prompts). Compiled kernels may round
        differently at near-ties (bf16). compile_options (with compile=True): inductor options for that compile, as
        the engine takes them, e.g. {"freezing": True} (weights compiled in, q/k/v merged by the engine's pass: a
        tree round 9 % cheaper on the H200, examples/results/h200-2026-12-02e); frozen rounds keep the weights they
        were compiled with, so call use_draft_tree again after changing the target's or the drafter's weights (a new
        call builds a new engine)."""
        if compile_options and not compile:
            raise ValueError(f"use_draft_tree(compile_options={compile_options}) sets options of the compiled tree "
                             "round: it needs compile=True.")
        if compile_options:  # a misspelt option fails here, not in the first generate() call's compile
            try:
                from hf_carryover.engine.engine import check_inductor_options
            except ImportError as e:
                raise ImportError(_NEEDS_ENGINE) from e
            check_inductor_options(compile_options)
        if tree is None:
            self.draft_tree = None
            return self
        try:
            from hf_carryover.engine.tree import TreeSpec, fit_tree
        except ImportError as e:
            raise ImportError(_NEEDS_ENGINE) from e
        from .generation_carryover import tree_hook_installed

        if not tree_hook_installed():
            raise RuntimeError("draft trees need the class-level generate hook (HF_CARRYOVER_NO_HOOK=1 is set): "
                               "call hf_carryover.install_generate_hook(force=True) first.")
        if isinstance(tree, str) and tree == "auto":
            tree = TreeSpec.from_pretrained(self.name_or_path)
        elif isinstance(tree, (str, os.PathLike)):
            tree = TreeSpec.load(tree)
        tree = fit_tree(tree, self, nodes)  # the engine's own checks: DFlash, depth within the block, nodes
        self.draft_tree = (tree, None if nodes is None else int(nodes))
        self.draft_tree_compile = bool(compile)
        self.draft_tree_compile_options = dict(compile_options or {})
        if self.draft_tree_compile_options:  # options such as freezing bake in weights: the next call starts afresh
            self.__dict__.pop("_hf_carryover_tree_engine", None)
        return self

    def make_candidate_generator(self, target, generation_config, logits_processor, model_kwargs, input_ids=None):
        """Hook entry point used by `generate()` (dispatched on this method, not on the class)."""
        self.bind_target(target)
        gen = CarryoverCandidateGenerator(self, target, generation_config, logits_processor, model_kwargs, input_ids,
                                          record_carryover=getattr(self, "record_carryover", False))
        self.last_candidate_generator = gen
        return gen


__all__ = ["Drafter", "DrafterContextCache", "DrafterStaticCache"]
