"""Draft trees through `target.generate(assistant_model=drafter)`.

Transformers' assisted decoding verifies one linear block a round: a candidate generator can only hand it a sequence.
A draft tree (`tree.py`) needs its own verify forward (ancestor mask, depth positions, a K/V move after acceptance),
so once `drafter.use_draft_tree(...)` is set, the generate hook (`generation_carryover.py`) hands greedy calls to
`tree_generate` here, which runs the engine's tree rounds for the prompt (or a left-padded batch of prompts, rows
advancing independently) and returns what generate() returns.

Why through the engine rather than a second loop on transformers' cache: the engine's tree rounds are the tested
ones (exact against plain greedy decoding on CPU and, compiled and captured, on the H200), and a copy of that logic
on `DynamicCache` would be a second implementation to keep exact. The price: a call that transformers' loop would
treat specially (sampling, logits processors, a streamer, dict outputs, right padding, stop strings) is not a tree
call; `tree_blockers` names what stands in the way and the hook falls back to linear blocks with a warning.
"""

from __future__ import annotations

import torch

# stopping criteria the engine implements itself (max_new_tokens / max_length and EOS)
_ENGINE_STOPS = ("MaxLengthCriteria", "EosTokenCriteria")
_ENGINE_LEN_STEP = 256  # engines are kept per drafter and reused while a call fits; lengths grow in these steps


class TreeRounds:
    """What a tree call leaves in `drafter.last_candidate_generator`, shaped like the linear generator's record:
    `rounds` (one dict per verification: `accepted` = tokens emitted minus one), `tau`, `lookup_tokens`, and `mode`
    (the engine's: "eager", "cuda_graph", ...)."""

    static = None  # no StaticDraftRound: the engine runs the drafter

    def __init__(self, accepted, looked, lookup_tokens, tree_nodes, mode):
        """accepted / looked: per row of the batch, per round (the engine's `rounds` / `lookup_rounds`). `rounds` is
        every row's rounds in row order (τ per verification of one row, as for batch 1); `row_rounds` per row."""
        self.row_rounds = [[{"proposals": tree_nodes, "accepted": int(a), **({"source": "lookup"} if lk else {})}
                            for a, lk in zip(acc, lks)] for acc, lks in zip(accepted, looked)]
        self.rounds = [r for row in self.row_rounds for r in row]
        self.lookup_tokens = lookup_tokens
        self.tree_nodes = tree_nodes
        self.mode = mode

    @property
    def tau(self) -> float:
        return sum(r["accepted"] + 1 for r in self.rounds) / len(self.rounds) if self.rounds else float("nan")


def tree_blockers(drafter, input_ids, generation_config, logits_processor=None, stopping_criteria=None,
                  streamer=None, synced_gpus=False, attention_mask=None) -> list[str]:
    """Why this generate() call cannot run tree rounds (empty: it can)."""
    why = []
    if generation_config.do_sample:
        why.append("sampling (draft trees through generate() are greedy; SpeculativeEngine samples them)")
    if attention_mask is not None and not bool((attention_mask.long().cummax(1).values == attention_mask).all()):
        why.append("padding after a prompt's first token (left padding only)")
    elif attention_mask is not None and not bool(attention_mask.any(1).all()):
        why.append("a row without prompt tokens")
    if logits_processor is not None and len(logits_processor):
        why.append("logits processors (" + ", ".join(type(p).__name__ for p in logits_processor) + ")")
    stops = [type(s).__name__ for s in (stopping_criteria or []) if type(s).__name__ not in _ENGINE_STOPS]
    if stops:
        why.append("stopping criteria (" + ", ".join(stops) + ")")
    if streamer is not None:
        why.append("a streamer")
    if synced_gpus:
        why.append("synced_gpus")
    if generation_config.return_dict_in_generate:
        why.append("return_dict_in_generate")
    n = getattr(generation_config, "num_assistant_tokens", None)  # transformers' default (20) exceeds any block
    if n is not None and int(n) < drafter.config.num_proposals:
        why.append(f"num_assistant_tokens={n}, shorter than the block (the tree sets the depth)")
    return why


def _engine_for(target, drafter, need: int):
    """The drafter's engine for this target, rebuilt only when the target changes or a call needs longer caches.
    CUDA graphs on CUDA (each shape captured once, then replayed by every later call); eager elsewhere; its tree
    round compiled after `use_draft_tree(compile=True)` (on CPU too), with its `compile_options`."""
    from .engine import SpeculativeEngine

    p = next(target.parameters())
    comp = bool(getattr(drafter, "draft_tree_compile", False))  # use_draft_tree(compile=True)
    opts = dict(getattr(drafter, "draft_tree_compile_options", None) or {})  # use_draft_tree(compile_options=...)
    # moved or cast models need new buffers; other compile settings a new compile
    where = (p.device, p.dtype, next(drafter.parameters()).device, comp, repr(sorted(opts.items())))
    eng = drafter.__dict__.get("_hf_carryover_tree_engine")
    if eng is None or eng.target is not target or eng.max_len < need or eng._hf_where != where:
        length = -(-need // _ENGINE_LEN_STEP) * _ENGINE_LEN_STEP
        eng = SpeculativeEngine(target, drafter, max_len=length, cuda_graphs=p.is_cuda, compile=comp,
                                compile_options=opts or None)
        eng._hf_where = where
        drafter.__dict__["_hf_carryover_tree_engine"] = eng  # not a submodule: never saved, never moved
    return eng


@torch.no_grad()
def tree_generate(target, drafter, input_ids: torch.Tensor, generation_config, attention_mask=None) -> torch.LongTensor:
    """Prompts `[b, n]` (left-padded where `attention_mask` has zeros) -> `[b, n + new]`, each row the target's greedy
    continuation of its own unpadded prompt, verified as draft trees; rows advance independently (the engine's
    batch), which transformers' assisted decoding, batch 1 only, cannot do.

    Stops where generate() would: `generation_config.max_length` and its EOS ids; a row that ends first is filled
    with `pad_token_id` (EOS where there is none), as generate() fills it. Context lookup follows
    `prompt_lookup_num_tokens` as in the linear path (looked-up tokens go on the tree's rank-0 chain)."""
    tree, nodes = drafter.draft_tree
    n = input_ids.shape[1]
    max_new = int(generation_config.max_length) - n
    if max_new <= 0:
        return input_ids
    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    prompts = [row[m].tolist() for row, m in zip(input_ids, keep)]  # left padding removed
    lookup = getattr(generation_config, "prompt_lookup_num_tokens", None)
    k = drafter.config.num_proposals
    eng = _engine_for(target, drafter, n + max_new + 2 * k + (nodes or tree.num_nodes) + 2)
    eos = generation_config.eos_token_id
    new = eng.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, prompt_lookup_num_tokens=lookup, tree=tree,
                       tree_nodes=nodes)
    drafter.last_candidate_generator = TreeRounds(eng.rounds, eng.lookup_rounds, lookup, nodes or tree.num_nodes,
                                                  eng.last_mode)
    width = max(len(t) for t in new)
    pad = generation_config.pad_token_id
    if pad is None:
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0  # rows all full if no EOS
    out = torch.full((len(new), width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for r, t in enumerate(new):
        out[r, : len(t)] = torch.tensor(t, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1)
