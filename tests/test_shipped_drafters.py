"""The drafters shipped in model_cards/: loadable as users load them, Hub-sized, and their cards' τ traceable to
a stored results file (no hand-typed numbers)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p for p in (ROOT / "model_cards").glob("*") if (p / "config.json").exists())


def test_dflash_pair_ships():
    names = {p.name for p in FOLDERS}
    assert {"smollm2-135m-instruct-dflash", "smollm2-135m-instruct-dflash-carryover"} <= names, names


@pytest.fixture(scope="module")
def remote_loads(tmp_path_factory):
    """A process that never imports hf_carryover loads every folder with weights through AutoModel (remote code), in
    bf16, checking after each load; one process for all folders (a start with torch and transformers is most of it).
    Returns the finished process; its stdout has a line `FOLDER drafter_type carryover target_layers` per folder."""
    folders = [str(f) for f in FOLDERS if (f / "model.safetensors").exists()]
    code = ("from transformers import AutoModel; import torch, sys\n"
            f"for folder in {folders!r}:\n"
            "    m = AutoModel.from_pretrained(folder, trust_remote_code=True)\n"
            "    assert 'hf_carryover' not in sys.modules, 'loaded the installed package, not the folder code'\n"
            "    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}\n"
            "    print(folder, m.config.drafter_type, m.config.carryover, "
            "m.config.target_fingerprint['num_hidden_layers'])\n")
    env = {**os.environ, "PYTHONPATH": ""}  # the package must not be importable from the repo root either
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path_factory.mktemp("remote"), env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_loads_with_remote_code_only(folder, remote_loads):
    """A process that never imports hf_carryover loads the folder through AutoModel (remote code), in bf16."""
    if not (folder / "model.safetensors").exists():
        pytest.skip("weights not in this working tree (sparse checkout: trainer/device_tree.sh light)")
    assert (folder / "model.safetensors").stat().st_size <= 100e6
    assert remote_loads.returncode == 0, remote_loads.stderr[-2000:]
    (line,) = [x for x in remote_loads.stdout.splitlines() if x.startswith(f"{folder} ")]
    typ, carry, layers = line.split()[-3:]
    assert typ in folder.name and (carry == "True") == folder.name.endswith("-carryover") and layers == "30"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_card_tau_comes_from_a_results_file(folder):
    text = (folder / "README.md").read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    metrics = [m for r in meta["model-index"][0]["results"] for m in r["metrics"]]
    # the card names its results files and the drafter's label in them (make_model_card.py --results --drafter_key,
    # --lookup_results --lookup_key for the rows measured with context lookup, --tree_results --tree_keys for the
    # engine's draft-tree rows, one table per label)
    for kind, what in (("tau", ""), ("tau_lookup", " with context lookup"), ("tau_tree", " with a draft tree")):
        card = sorted(m["value"] for m in metrics if m["type"] == kind)
        found = re.findall(rf"Results files{what} \(hf_carryover repository\): (.+) \(drafter `([^`]+)`\)\.", text)
        if kind != "tau" and not found and not card:
            continue  # no rows of this kind on this card
        assert found, f"the card does not name its {kind} results files: regenerate it with trainer/make_model_card.py"
        stored = []
        for names, key in found:
            for f in re.findall(r"`([^`]+)`", names):
                assert (ROOT / f).exists(), f"{folder.name}'s card names {f}, which is not in the repository"
                stored += [round(r["tau"], 3) for r in json.loads((ROOT / f).read_text())["results"].values()
                           if r["drafter"] == key]
        assert card and sorted(card) == sorted(stored), (kind, card, sorted(stored))
    assert len([m for m in metrics if m["type"] == "tau"]) == 6  # 3 datasets x T=0, T=1


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_remote_code_matches_the_package(folder):
    """The folder's remote code is what users run; it must be the package's current code, or a fix to
    hf_carryover would not reach `trust_remote_code=True` users. Re-save the folder (`save_pretrained`) after
    changing these files."""
    for name in ("modeling_drafter.py", "configuration_drafter.py", "generation_carryover.py"):
        shipped = (folder / name).read_text()
        assert shipped == (ROOT / "hf_carryover" / name).read_text(), (
            f"{folder.name}/{name} differs from hf_carryover/{name}: re-save the folder with save_pretrained")


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_draft_tree_ships_and_fits_the_drafter(folder):
    """Each DFlash drafter folder carries its calibrated draft tree, calibrated on training data (never on the
    evaluation prompts) for this drafter's block, and it loads as the engine loads it."""
    from hf_carryover.engine.tree import TreeSpec

    cfg = json.loads((folder / "config.json").read_text())
    if cfg["drafter_type"] != "dflash":
        pytest.skip("trees need a DFlash drafter")
    tree = TreeSpec.from_pretrained(folder)
    meta = json.loads((folder / "draft_tree.json").read_text())
    assert tree.max_depth <= cfg["block_size"] - 1 and tree.num_nodes >= 63
    assert "train" in meta["data"] and not any(s in meta["data"] for s in ("mtbench", "humaneval", "eval", "heldout"))
    counts = dict(zip(map(tuple, meta["paths"]), meta["counts"]))
    assert all(counts[p[:-1]] >= c for p, c in counts.items() if len(p) > 1)  # a prefix is never rarer


def test_tree_from_pretrained_names_a_missing_file(tmp_path):
    from hf_carryover.engine.tree import TreeSpec

    with pytest.raises(FileNotFoundError, match="calibrate_tree.py"):
        TreeSpec.from_pretrained(tmp_path)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_remote_code_drafter_takes_its_shipped_tree(folder):
    """`use_draft_tree()` finds the folder's draft_tree.json (63 nodes a round). In this process AutoModel may hand
    back the package's class; the folder's copy of the code is the same (test_remote_code_matches_the_package)."""
    if not (folder / "model.safetensors").exists():
        pytest.skip("weights not in this working tree (sparse checkout: trainer/device_tree.sh light)")
    from transformers import AutoModel

    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True)
    tree, nodes = drafter.use_draft_tree().draft_tree
    assert nodes == 63 and tree.num_nodes == len(json.loads((folder / "draft_tree.json").read_text())["paths"])
