"""DFlash serving-format export: weight names and shapes of the z-lab layout, config fields, refusals."""

import json

import pytest
import torch
from conftest import build_drafter, build_target
from safetensors.torch import load_file

from hf_carryover.export import export_dflash

LAYER_KEYS = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight"}


def test_export_layout(tmp_path):
    target = build_target("qwen3")
    drafter = build_drafter(target, "dflash", True, num_layers=2, carryover_gate=-6.0)
    info = export_dflash(drafter, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    expected = ({"fc.weight", "hidden_norm.weight", "norm.weight"}
                | {f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS})
    assert set(weights) == expected
    assert sorted(info["dropped"]) == ["carryover_embedding", "carryover_gate"]  # Carryover has no place there
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    torch.testing.assert_close(weights["layers.1.self_attn.k_proj.weight"].float(),
                               drafter.layers[1].self_attn.k_proj.weight.detach().to(torch.bfloat16).float())
    cfg = json.loads((tmp_path / "config.json").read_text())
    c = drafter.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                                    "block_size": c.block_size}
    assert cfg["num_target_layers"] == target.config.num_hidden_layers and cfg["head_dim"] == c.head_dim
    assert weights["fc.weight"].shape == (c.hidden_size, len(c.target_layer_ids) * c.hidden_size)


def test_export_refusals(tmp_path):
    target = build_target("llama")
    with pytest.raises(ValueError, match="Only 'dflash'"):
        export_dflash(build_drafter(target, "markov", False), tmp_path)
    with pytest.raises(ValueError, match="learned mask"):
        export_dflash(build_drafter(target, "dflash", False, mask_token_id=None), tmp_path)
    drafter = build_drafter(target, "dflash", False)
    n = drafter.config.target_fingerprint["num_hidden_layers"]
    for bad in ([2, 0], [0, 0], [n - 1]):  # unsorted / repeated: vLLM fuses in layer order; n-1 is post-norm in HF
        drafter.config.target_layer_ids = bad
        with pytest.raises(ValueError, match="strictly increasing"):
            export_dflash(drafter, tmp_path)
