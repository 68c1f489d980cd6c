"""Model cards for drafter folders, generated from one template and measured results.

`push_to_hub` overwrites a repo's README, so the card is written (or pushed) afterwards with
`huggingface_hub.ModelCard`: YAML metadata (base_model = the target, library, tags, `model-index` with the
measured τ) followed by quick start, training, target compatibility and results sections. Only numbers present
in the results file appear; a missing measurement is written as "not measured", never filled in.

Results file: the `summary.json` of `examples/evaluate_tau.py` (rows keyed "drafter|dataset|T=...") with its
`environment` block; `drafter_key` selects this drafter's rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

DATASETS = {
    "mtbench": ("MT-Bench (80 first turns)", "HuggingFaceH4/mt_bench_prompts"),
    "humaneval": ("HumanEval (164)", "openai/openai_humaneval"),
    "sharegpt": ("ShareGPT held-out", "anon8231489123/ShareGPT_Vicuna_unfiltered"),
}

TEMPLATE = """
# {name}

A **{kind}** drafter{carry_text} for speculative decoding of **{base_model}** with
[hf_carryover](https://pypi.org/project/hf-carryover/). It proposes {num_proposals} tokens per round in one forward
pass; the target verifies them, so the output is exactly the target's own (greedy: token for token).

## Quick start

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{base_model}")
tokenizer = AutoTokenizer.from_pretrained("{base_model}")
drafter = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True)

ids = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}], add_generation_prompt=True,
                                    return_tensors="pt")
out = target.generate(ids, assistant_model=drafter, max_new_tokens=256)
print(drafter.last_candidate_generator.tau)  # tokens per target forward
```

Loading the drafter's code (`trust_remote_code=True`) hooks `generate()` so that `assistant_model=drafter`
runs the block drafter; transformers >= 5.17 is required. Batch size 1 (transformers' assisted decoding).
Adding `prompt_lookup_num_tokens=15` lets rounds whose context ends in a 3- or 4-gram seen earlier copy what followed
it instead of drafting (context lookup; lossless like drafting). It pays where the target repeats itself. On a CPU,
where every verified row costs, `num_assistant_tokens=4` shortens drafted rounds only
(lookups still copy up to 15).{tree_text}

## Target compatibility

| | |
|---|---|
| target | `{base_model}` ({fp}) |
| target layers tapped | {layers} (HF `hidden_states[i + 1]`) |
| block size | {block_size} ({num_proposals} proposals per round) |
| drafter layers | {num_layers} (Qwen3-style, KV injection of fused target features) |
| mask input | {mask} |
| Carryover | {carryover} |

Binding this drafter to a target with another fingerprint raises a `ValueError`.

## Training

{training}

## Results

{results}

## Limitations

Measured τ depends on the prompt domain and on sampling temperature; speed also depends on the engine
(transformers' `generate()` is launch-bound for small targets). See the results' hardware and versions.
"""


def _rows(summaries: list[dict], drafter_key: str, latest: bool = False) -> list[tuple[dict, dict]]:
    """(summary, row) for every row of the drafter, in file order (e.g. a T=0 file, then a T=1 file). latest=True:
    a later file's row for the same dataset and temperature replaces an earlier one's (a re-measurement)."""
    rows = [(s, r) for s in summaries for r in s.get("results", {}).values() if r["drafter"] == drafter_key]
    if latest:
        last = {(r["dataset"], r["temperature"]): i for i, (_, r) in enumerate(rows)}
        rows = [sr for i, sr in enumerate(rows) if last[(sr[1]["dataset"], sr[1]["temperature"])] == i]
    return rows


def _measured_line(summary: dict) -> str:
    env = summary.get("environment", {})
    return (f"Measured with `{summary.get('command', '?')}` at commit `{env.get('commit')}` on "
            f"{env.get('gpu')}, torch {env.get('torch')}, transformers {env.get('transformers')}; "
            f"max {summary.get('max_new_tokens')} new tokens, "
            + ("our batched engine in fp32 (rows advance independently, so τ is batch-1 τ)."
               if "--engine" in summary.get("command", "") else "batch 1."))


def _table(summaries, rows, sources, key, what="", rounds="draft rounds") -> list[str]:
    """Markdown rows of one drafter label, each results file's command, and the files' names."""
    lines = [f"| dataset | T | prompts | {rounds} | τ |", "|---|---|---|---|---|"]
    lines += [f"| {DATASETS.get(r['dataset'], (r['dataset'],))[0]} | {r['temperature']:g} | {r['prompts']} | "
              f"{r['rounds']} | {r['tau']:.2f} |" for _, r in rows]
    used = [s for s in summaries if any(s is u for u, _ in rows)]
    temps = [tuple(sorted({r["temperature"] for u, r in rows if u is s})) for s in used]
    for s, ts in zip(used, temps):
        # files told apart by temperature (T=0, T=1 calls) say so; files with the same T also name their datasets
        sets = sorted({DATASETS.get(r["dataset"], (r["dataset"],))[0] for u, r in rows if u is s})
        lead = "" if len(used) == 1 else ("T=" + ", ".join(f"{t:g}" for t in ts)
                                           + (" (" + ", ".join(sets) + ")" if temps.count(ts) > 1 else "") + ": ")
        lines.append(f"\n{lead}{_measured_line(s)}")
    if sources:  # the files these rows came from (`sources` is parallel to `summaries`)
        named = [p for s, p in zip(summaries, sources) if any(s is u for u, _ in rows)]
        lines.append(f"\nResults files{what} (hf_carryover repository): " + ", ".join(f"`{p}`" for p in named)
                     + f" (drafter `{key}`).")
    return lines


def _spec_options(summaries, key) -> dict | None:
    """The options of the drafter spec `KEY=FOLDER,opt=value,...` in the first command that names KEY, or None."""
    for s in summaries:
        m = re.search(rf"(?:^| ){re.escape(key)}=(\S*)", s.get("command", ""))
        if m:
            return dict(kv.split("=", 1) for kv in m.group(1).split(",")[1:] if "=" in kv)
    return None


def _lookup_tokens(summaries, key) -> int | None:
    """The N of `KEY=FOLDER,...,lookup=N` in the command that measured the lookup rows."""
    m = re.match(r"\d+", (_spec_options(summaries, key) or {}).get("lookup", ""))
    return int(m.group()) if m else None


def _tree_setting(summaries, key) -> str:
    """`tree_nodes=N` (and `, lookup=M`) of `KEY=FOLDER,...` in the command that measured a tree row."""
    opts = _spec_options(summaries, key)
    if opts is None:
        raise ValueError(f"the tree results' commands have no `{key}=...` entry")
    text = f"tree_nodes={opts.get('tree_nodes', 'all')}"
    return text + (f", prompt_lookup_num_tokens={opts['lookup']}" if "lookup" in opts else "")


def build_model_card(folder, name: str, repo_id: str, base_model: str, summary: dict | list[dict] | None = None,
                     drafter_key: str | None = None, training_text: str = "",
                     sources: list[str] | None = None, lookup_summary: list[dict] | None = None,
                     lookup_key: str | None = None, lookup_sources: list[str] | None = None,
                     tree_summary: list[dict] | None = None, tree_keys: list[str] | None = None,
                     tree_sources: list[str] | None = None) -> ModelCard:
    """Card for the drafter saved in `folder` (its config.json supplies the compatibility facts). `summary`: one
    results file or several (a run that measured T=0 and T=1 in separate calls); each row keeps its own command.
    `sources`: where those files are stored (repository paths); the card names them and `drafter_key`, so every τ on
    it can be traced to its file (the label a run gave the drafter need not be its folder name).
    `lookup_summary` / `lookup_key` / `lookup_sources`: the same drafter measured with context lookup
    (`prompt_lookup_num_tokens=N`, N read from the command), shown as a second table and as `tau_lookup` metrics.
    `tree_summary` / `tree_keys` / `tree_sources`: the drafter in the fast engine with its draft tree
    (`draft_tree.json`), one table per label (settings read from the command), as `tau_tree` metrics."""
    summaries = [] if summary is None else [summary] if isinstance(summary, dict) else list(summary)
    lookup_summaries = list(lookup_summary or [])
    cfg = json.loads((Path(folder) / "config.json").read_text())
    rows = _rows(summaries, drafter_key) if drafter_key else []
    lookup_rows = _rows(lookup_summaries, lookup_key) if lookup_key else []
    n_lookup = _lookup_tokens(lookup_summaries, lookup_key) if lookup_rows else None
    if lookup_rows and n_lookup is None:
        raise ValueError(f"the lookup results' command has no `{lookup_key}=...,lookup=N` entry")
    tree_summaries = list(tree_summary or [])
    # a label measured again in a later file (e.g. after a rule change) takes the later file's rows
    tree_tables = [(k, _rows(tree_summaries, k, latest=True), _tree_setting(tree_summaries[::-1], k))
                   for k in tree_keys or []]
    evals = []
    kinds = [("tau", rows, None), ("tau_lookup", lookup_rows, None)] + [("tau_tree", r, t) for _, r, t in tree_tables]
    for kind, these, setting in kinds:
        for s, r in these:
            ds_name, ds_id = DATASETS.get(r["dataset"], (r["dataset"], r["dataset"]))
            label = ("τ (mean accepted length)" if kind == "tau"
                     else f"τ with context lookup (prompt_lookup_num_tokens={n_lookup})" if kind == "tau_lookup"
                     else f"τ with a draft tree, engine ({setting})")
            evals.append(EvalResult(task_type="text-generation", task_name="speculative decoding",
                                    dataset_type=ds_id, dataset_name=ds_name,
                                    dataset_args={"temperature": r["temperature"],
                                                  "max_new_tokens": s.get("max_new_tokens")},
                                    metric_type=kind, metric_name=f"{label}, T={r['temperature']:g}",
                                    metric_value=round(r["tau"], 3)))
    data = ModelCardData(base_model=base_model, library_name="transformers", license="apache-2.0",
                         tags=["speculative-decoding", "hf_carryover", cfg["drafter_type"]]
                         + (["carryover"] if cfg.get("carryover") else []),
                         model_name=name, eval_results=evals or None)
    if rows:
        lines = _table(summaries, rows, sources, drafter_key)
        if lookup_rows:
            lines += [f"\n### With context lookup (`prompt_lookup_num_tokens={n_lookup}`)\n",
                      "Rounds whose committed context ends in a 3- or 4-gram seen earlier propose what followed it "
                      "instead of the drafted block; the drafter drafts every other round. Lossless like drafting.\n"]
            lines += _table(lookup_summaries, lookup_rows, lookup_sources, lookup_key, " with context lookup",
                            "rounds (drafted or looked up)")
        for key, these, setting in tree_tables:
            lines += [f"\n### With a draft tree in the fast engine (`{setting}`)\n",
                      "hf_carryover's engine verifies, each round, the nodes of this folder's `draft_tree.json` "
                      "(calibrated on training responses) that the drafter finds likeliest, in one target forward "
                      "(greedy rounds here; "
                      "`SpeculativeEngine.generate(..., tree=TreeSpec.from_pretrained(folder), tree_nodes=N)`, or "
                      "`drafter.use_draft_tree(nodes=N)` before `generate()`, which then runs these rounds). "
                      "τ is tokens per verification.\n"]
            lines += _table(tree_summaries, these, tree_sources, key, " with a draft tree", "rounds")
        results = "\n".join(lines)
    else:
        results = "Not measured yet."
    fp = cfg.get("target_fingerprint") or {}
    body = TEMPLATE.format(
        name=name, repo_id=repo_id, base_model=base_model,
        kind={"dflash": "DFlash-style block", "markov": "Markov (DSpark-style) block"}[cfg["drafter_type"]],
        carry_text=(" with **Carryover** (it reuses the target's hidden states of rejected tokens)"
                    if cfg.get("carryover") else ""),
        num_proposals=cfg["block_size"] - (1 if cfg["drafter_type"] == "dflash" else 0),
        fp=", ".join(f"{k} {v}" for k, v in fp.items()), layers=cfg["target_layer_ids"], block_size=cfg["block_size"],
        num_layers=cfg["num_hidden_layers"],
        mask=("learned embedding" if cfg.get("learned_mask_embedding")
              else f"target token id {cfg.get('mask_token_id')}"),
        carryover="on" if cfg.get("carryover") else "off", training=training_text or "Not documented.", results=results,
        tree_text="\nWith the `hf_carryover` package installed, `drafter.use_draft_tree()` makes greedy calls "
                  "(left-padded batches too) verify a draft tree each round (this repository's `draft_tree.json`, "
                  "63 nodes a round, on hf_carryover's engine); other calls verify linear blocks and warn why."
                  if (Path(folder) / "draft_tree.json").exists() else "")
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n" + body)


def write_model_card(folder, **kwargs) -> Path:
    """Build the card and save it as `folder/README.md` (call after `save_pretrained`/`push_to_hub`)."""
    card = build_model_card(folder, **kwargs)
    path = Path(folder) / "README.md"
    card.save(path)
    return path


__all__ = ["build_model_card", "write_model_card"]
