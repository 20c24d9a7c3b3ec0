"""The rule that decides whether the next prefill batch waits for the last one's first tokens."""

from __future__ import annotations

from types import SimpleNamespace

from worker.engines.prefill_pacing import PrefillPacing


def window(prompt_tokens: int = 0, prompt_time: float = 0.0, decode_time: float = 0.0, steps: int = 0):
    return SimpleNamespace(prompt_tokens=prompt_tokens, prompt_time=prompt_time, decode_time=decode_time,
                           generation_steps=steps)


def test_holds_until_both_a_prefill_and_a_decode_step_were_seen() -> None:
    pacing = PrefillPacing()
    assert pacing.hold_for_first_tokens(1)
    pacing.note(window(prompt_tokens=512, prompt_time=0.001))
    assert pacing.hold_for_first_tokens(1)
    pacing.note(window(decode_time=0.5, steps=1))
    assert not pacing.hold_for_first_tokens(1)


def test_holds_while_a_prefill_outlasts_a_step_for_each_waiting_batch() -> None:
    pacing = PrefillPacing()
    pacing.note(window(prompt_tokens=512, prompt_time=1.3))  # a CPU: one prefill call of eight prompts
    pacing.note(window(decode_time=0.2, steps=1))
    assert pacing.hold_for_first_tokens(3)
    assert not pacing.hold_for_first_tokens(7)  # seven batches would each wait a 0.2 s step
    pacing.note(window(prompt_tokens=1024, prompt_time=0.013))  # a small model: 13 ms a prefill
    assert not pacing.hold_for_first_tokens(0)  # counted as one batch
    pacing.note(window(decode_time=0.003, steps=1))
    assert pacing.hold_for_first_tokens(1)
    assert not pacing.hold_for_first_tokens(31)


def test_a_decode_step_is_read_only_from_calls_without_a_prefill() -> None:
    pacing = PrefillPacing()
    pacing.note(window(decode_time=0.02, steps=1))
    pacing.note(window(prompt_tokens=64, prompt_time=0.05, decode_time=0.001, steps=1))
    assert (pacing.prefill_s, pacing.step_s) == (0.05, 0.02)
    pacing.note(window(decode_time=0.09, steps=3))
    assert pacing.step_s == 0.03
    pacing.note(window())  # an empty call changes nothing
    assert (pacing.prefill_s, pacing.step_s) == (0.05, 0.03)
