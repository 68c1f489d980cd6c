"""Draft trees through `target.generate(assistant_model=drafter)`.

Transformers' assisted decoding verifies one linear block a round: a candidate generator can only hand it a sequence.
A draft tree (`tree.py`) needs its own verify forward (ancestor mask, depth positions, a K/V move after acceptance),
so once `drafter.use_draft_tree(...)` is set, the generate hook (`generation_carryover.py`) hands greedy calls to
`tree_generate` here, which runs the engine's tree rounds for the one prompt and returns what generate() returns.

Why through the engine rather than a second loop on transformers' cache: the engine's tree rounds are the tested
ones (exact against plain greedy decoding on CPU and, compiled and captured, on the H200), and a copy of that logic
on `DynamicCache` would be a second implementation to keep exact. The price: a call that transformers' loop would
treat specially (sampling, logits processors, a streamer, dict outputs, padding, stop strings) is not a tree call;
`tree_blockers` names what stands in the way and the hook falls back to linear blocks with one warning.
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
        self.rounds = [{"proposals": tree_nodes, "accepted": int(a), **({"source": "lookup"} if lk else {})}
                       for a, lk in zip(accepted, looked)]
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
        why.append("sampling (draft trees are greedy only)")
    if input_ids.shape[0] != 1:
        why.append(f"a batch of {input_ids.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.all()):
        why.append("padding in attention_mask")
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
    CUDA graphs on CUDA (each shape captured once, then replayed by every later call); eager elsewhere."""
    from .engine import SpeculativeEngine

    p = next(target.parameters())
    where = (p.device, p.dtype, next(drafter.parameters()).device)  # a moved or cast model needs new buffers
    eng = drafter.__dict__.get("_hf_carryover_tree_engine")
    if eng is None or eng.target is not target or eng.max_len < need or eng._hf_where != where:
        length = -(-need // _ENGINE_LEN_STEP) * _ENGINE_LEN_STEP
        eng = SpeculativeEngine(target, drafter, max_len=length, cuda_graphs=p.is_cuda)
        eng._hf_where = where
        drafter.__dict__["_hf_carryover_tree_engine"] = eng  # not a submodule: never saved, never moved
    return eng


@torch.no_grad()
def tree_generate(target, drafter, input_ids: torch.Tensor, generation_config) -> torch.LongTensor:
    """One prompt `[1, n]` -> `[1, n + new]`, the target's greedy continuation, verified as draft trees.

    Stops where generate() would: `generation_config.max_length` and its EOS ids. Context lookup follows
    `prompt_lookup_num_tokens` as in the linear path (looked-up tokens go on the tree's rank-0 chain)."""
    tree, nodes = drafter.draft_tree
    n = input_ids.shape[1]
    max_new = int(generation_config.max_length) - n
    if max_new <= 0:
        return input_ids
    lookup = getattr(generation_config, "prompt_lookup_num_tokens", None)
    k = drafter.config.num_proposals
    eng = _engine_for(target, drafter, n + max_new + 2 * k + (nodes or tree.num_nodes) + 2)
    new = eng.generate([input_ids[0].tolist()], max_new_tokens=max_new, eos_token_id=generation_config.eos_token_id,
                       prompt_lookup_num_tokens=lookup, tree=tree, tree_nodes=nodes)[0]
    drafter.last_candidate_generator = TreeRounds(eng.rounds[0], eng.lookup_rounds[0], lookup,
                                                  nodes or tree.num_nodes, eng.last_mode)
    return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
