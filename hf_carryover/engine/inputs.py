"""What `SpeculativeEngine.generate` accepts as prompts and sampling settings, checked before anything is allocated.

Why a module of its own: bad input used to surface deep inside a round as an error that named nothing the caller
wrote (an empty prompt as a failed reshape in the attention, an id outside the vocabulary as an embedding
`IndexError`, `temperature=0` with sampling as an index error in the inverse CDF, a `[b, L]` tensor of prompts as an
ambiguous truth value). Each check here names the argument, the prompt and the value.
"""

from __future__ import annotations

from collections.abc import Sequence


def _is_array(x) -> bool:
    """A torch tensor or a NumPy array (both have `ndim` and `tolist`)."""
    return hasattr(x, "ndim") and hasattr(x, "tolist") and not isinstance(x, (list, tuple))


def prompt_lists(prompts, vocab_size: int) -> list[list[int]]:
    """`prompts` as a list of token-id lists, or a ValueError that says what is wrong with which prompt.

    Accepted: a list (or tuple) of token-id sequences (lists, tuples, 1-D tensors or arrays), or a 2-D tensor or
    array whose rows are prompts of one length (as `tokenizer(..., return_tensors="pt").input_ids` gives without
    padding). Refused: a single flat prompt (a list of ints or a 1-D tensor: wrap it as `[ids]`, since a flat list
    is ambiguous with a list of one-token prompts), an empty prompt, and ids outside [0, vocab_size)."""
    if _is_array(prompts):
        if prompts.ndim != 2:
            raise ValueError(f"prompts: a tensor of prompts is [batch, length], got shape {tuple(prompts.shape)} "
                             "(one prompt: prompts=[ids] or ids[None]).")
        prompts = prompts.tolist()
    elif not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise ValueError("prompts: a list of token-id lists or a [batch, length] tensor, got "
                         f"{type(prompts).__name__}.")
    if len(prompts) == 0:
        raise ValueError("generate() needs at least one prompt.")
    out = []
    for i, p in enumerate(prompts):
        if _is_array(p):
            if p.ndim != 1:
                raise ValueError(f"prompts[{i}]: a 1-D sequence of token ids, got a tensor of shape {tuple(p.shape)}.")
            p = p.tolist()
        elif isinstance(p, (int, bool)) or not isinstance(p, Sequence):
            raise ValueError(f"prompts[{i}] is {type(p).__name__}, not a sequence of token ids: prompts is a list of "
                             "prompts (one prompt: prompts=[ids]).")
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token (e.g. BOS).")
        ids = [int(x) for x in p]
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]}, outside the target's vocabulary of {vocab_size} "
                             "(a tokenizer of another model?).")
        out.append(ids)
    return out


def check_decoding(max_new_tokens, do_sample: bool, temperature) -> None:
    """The length and sampling arguments, refused by name: at least one new token, and a positive temperature when
    sampling (greedy decoding is `do_sample=False`; the temperature is then unused)."""
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: at least 1.")
    if do_sample and not float(temperature) > 0.0:
        raise ValueError(f"temperature={temperature} with do_sample=True: sampling needs a temperature above 0 "
                         "(for greedy decoding pass do_sample=False).")
