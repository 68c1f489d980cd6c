"""Configuration of a block drafter (DFlash or Markov) with optional Carryover.

This file is copied verbatim into every saved drafter folder (remote code), so it imports nothing from
`hf_carryover`: only `transformers`.

A drafter belongs to exactly one target: it reads that target's hidden states (at `target_layer_ids`) and
uses its frozen embedding and LM head. `target_fingerprint` records the target's shape so that binding the
drafter to another target fails loudly instead of drafting garbage.
"""

from transformers import PreTrainedConfig

DRAFTER_TYPES = ("dflash", "markov")
FINGERPRINT_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Distinct layers spread evenly from the 2nd to the 3rd-from-last (DESIGN.md §3).

    For 36 target layers and 5 features this gives [1, 9, 17, 25, 33], the layers DFlash taps on Qwen3-4B;
    for SmolLM2's 30 layers, [1, 7, 14, 20, 27]. The last layer is never tapped: HF's last hidden state is
    post-final-norm. Small targets get fewer, distinct layers rather than repeats.
    """
    start, end = 1, num_target_layers - 3
    if end <= start:  # tiny targets: every layer but the last, up to num_features of them
        return list(range(max(1, num_target_layers - 1)))[:num_features]
    n = min(num_features, end - start + 1)
    if n == 1:
        return [start]
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


def target_fingerprint(target_config) -> dict:
    """The shape facts of a target that a drafter depends on (its text config for multimodal targets)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": head_dim,
    }


class DrafterConfig(PreTrainedConfig):
    r"""
    Args:
        drafter_type: `"dflash"` (block position k>=1 predicts its own token; B-1 proposals) or `"markov"`
            (block position k predicts token anchor+k+1, a rank-`markov_rank` head adds a bigram correction
            from the previous token; B proposals).
        block_size: B, the length of `[anchor, mask x (B-1)]`.
        num_hidden_layers: drafter decoder layers (Qwen3-style: q/k RMSNorm, SwiGLU, RoPE).
        target_layer_ids: target decoder layers whose outputs are fused (layer i = `hidden_states[i + 1]`).
        mask_token_id: target vocabulary row whose embedding fills the mask slots (DFlash semantics).
        learned_mask_embedding: use a learned vector instead of the target row (for targets without a spare token).
        carryover: feed the rejected rows of the last verification back as temporary K/V.
        markov_rank: r of the Markov head `W2(W1[x_prev])`.
        target_fingerprint: shape facts of the target (see `target_fingerprint`).
        loss_decay_gamma: position weight exp(-(k-1)/gamma) of the training loss (None: 7/5/4 rule of DFlash).
        carryover_gate: initial value of a learned attention-logit bias on the carryover keys, one per layer and
            head (e.g. -6: the rows start almost unseen, so stage 2 starts from the baseline drafter's behaviour
            and opens the gate only where the rows lower the loss). None: no gate, the rows attend like committed
            context (the drafters of 2026-11; their rows cost τ: examples/results/h200-2026-11-30f).
    """

    model_type = "carryover_drafter"

    def __init__(
        self,
        drafter_type: str = "dflash",
        block_size: int = 16,
        num_hidden_layers: int = 5,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        learned_mask_embedding: bool = False,
        carryover: bool = False,
        markov_rank: int = 256,
        vocab_size: int = 32000,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 32768,
        attention_bias: bool = False,
        target_fingerprint: dict | None = None,
        num_target_layers: int | None = None,
        loss_decay_gamma: float | None = None,
        carryover_gate: float | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        if drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"Unknown drafter_type {drafter_type!r}; expected one of {DRAFTER_TYPES}.")
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one mask), got {block_size}.")
        self.drafter_type = drafter_type
        self.block_size = block_size
        self.num_hidden_layers = num_hidden_layers
        self.num_target_layers = num_target_layers
        if target_layer_ids is None and num_target_layers is not None:
            target_layer_ids = default_target_layer_ids(num_target_layers, 5)
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else [1]
        self.mask_token_id = mask_token_id
        self.learned_mask_embedding = learned_mask_embedding
        self.carryover = carryover
        self.markov_rank = markov_rank
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.target_fingerprint = target_fingerprint
        self.loss_decay_gamma = loss_decay_gamma
        self.carryover_gate = None if carryover_gate is None else float(carryover_gate)
        self.initializer_range = initializer_range
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def num_proposals(self) -> int:
        """Draft tokens per round: B-1 for DFlash (the anchor slot is not a proposal), B for Markov."""
        return self.block_size - 1 if self.drafter_type == "dflash" else self.block_size

    @property
    def decay_gamma(self) -> float:
        """DFlash's position-decay constant: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated elsewhere)."""
        if self.loss_decay_gamma is not None:
            return float(self.loss_decay_gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size * 7.0 / 16.0))


__all__ = ["DrafterConfig", "default_target_layer_ids", "target_fingerprint", "DRAFTER_TYPES"]
