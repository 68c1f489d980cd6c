"""Plain decoding steps on the attention kernel at short contexts and on SDPA at long ones
(`SpeculativeEngine(attention_one_row_keys=N)`).

Why: a plain decoding step has one query row per batch row. SDPA's cost at one row hardly depends on the keys in
use; the Triton kernel's (`triton_attention.py`) grows with them. On the H200 (`examples/results/h200-2026-12-05g`,
batch 1, bf16, compiled with frozen weights), one-row steps on the kernel against SDPA were:
  * 6.8 % faster over 20 MT-Bench answers of up to 256 tokens (about 200 keys in use on average);
  * even (+0.7 %) over 800 tokens after short ShareGPT prompts (about 460);
  * 6.3 % slower over 1900 tokens (about 1010).
So a call can run its steps on the kernel while every row's keys in use are at most N, and on SDPA after that.
These are two captured (or compiled) variants of the same plain step, and the host picks one before each launch.

The host knows an upper bound on every row's keys in use without reading the device. A plain step adds at most one
token to a row, so a row that started (prefill or refill) with p prompt tokens L launches ago attends to at most
p + L + 1 keys in its next step. Both variants compute the same attention, so the choice changes speed, never the
output. A bound that is too high only keeps a step on SDPA.

"auto" (the engine's default) sets N = 512 for calls of up to 8 rows, where the engine's "auto" attention took the
kernel. 512 is where a line through the H200's per-step costs above crosses SDPA's (a fit through two points, about
510 keys). What the switch at 512 measured, end to end against SDPA for every one-row step (same settings, each pair
in one call):
  * batch 1, H200 (`examples/results/h200-2026-12-06`): 8.2 % faster on 20 MT-Bench answers (about 200 keys in use);
  * batch 1, H100 (`examples/results/h100-2026-12-05h`): 5.4 % faster on 20 MT-Bench answers, 4.1 % on 80 HumanEval
    answers (about 250), 0.5 % slower over 1900 tokens after short ShareGPT prompts (about 1010; a quarter of the
    steps on the kernel), where the kernel for every step had lost 6.3 % on the H200;
  * batch 8, H200, continuous batching over 80 MT-Bench prompts (h200-2026-12-06): 1.7 % faster, 86 % of the steps
    on the kernel.
  * batches of 2 and 4 rows, H100 (`examples/results/h100-2026-12-06`), continuous batching over 16 MT-Bench
    prompts: a launched step 2.9 % and 2.6 % cheaper (tok/s +1.0 % and -0.2 %: the bf16 texts differ, and so does
    how full the batch stayed).
Calls of more than 8 rows keep one-row steps on SDPA under "auto": at 16 rows (H100, 48 MT-Bench prompts, three
readings of each) the switch at 512 made a launched step 1.3-1.6 % dearer, though tok/s read 0.1-2.7 % higher from
fuller batches of other bf16 texts.
"""

from __future__ import annotations

from contextlib import contextmanager

from .attention import TRITON_SETTINGS


AUTO_KEYS = 512  # "auto": the keys bound (module docstring)
AUTO_MAX_ROWS = 8  # "auto": the largest call that switches (1, 2, 4, 8 rows paid, 16 did not; module docstring)


def resolve_keys(value, attention: str, auto_attention: bool, min_rows) -> tuple[int | None, int | None]:
    """`SpeculativeEngine(attention_one_row_keys=value)` checked against the engine's resolved `attention` and its
    `attention_min_rows` (None: unset) -> (the keys bound or None for off, the most rows of a call it holds for or
    None for every call).

    "auto" turns the switch on only where nothing asked otherwise: attention "auto" took the kernel (an engine named
    "triton" runs every one-row step on the kernel, SDPA has no kernel to switch to) and `attention_min_rows` is
    unset. A number asks for the switch at every batch size, and is refused where it cannot apply."""
    if isinstance(value, str) and value == "auto":
        on = auto_attention and attention == "triton" and min_rows is None
        return (AUTO_KEYS, AUTO_MAX_ROWS) if on else (None, None)
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"attention_one_row_keys={value!r}: a number of keys, at least 1 (None: off; 'auto': "
                         f"{AUTO_KEYS} for calls of up to {AUTO_MAX_ROWS} rows where attention 'auto' took the "
                         "kernel).")
    if attention != "triton":
        raise ValueError(f"attention_one_row_keys={value} switches one-row steps between the Triton kernel and SDPA, "
                         f"but this engine's attention is {attention!r} ('auto' takes the kernel for bf16/fp16 CUDA "
                         "targets with Triton installed)")
    if min_rows is not None and int(min_rows) < 2:
        raise ValueError(f"attention_one_row_keys={value} chooses the attention of one-row steps by their keys in use; "
                         f"attention_min_rows={min_rows} puts them all on the kernel. Leave attention_min_rows unset "
                         "(or 2 and more).")
    return value, None


class OneRowSwitch:
    """Counts launched plain steps and each row's start, and says whether the next step goes to the kernel."""

    def __init__(self, max_keys: int, prompt_lengths: list[int]):
        self.max_keys = max_keys
        self.launched = 0
        # per row: (prompt tokens, launches before its start), or None for a row with nothing to decode
        self.rows: list[tuple[int, int] | None] = [(n, 0) for n in prompt_lengths]
        self.kernel_steps = 0  # steps launched on the kernel this call (the rest went to SDPA)

    def start(self, row: int, prompt_length: int) -> None:
        """A row refilled with a prompt of `prompt_length` tokens (continuous batching)."""
        self.rows[row] = (prompt_length, self.launched)

    def stop(self, row: int) -> None:
        """A row whose output was read out: its keys no longer count until it is refilled."""
        self.rows[row] = None

    def keys_bound(self) -> int:
        """The most keys any row can attend to in the next step."""
        return max((p + self.launched - at + 1 for p, at in filter(None, self.rows)), default=0)

    def next_on_kernel(self) -> bool:
        """Whether the step about to be launched runs its attention on the kernel; counts it as launched."""
        on = self.keys_bound() <= self.max_keys
        self.launched += 1
        self.kernel_steps += on
        return on

    def can_start_on_kernel(self, prompt_lengths: list[int]) -> bool:
        """Whether a row starting on one of these prompts takes the kernel for its first step (the bound's rule at
        no launches): where none can, the call needs no kernel variant."""
        return min(prompt_lengths) + 1 <= self.max_keys


@contextmanager
def one_row_kernel():
    """The body traces, captures or runs one-row attention calls on the kernel.

    The attention function reads `TRITON_SETTINGS["min_rows"]` at each call (eagerly) or when it is traced
    (compiled; torch.compile guards on it, so each value gets its own compiled round). Outside the body the engine's
    own setting holds, which `attention_one_row_keys` leaves at 2 or more (SDPA for one-row calls)."""
    before = TRITON_SETTINGS["min_rows"]
    TRITON_SETTINGS["min_rows"] = 1
    try:
        yield
    finally:
        TRITON_SETTINGS["min_rows"] = before


__all__ = ["AUTO_KEYS", "AUTO_MAX_ROWS", "OneRowSwitch", "one_row_kernel", "resolve_keys"]
