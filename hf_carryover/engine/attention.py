"""The target's attention while the engine decodes: SDPA with grouped-query heads left to the kernel.

Why: the engine hands the target a boolean 4D mask over its whole static cache every round. With a mask,
transformers' "sdpa" attention repeats the K/V heads to the query heads (`repeat_kv`: on CUDA, masked GQA inside
SDPA used to fall back to the math kernel), so every layer reads its whole cache and writes it out repeated before
the attention kernel reads it again. At the reference target's shapes (9 query heads, 3 K/V heads, ~640 cached keys)
one layer's attention took 6.5 instead of 9.6 us for one query row and 14.1 instead of 18.1 us for 47 (a tree round)
when SDPA got the grouped heads itself (`trainer/gpu_attention_bench.py`, H200, `h200-2026-12-02f`). In the compiled
engine inductor had already fused the repeat into a neighbouring kernel, so the round gained less: a plain step
1.051 -> 1.033 ms, a tree 31 + lookup round 1.802 -> 1.738 ms (`examples/profile_engine.py`, 12-02e against 12-02f).

So `engine_attention(target)` switches a target that uses "sdpa" (or "eager", which would misread the boolean
mask) to `ATTENTION` for the duration of a decoding call and restores it afterwards (the caller's model is left as
it was found, as with its train/eval modes). The function computes the same attention, softmax(q k^T * scaling +
mask) v over the same keys, per query head with its group's K/V head. Calls it does not handle in the same way (no
mask, no grouped heads, or extra arguments that change the result: `softcap`, `position_bias`, attention sinks) go
to transformers' own SDPA function unchanged. Implementations that cannot take a 4D mask (flash, flex, paged) are
refused by name (`check_attention`).

`SpeculativeEngine(attention="triton")` switches to `TRITON_ATTENTION` instead: the same attention through
`triton_attention.masked_gqa_attention`, a kernel that reads only the keys some query row sees (the cache is
`max_len` slots; the committed context is usually far shorter). Inputs that kernel does not take go to
`gqa_sdpa_attention`, as above.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .triton_attention import check_inputs, masked_gqa_attention

ATTENTION = "carryover_sdpa_gqa"
TRITON_ATTENTION = "carryover_triton_gqa"
# the Triton kernel's settings during a decoding call (`engine_attention`); torch.compile guards on them
TRITON_SETTINGS = {"mode": "dense", "block_n": 128, "num_warps": 4, "split_n": 256, "block_m": 16, "min_rows": 1}
# the keyword argument (through the target's forward, which hands its extra keywords to every attention call) that
# carries each batch row's end of the keys in use to the kernel (`masked_gqa_attention(key_end=...)`)
KEY_END = "carryover_key_end"
# keyword arguments that change what attention computes; a call carrying any of them is left to transformers
_NOT_HANDLED = ("softcap", "position_bias", "s_aux", "sinks")


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """query `[b, heads, q, d]`, key/value `[b, kv_heads, L, d]`, mask `[b, 1, q, L]` (bool or additive) ->
    (`[b, q, heads, d]`, None), as transformers' attention functions return it."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or any(kwargs.get(k) is not None for k in _NOT_HANDLED):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [b, heads, q, d]
    return out.transpose(1, 2).contiguous(), None


def triton_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """`gqa_sdpa_attention`'s contract through the Triton kernel (`TRITON_SETTINGS`); what the kernel does not take
    (no or non-boolean mask, dropout, `softcap`, odd head dims, ...) goes to `gqa_sdpa_attention`, and so do calls
    with fewer query rows than `min_rows` (the engine's "auto" keeps one-row steps on SDPA, `SpeculativeEngine`).
    A `KEY_END` keyword (`[b]`, the engine's `attention_key_end`) is the kernel's `key_end`; SDPA ignores it."""
    st = TRITON_SETTINGS
    if (query.shape[2] < st["min_rows"] or dropout or any(kwargs.get(k) is not None for k in _NOT_HANDLED)
            or check_inputs(query, key, value, attention_mask, st["mode"], st["block_n"]) is not None):
        return gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return masked_gqa_attention(query, key, value, attention_mask, scale, st["mode"], st["block_n"],
                                st["num_warps"], st["split_n"], block_m=st.get("block_m", 0),
                                key_end=kwargs.get(KEY_END)), None


for _name, _fn in ((ATTENTION, gqa_sdpa_attention), (TRITON_ATTENTION, triton_gqa_attention)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, sdpa_mask)  # masks built by transformers (none in engine rounds) as sdpa's


class DrafterKernel:
    """The drafter's attention in engine rounds through `masked_gqa_attention` (each drafter layer's `self_attn.kernel`
    while the engine decodes, `use_drafter_kernel`; `SpeculativeEngine(drafter_attention=...)`).

    Why: a round's drafter keys are its static cache (`max_len` slots, a few hundred of them committed context), the
    carryover rows and the block, and SDPA reads all of them, the carryover gate folded into an additive mask: on the
    H200 its three calls (cuDNN, 22.7 us each) took 0.068 of a 1.58 ms tree round (`examples/profile_engine.py`,
    `h200-2026-12-03d`). The kernel reads only the keys up to the last one in use, so the cache goes last: the pieces
    are rotated (attention does not depend on the order of its keys; the mask and the gate's span move with them) and
    the last key in use is the end of the committed context. The gate is the kernel's key bias. Returns None (SDPA
    then) for inputs the kernel does not take.

    Measured on the H200 (bf16, HumanEval, tree 31 + lookup 15, one pass of 20 prompts): 2009.5 tok/s against
    2024.2 on SDPA (`h200-2026-12-03e`), so it is opt-in. Not yet known why: the rounds still concatenate the whole
    cache with the carry and block keys (as SDPA's path does), and the kernel's scan reads the mask of all of it."""

    def __init__(self, settings: dict):
        self.settings = settings  # the engine's kernel settings (mode, block_n, num_warps, split_n, block_m)

    def __call__(self, q, k_pieces, v_pieces, mask, key_bias):
        st = self.settings
        if check_inputs(q, k_pieces[0], v_pieces[0], mask, st["mode"], st["block_n"]) is not None:
            return None
        # the first piece (the engine's static cache) goes last; any order of keys gives the same attention
        first = k_pieces[0].shape[2] if len(k_pieces) > 1 else 0
        k = torch.cat(k_pieces[1:] + k_pieces[:1], 2)  # [b, kv_heads, keys, head_dim]
        v = torch.cat(v_pieces[1:] + v_pieces[:1], 2)
        mask = torch.cat([mask[..., first:], mask[..., :first]], -1)  # [b|1, 1, q|1, keys], rotated as the keys
        bias, lo, hi = None, 0, 0
        if key_bias is not None and key_bias[2] > 0:  # a span inside one piece: (start - first) mod keys
            bias, start, n = key_bias
            lo = start - first if start >= first else start + k.shape[2] - first
            hi = lo + n
        return masked_gqa_attention(q, k, v, mask, q.shape[-1] ** -0.5, st["mode"], st["block_n"], st["num_warps"],
                                    st["split_n"], bias, lo, hi, block_m=st.get("block_m", 0))


def drafter_kernel(drafter, how: str, attention: str, settings: dict) -> DrafterKernel | None:
    """The engine's `DrafterKernel` for `drafter_attention=how` ("sdpa": None), checked: the kernel needs the target
    on it too (`attention`, as resolved) and a drafter whose code has the `kernel` hook. "auto" takes the kernel
    where both hold and SDPA otherwise (an fp32 or CPU engine, remote code older than the hook)."""
    if how not in ("auto", "sdpa", "triton"):
        raise ValueError(f"drafter_attention={how!r}: 'auto', 'sdpa' or 'triton'.")
    if how == "sdpa" or drafter is None:
        return None
    hooked = any(hasattr(m, "kernel") for m in drafter.modules())
    if how == "auto":
        return DrafterKernel(settings) if attention == "triton" and hooked else None
    if attention != "triton":
        raise ValueError("drafter_attention='triton' needs attention='triton' (or 'auto' taking it): "
                         f"this engine's attention is {attention!r}")
    if not hooked:
        raise ValueError("drafter_attention='triton': this drafter's code has no attention `kernel` hook (remote "
                         "code older than hf_carryover's modeling_drafter.py); load it with this package's code")
    return DrafterKernel(settings)


@contextmanager
def use_drafter_kernel(drafter, kernel):
    """Run the body with every attention layer of `drafter` on `kernel` (a `DrafterKernel`), then put back what they
    had, also after an error. None (SDPA, the default) leaves the layers alone: an engine that sets a kernel restores
    them after its call, so outside one they are on SDPA, and a call pays no scan of the drafter's modules."""
    if kernel is None or drafter is None:
        yield
        return
    layers = [m for m in drafter.modules() if hasattr(m, "kernel")]
    before = [m.__dict__.get("kernel") for m in layers]
    for m in layers:
        m.kernel = kernel
    try:
        yield
    finally:
        for m, k in zip(layers, before):
            if k is None:
                m.__dict__.pop("kernel", None)  # the class default (None) again
            else:
                m.kernel = k


# implementations that cannot take the engine's 4D boolean mask over a static cache
_REFUSED = ("flash_attention", "flex_attention", "paged")


def check_attention(target) -> str:
    """The target's attention implementation, refused by name if the engine cannot decode with it."""
    impl = target.config.get_text_config()._attn_implementation or "sdpa"
    if any(impl.startswith(r) or impl.startswith("kernels-community/") for r in _REFUSED):
        raise ValueError(f"the fast engine cannot run a target with attn_implementation={impl!r}: its rounds pass a "
                         "4D boolean mask over a static cache, which that implementation does not take; load the "
                         "target with attn_implementation='sdpa' (or 'eager'), or call model.set_attn_implementation"
                         "('sdpa')")
    return impl


@contextmanager
def engine_attention(target, name: str = ATTENTION, triton_settings: dict | None = None):
    """Run the body with `target`'s language model on `name` (`ATTENTION`, or `TRITON_ATTENTION` with
    `triton_settings`) if it uses "sdpa" or "eager", then put its
    implementation back, also after an error. "eager" is switched too: it adds the mask to the scores, so a boolean
    mask would add 0/1 instead of masking (the engine needs neither its attention weights nor its kernels). Only the
    text config is switched: its attention modules are the ones the engine's rounds run."""
    config = target.config.get_text_config()
    before = config._attn_implementation  # restored as it was (None included)
    if check_attention(target) not in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = name
    saved = dict(TRITON_SETTINGS)
    TRITON_SETTINGS.update(triton_settings or {})
    try:
        yield
    finally:
        config._attn_implementation = before
        TRITON_SETTINGS.clear()
        TRITON_SETTINGS.update(saved)


__all__ = ["ATTENTION", "KEY_END", "TRITON_ATTENTION", "TRITON_SETTINGS", "DrafterKernel", "check_attention",
           "drafter_kernel", "engine_attention", "gqa_sdpa_attention", "triton_gqa_attention", "use_drafter_kernel"]
