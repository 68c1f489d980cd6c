"""Export a DFlash drafter to the plain DFlash draft-model format that serving engines load (z-lab layout).

    python -m hf_carryover.export model_cards/NAME exported/NAME-dflash

That format (DESIGN.md §12): a Qwen3-style `config.json` with `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids, block_size}`, and the
weights `fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm` — the names our drafter already uses. The mask is
embedded with the *target's* row `mask_token_id`, so a learned mask embedding cannot be exported. Carryover has
no place in that format: the marker vector is dropped and the engine runs the drafter as plain DFlash.
Checked here: names, shapes and config fields. Not yet checked: loading in vLLM (needs the GPU bundle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

DROPPED_PREFIXES = ("carryover_embedding", "carryover_gate", "markov_in", "markov_out", "rotary_emb")


def export_dflash(drafter, out_dir, dtype=torch.bfloat16) -> dict:
    """Write `config.json` + `model.safetensors`; returns {"dropped": [...names not in the format...]}."""
    cfg = drafter.config
    if cfg.drafter_type != "dflash":
        raise ValueError(f"Only 'dflash' drafters have a DFlash serving format; this one is {cfg.drafter_type!r}.")
    if cfg.learned_mask_embedding or cfg.mask_token_id is None:
        raise ValueError("The DFlash format embeds the mask with the target's row `mask_token_id`; this drafter "
                         "uses a learned mask embedding, which the format cannot carry.")
    # vLLM taps layer i as the residual stream after i+1 target layers and concatenates the taps in ascending
    # layer order, once per layer; HF's hidden_states[-1] is post-final-norm. Any other list drafts differently.
    ids = list(cfg.target_layer_ids)
    n_target = (cfg.target_fingerprint or {}).get("num_hidden_layers", cfg.num_target_layers)
    if ids != sorted(set(ids)) or ids[0] < 0 or (n_target is not None and ids[-1] > n_target - 2):
        raise ValueError(f"target_layer_ids {ids} must be strictly increasing, in 0..num_target_layers-2 "
                         f"(num_target_layers={n_target}): vLLM concatenates the tapped layers in layer order.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state, dropped = {}, []
    for name, tensor in drafter.state_dict().items():
        if name.startswith(DROPPED_PREFIXES):
            dropped.append(name)
            continue
        state[name] = tensor.detach().to(dtype).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    theta = cfg.rope_parameters.get("rope_theta", 10000.0)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_cache": False,
        "dtype": str(dtype).replace("torch.", ""),
        "block_size": cfg.block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": ids, "block_size": cfg.block_size},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"dropped": dropped}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m hf_carryover.export DRAFTER_FOLDER OUT_DIR")
    from transformers import AutoModel

    drafter = AutoModel.from_pretrained(argv[0], trust_remote_code=True)
    info = export_dflash(drafter, argv[1])
    print(f"exported to {argv[1]}; not in the format (dropped): {info['dropped'] or 'nothing'}")


if __name__ == "__main__":
    main()
