"""Bad input fails loudly, with a message that says what is wrong."""

import re

import pytest
import torch

from hf_carryover import CarryoverCandidateGenerator, Drafter, DrafterConfig, target_fingerprint

from conftest import VOCAB, build_drafter, build_target, make_prompt


def test_fingerprint_mismatch_names_both_fingerprints():
    llama, qwen = build_target("llama"), build_target("qwen3")
    drafter = build_drafter(llama, "dflash", True)
    fp_llama, fp_qwen = target_fingerprint(llama.config), target_fingerprint(qwen.config)
    assert fp_llama != fp_qwen and fp_llama["vocab_size"] == fp_qwen["vocab_size"]
    with pytest.raises(ValueError) as err:
        drafter.bind_target(qwen)
    msg = str(err.value)
    assert str(fp_llama) in msg and str(fp_qwen) in msg
    # through generate() as well (make_candidate_generator binds the target), and nothing was drafted
    drafter.last_candidate_generator = None
    with pytest.raises(ValueError, match="fingerprint"):
        qwen.generate(make_prompt(4), assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert drafter.last_candidate_generator is None


def test_fingerprint_mismatch_same_architecture_other_depth():
    drafter = build_drafter(build_target("llama", num_layers=6), "markov", True)
    deeper = build_target("llama", num_layers=7)
    with pytest.raises(ValueError, match=re.escape("'num_hidden_layers': (6, 7)")):
        drafter.bind_target(deeper)


def test_vocab_mismatch():
    target = build_target("llama")
    other = build_target("llama", vocab_size=VOCAB + 8)
    drafter = build_drafter(target, "dflash", False)
    # with a fingerprint, the fingerprint check fires (vocab_size is part of it)
    with pytest.raises(ValueError, match="vocab_size"):
        drafter.bind_target(other)
    # without one (e.g. a hand-built config), the vocabulary check itself fires
    drafter.config.target_fingerprint = None
    drafter._target_parts = {}
    with pytest.raises(ValueError, match=rf"Vocabulary mismatch.*{VOCAB}.*{VOCAB + 8}"):
        drafter.bind_target(other)
    # generate() refuses too (transformers checks the assistant's vocab_size before our hook runs)
    with pytest.raises(ValueError):
        other.generate(make_prompt(4), assistant_model=drafter, max_new_tokens=4, do_sample=False)


def test_batch_size_above_one_is_rejected_by_our_generator():
    target = build_target("qwen3")
    drafter = build_drafter(target, "dflash", True)
    ids = torch.cat([make_prompt(6), make_prompt(6, seed=99)], dim=0)
    with pytest.raises(ValueError, match="batch size 1") as err:
        target.generate(ids, assistant_model=drafter, max_new_tokens=5, do_sample=False)
    assert "hf_carryover" in str(err.value) and "batch of 2" in str(err.value)
    # the generator itself enforces it as well
    with pytest.raises(ValueError, match="batch size 1"):
        CarryoverCandidateGenerator(drafter, target, target.generation_config, input_ids=ids)


def test_unknown_drafter_type():
    with pytest.raises(ValueError, match=r"Unknown drafter_type 'eagle'.*dflash.*markov"):
        DrafterConfig(drafter_type="eagle", mask_token_id=0)
    target = build_target("llama")
    with pytest.raises(ValueError, match="Unknown drafter_type"):
        Drafter.from_target(target, drafter_type="medusa")


def test_block_size_too_small():
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig(block_size=1, mask_token_id=0)


def test_missing_mask_token_config():
    config = DrafterConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=1, mask_token_id=None,
                           learned_mask_embedding=False)
    with pytest.raises(ValueError, match="mask_token_id.*learned_mask_embedding"):
        Drafter(config)
    # either one is enough
    Drafter(DrafterConfig(**{**config.to_dict(), "mask_token_id": 3}))
    Drafter(DrafterConfig(**{**config.to_dict(), "learned_mask_embedding": True}))


@pytest.mark.parametrize("bad", [[6], [5], [-1], [0, 2, 9]])
def test_target_layer_ids_out_of_range(bad):
    target = build_target("llama", num_layers=6)
    with pytest.raises(ValueError, match="out of range for a 6-layer target"):
        Drafter.from_target(target, target_layer_ids=bad, num_hidden_layers=1)


def test_second_to_last_layer_is_allowed():
    target = build_target("llama", num_layers=6)
    drafter = Drafter.from_target(target, target_layer_ids=[4], num_hidden_layers=1, mask_token_id=VOCAB - 1)
    assert drafter.config.target_layer_ids == [4]


def test_unbound_drafter_raises_runtime_error():
    target = build_target("llama")
    drafter = Drafter(build_drafter(target, "markov", True).config)  # same config, never bound
    with pytest.raises(RuntimeError, match="not bound to a target"):
        drafter.embed_block(torch.tensor([[1]]))
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.lm_logits(torch.zeros(1, 2, 32))
    # generate() binds it: afterwards it works
    ids = make_prompt(5)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=6, do_sample=False))


def test_rebinding_follows_replaced_target_parts():
    """A drafter bound to a target must not keep using that target's old embedding / LM head once they are
    replaced (or when a new target reuses a freed target's `id()`): binding is re-checked, not cached by id."""
    target = build_target("llama")
    drafter = build_drafter(target, "dflash", True)
    new_head = torch.nn.Linear(32, VOCAB, bias=False)
    new_embed = torch.nn.Embedding(VOCAB, 32)
    with torch.no_grad():
        new_head.weight.copy_(target.get_output_embeddings().weight)
        new_embed.weight.copy_(target.get_input_embeddings().weight)
    target.set_output_embeddings(new_head)
    target.set_input_embeddings(new_embed)
    ids = make_prompt(5)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))
    assert drafter._target_parts["lm_head"] is new_head
    assert drafter._target_parts["embed"] is new_embed
    # simulated id reuse: same id recorded, parts of another (incompatible) target -> the fingerprint check runs
    other = build_target("qwen3")
    drafter._target_parts = {**drafter._target_parts, "target_id": id(other)}
    with pytest.raises(ValueError, match="fingerprint"):
        drafter.bind_target(other)


def test_engine_refuses_bad_prompts_by_name():
    """The engine's prompts and sampling arguments are checked before anything runs: each error names the argument,
    the prompt and the value (they used to surface inside a round as a reshape, embedding or index error)."""
    from hf_carryover.engine.engine import SpeculativeEngine

    target = build_target("llama")
    engine = SpeculativeEngine(target, build_drafter(target, "dflash", True), max_len=64)
    ok = make_prompt(6)[0].tolist()
    cases = [
        ([ok, []], r"prompts\[1\] is empty"),
        ([ok, [3, VOCAB]], rf"prompts\[1\] holds token id {VOCAB}, outside the target's vocabulary of {VOCAB}"),
        ([[-1, 3]], r"prompts\[0\] holds token id -1"),
        (ok, r"prompts\[0\] is int, not a sequence of token ids"),  # one flat prompt: ambiguous, so refused
        (torch.tensor(ok), r"a tensor of prompts is \[batch, length\], got shape \(6,\)"),
        ([torch.tensor([ok])], r"prompts\[0\]: a 1-D sequence of token ids, got a tensor of shape \(1, 6\)"),
        ([], "at least one prompt"),
        ("hello", "a list of token-id lists"),
    ]
    for prompts, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.generate(prompts, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_new_tokens=0: at least 1"):
        engine.generate([ok], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"temperature=0.0 with do_sample=True"):
        engine.generate([ok], max_new_tokens=4, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match=rf"draft tree with rank {VOCAB}: the drafter ranks {VOCAB} tokens"):
        engine.generate([ok], max_new_tokens=4, tree=[[0], [VOCAB]])
    # what is accepted: a [batch, length] tensor is its rows, 1-D tensors are prompts, greedy ignores temperature=0
    rows = make_prompt(6).repeat(2, 1)
    want = engine.generate(rows.tolist(), max_new_tokens=5)
    assert engine.generate(rows, max_new_tokens=5) == want
    assert engine.generate(list(rows), max_new_tokens=5, temperature=0.0) == want
    assert engine.generate(rows.numpy(), max_new_tokens=5) == want  # NumPy arrays too
