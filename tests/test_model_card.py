"""Model cards: YAML metadata with measured τ in model-index, compatibility facts from config, no invented numbers."""

import json

from huggingface_hub import ModelCard

from hf_carryover.model_card import write_model_card
from test_training import tiny_drafter, tiny_target


def test_card_from_results(tmp_path):
    drafter = tiny_drafter(tiny_target(), "markov", carryover=True)
    drafter.save_pretrained(tmp_path)
    summary = {"command": "python examples/evaluate_tau.py ...", "max_new_tokens": 256,
               "environment": {"commit": "abc123", "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.17"},
               "results": {"x|mtbench|T=0.0": {"drafter": "x", "dataset": "mtbench", "temperature": 0.0,
                                               "prompts": 80, "rounds": 900, "tau": 3.21},
                           "y|mtbench|T=0.0": {"drafter": "y", "dataset": "mtbench", "temperature": 0.0,
                                               "prompts": 80, "rounds": 900, "tau": 9.99}}}
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=summary,
                            drafter_key="x", training_text="Trained on nothing.")
    card = ModelCard.load(path)
    assert card.data.base_model == "org/target" and "carryover" in card.data.tags
    results = card.data.eval_results
    assert [r.metric_value for r in results] == [3.21]  # only this drafter's row
    text = path.read_text()
    assert "9.99" not in text and "NVIDIA H200" in text and "abc123" in text
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert str(cfg["target_layer_ids"]) in text and "Trained on nothing." in text


def test_card_without_results_says_so(tmp_path):
    tiny_drafter(tiny_target(), "dflash", carryover=False).save_pretrained(tmp_path)
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target")
    card = ModelCard.load(path)
    assert not card.data.eval_results
    assert "Not measured yet." in path.read_text()


def test_card_from_two_results_files_keeps_each_command(tmp_path):
    """T=0 and T=1 measured in separate calls: both rows reach the card, each under its own command and commit."""
    tiny_drafter(tiny_target(), "dflash", carryover=False).save_pretrained(tmp_path)

    def summary(temp, commit, tau):
        return {"command": f"python examples/evaluate_tau.py --engine --temperatures {temp:g}", "max_new_tokens": 256,
                "environment": {"commit": commit, "gpu": "NVIDIA H200", "torch": "2.11", "transformers": "5.17"},
                "results": {f"x|mtbench|T={temp}": {"drafter": "x", "dataset": "mtbench", "temperature": temp,
                                                    "prompts": 80, "rounds": 900, "tau": tau}}}

    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target",
                            summary=[summary(0.0, "c0ffee0", 2.25), summary(1.0, "c0ffee1", 1.61)], drafter_key="x")
    assert [r.metric_value for r in ModelCard.load(path).data.eval_results] == [2.25, 1.61]
    text = path.read_text()
    assert "T=0: Measured with `python examples/evaluate_tau.py --engine --temperatures 0`" in text
    assert "T=1: Measured with" in text and "c0ffee0" in text and "c0ffee1" in text
    assert "Results files" not in text  # no sources given: none named
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target",
                            summary=[summary(0.0, "c0ffee0", 2.25)], drafter_key="x", sources=["results/a.json"])
    assert "Results files (hf_carryover repository): `results/a.json` (drafter `x`)." in path.read_text()


def test_card_with_lookup_rows(tmp_path):
    """Rows measured with context lookup get their own table, `tau_lookup` metrics, the N from the command, and their
    own results-file line; a lookup file whose command names no `KEY=...,lookup=N` is refused."""
    import pytest

    tiny_drafter(tiny_target(), "dflash", carryover=False).save_pretrained(tmp_path)

    def summary(command, key, tau):
        return {"command": command, "max_new_tokens": 256, "environment": {"commit": "c0ffee0"},
                "results": {f"{key}|mtbench|T=0.0": {"drafter": key, "dataset": "mtbench", "temperature": 0.0,
                                                     "prompts": 80, "rounds": 900, "tau": tau}}}

    plain = summary("python examples/evaluate_tau.py --engine --drafters x=F", "x", 2.0)
    looked = summary("python examples/evaluate_tau.py --engine --drafters x=F x-lk=F,lookup=15", "x-lk", 2.7)
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=[plain],
                            drafter_key="x", sources=["r/a.json"], lookup_summary=[looked], lookup_key="x-lk",
                            lookup_sources=["r/b.json"])
    evals = ModelCard.load(path).data.eval_results
    assert [(r.metric_type, r.metric_value) for r in evals] == [("tau", 2.0), ("tau_lookup", 2.7)]
    text = path.read_text()
    assert "prompt_lookup_num_tokens=15" in text and "| 2.70 |" in text
    assert "Results files with context lookup (hf_carryover repository): `r/b.json` (drafter `x-lk`)." in text
    looked["command"] = "python examples/evaluate_tau.py --engine --drafters x-lk=F"
    with pytest.raises(ValueError, match="lookup=N"):
        write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=[plain],
                         drafter_key="x", lookup_summary=[looked], lookup_key="x-lk")


def test_card_with_tree_rows(tmp_path):
    """Draft-tree rows: one table per label with the tree size (and lookup) read from the command, `tau_tree` metrics,
    and a results-file line each; a label the commands do not name is refused."""
    import pytest

    tiny_drafter(tiny_target(), "dflash", carryover=False).save_pretrained(tmp_path)
    cmd = ("python examples/evaluate_tau.py --engine --drafters x=F x-t=F,tree=T.json,tree_nodes=63 "
           "x-tl=F,tree=T.json,tree_nodes=31,lookup=15")

    def row(key, ds, tau):
        return {f"{key}|{ds}|T=0.0": {"drafter": key, "dataset": ds, "temperature": 0.0, "prompts": 80, "rounds": 9,
                                      "tau": tau}}

    s = {"command": cmd, "max_new_tokens": 256, "environment": {"commit": "c0ffee0"},
         "results": {**row("x", "mtbench", 2.0), **row("x-t", "mtbench", 3.1), **row("x-tl", "mtbench", 3.4)}}
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=[s],
                            drafter_key="x", tree_summary=[s], tree_keys=["x-t", "x-tl"], tree_sources=["r/t.json"])
    evals = ModelCard.load(path).data.eval_results
    assert [(r.metric_type, r.metric_value) for r in evals] == [("tau", 2.0), ("tau_tree", 3.1), ("tau_tree", 3.4)]
    text = path.read_text()
    assert "(`tree_nodes=63`)" in text and "(`tree_nodes=31, prompt_lookup_num_tokens=15`)" in text
    assert "Results files with a draft tree (hf_carryover repository): `r/t.json` (drafter `x-tl`)." in text
    with pytest.raises(ValueError, match="x-none"):
        write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=[s],
                         drafter_key="x", tree_summary=[s], tree_keys=["x-none"])
    # a later file measuring a label again (here with 63 nodes) replaces that label's rows, setting and file line
    s2 = {"command": cmd.replace("x-tl=F,tree=T.json,tree_nodes=31", "x-tl=F,tree=T.json,tree_nodes=63"),
          "max_new_tokens": 256, "environment": {"commit": "bead5"}, "results": row("x-tl", "mtbench", 3.9)}
    path = write_model_card(tmp_path, name="tiny", repo_id="org/tiny", base_model="org/target", summary=[s],
                            drafter_key="x", tree_summary=[s, s2], tree_keys=["x-t", "x-tl"],
                            tree_sources=["r/t.json", "r/t2.json"])
    evals = ModelCard.load(path).data.eval_results
    assert [(r.metric_type, r.metric_value) for r in evals] == [("tau", 2.0), ("tau_tree", 3.1), ("tau_tree", 3.9)]
    text = path.read_text()
    assert "(`tree_nodes=63, prompt_lookup_num_tokens=15`)" in text and "(`tree_nodes=31" not in text
    assert "`r/t2.json` (drafter `x-tl`)." in text and "`r/t.json` (drafter `x-t`)." in text
