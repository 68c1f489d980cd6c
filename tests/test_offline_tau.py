"""The offline T=0 replay reproduces the rounds of `target.generate(assistant_model=drafter)` exactly."""

import pytest
import torch

from hf_carryover import Drafter
from hf_carryover.evaluation.offline_tau import offline_rounds, tau_from_rounds
from hf_carryover.training.data import ResponseCollator
from hf_carryover.training.objectives import stage1_loss, stage2_loss
from test_training import tiny_target


def overfit(drafter, target, rollouts, steps=40):
    """A drafter that is right often (trained on the very rollouts), so rounds accept several tokens."""
    batch = ResponseCollator(0)([{"prompt_len": p, "input_ids": s} for p, s, _ in rollouts])
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for step in range(steps):
        fn = stage2_loss if drafter.config.carryover and step % 2 else stage1_loss
        loss, _ = fn(drafter, drafter, target, batch, num_anchors=32, generator=torch.Generator().manual_seed(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval()


@pytest.mark.parametrize("typ", ["dflash", "markov"])
@pytest.mark.parametrize("carryover", [False, True])
@pytest.mark.parametrize("eos", [63, 58])  # 63 is never emitted; 58 ends several rollouts mid-way
def test_offline_rounds_equal_online(typ, carryover, eos):
    target = tiny_target(seed=5, init=0.3)
    torch.manual_seed(2)
    drafter = Drafter.from_target(target, drafter_type=typ, carryover=carryover, block_size=4,
                                  num_hidden_layers=2, mask_token_id=5)
    rollouts, online = [], []
    g = torch.Generator().manual_seed(0)
    for n in range(6):
        prompt = torch.randint(1, 58, (1, 3 + n), generator=g)  # no EOS (58) in prompts: 5.17 assisted decoding
        # stops at once when the prompt itself ends in EOS (a transformers quirk, not under test here)
        max_new = 12 + 5 * n
        ref = target.generate(prompt, max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=eos)
        rollouts.append((prompt.shape[1], ref[0].tolist(), max_new))
    overfit(drafter, target, rollouts)
    for p, seq, max_new in rollouts:
        prompt = torch.tensor([seq[:p]])
        spec = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new, do_sample=False,
                               pad_token_id=0, eos_token_id=eos)
        assert spec[0].tolist() == seq
        online.append([(r["accepted"], r["proposals"]) for r in drafter.last_candidate_generator.rounds])
    for max_new in sorted({m for _, _, m in rollouts}):
        group = [(i, (p, s)) for i, (p, s, m) in enumerate(rollouts) if m == max_new]
        replay = offline_rounds(target, drafter, [x for _, x in group], max_new, eos_token_ids=[eos])
        for (i, _), rounds in zip(group, replay):
            assert list(zip(rounds["accepted"], rounds["proposals"])) == online[i], i
    if eos == 58:
        assert sum(s[-1] == 58 for _, s, _ in rollouts) >= 2  # the EOS case really happens
    accepted = [a for rounds in online for a, _ in rounds]
    assert sum(a >= 2 for a in accepted) >= 3, accepted  # multi-token accepts, so the replay is really tested


def test_tau_from_rounds():
    assert tau_from_rounds([{"accepted": [0, 2]}, {"accepted": [1]}]) == pytest.approx(6 / 3)
