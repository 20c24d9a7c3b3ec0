"""A verification pass's cost as the engine measures it while serving (worker/engines/speculation/
pass_cost.py): from call starts, so the overlap a pass gives up (the step read back before it, the
restart after it) and the caller's own time between calls count. The arithmetic on timelines
written out here, and the calls a real compiled engine reports with and without overlap."""

from __future__ import annotations

from typing import Sequence

import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load

from tests.reference import run_all
from tests.test_speculative import looping_prompt
from worker.engines.compiled import CompiledEngine
from worker.engines.speculation import DraftRow, speculator_for
from worker.engines.speculation.ngram import NgramDrafter
from worker.engines.speculation.pass_cost import FORGET_AFTER, Call, PassCosts
from worker.scheduler import BatchScheduler

STEP = 0.010  # seconds between the starts of two plain steps


def steady(costs: PassCosts, start: float, count: int, slots: int = 8) -> float:
    """`count` plain steps from `start`, one every STEP: the time the next call starts."""
    for i in range(count):
        costs.call(start + i * STEP, Call.STEP, slots)
    return start + count * STEP


def test_a_pass_costs_its_call_and_the_restart_less_the_step_the_restart_launched():
    """With overlap, a pass's call reads the step in flight back first and the call after it
    restarts the overlap, launching a decode step and reading none back: the pass costs from its
    start to the start of the step after the restart, less one step for the step the restart launched."""
    costs = PassCosts(prior=2.0)
    now = steady(costs, 0.0, 5)
    for _ in range(3):
        costs.call(now, Call.PASS, 8, width=5)
        costs.call(now + 0.025, Call.RESTART, 8)  # the pass's call took 2.5 steps, the restart 0.8
        now = steady(costs, now + 0.033, 2)
    assert costs.cost(8, 5) == pytest.approx((0.033 - STEP) / STEP)  # 2.3 steps
    for _ in range(3):  # after an admission nothing is in flight to read back; the restart still launches a step
        costs.call(now, Call.OTHER, 8)
        costs.call(now + 0.040, Call.PASS, 8, width=4)
        costs.call(now + 0.060, Call.RESTART, 8)
        now = steady(costs, now + 0.070, 2)
    assert costs.cost(8, 4) == pytest.approx((0.030 - STEP) / STEP)
    assert costs.cost(8, 6) == 2.0 and costs.cost(4, 5) == 2.0  # a wider width, another slot count: the prior


def test_a_width_not_measured_below_one_that_is_costs_its_share_of_that_ones_extra_cost():
    """Width 5 measured at 2.6 steps: width 3, never run, is taken at 1 + 1.6 x 2 / 4 = 1.8 (a prior of
    2 would keep it from ever running, so from ever being measured), width 2 at 1.4; once width 3 is
    measured it is its own, and width 2 follows it; never above the prior."""
    costs = PassCosts(prior=2.0)
    for _ in range(3):
        costs.step_took(8, STEP)
    assert costs.cost(8, 3) == 2.0  # nothing measured yet
    for _ in range(3):
        costs.pass_took(8, 5, 0.026)
    assert costs.cost(8, 3) == pytest.approx(1.8) and costs.cost(8, 2) == pytest.approx(1.4)
    for _ in range(3):
        costs.pass_took(8, 3, 0.012)
    assert costs.cost(8, 3) == pytest.approx(1.2) and costs.cost(8, 2) == pytest.approx(1.1)
    assert costs.cost(8, 4) == 2.0  # 1 + 1.6 x 3 / 4 = 2.2 from width 5, held at the prior
    assert costs.cost(4, 3) == 2.0  # another slot count measures its own


def test_passes_back_to_back_and_without_overlap_pay_no_restart():
    """A pass straight before a pass has no restart: it costs its own interval. Without overlap every
    call reads its own step back: a pass costs its interval too."""
    chained = PassCosts(prior=2.0)
    now = steady(chained, 0.0, 4)
    chained.call(now, Call.PASS, 8, width=3)
    for i in range(1, 5):
        chained.call(now + 0.02 * i, Call.PASS, 8, width=3)
    steady(chained, now + 0.1, 1)
    assert chained.cost(8, 3) == pytest.approx(2.0)  # 0.02 s each
    plain = PassCosts(prior=3.0)
    now = steady(plain, 0.0, 4)
    for _ in range(3):
        plain.call(now, Call.PASS, 8, width=3)
        now = steady(plain, now + 0.014, 1)
    assert plain.cost(8, 3) == pytest.approx(1.4)


def test_an_admission_or_an_unmeasured_step_leaves_a_pass_out():
    """A pass whose restart an admission hid, or one before the step's time is known, is not
    timed; nor is the interval of a call that was not a plain step."""
    costs = PassCosts(prior=2.0)
    costs.call(0.0, Call.PASS, 8, width=3)  # no step measured yet
    now = steady(costs, 0.05, 4)
    for _ in range(3):
        costs.call(now, Call.PASS, 8, width=3)
        costs.call(now + 0.5, Call.OTHER, 8)  # an admission right after: its call launched the restart
        now = steady(costs, now + 0.6, 1)
        costs.call(now, Call.OTHER, 8)  # a long admission after a step: not the step's time
        now += 0.5
    assert costs.cost(8, 3) == 2.0
    assert costs.cost(8, 2) == 2.0
    steady(costs, now, 2)
    costs.call(now + 2 * STEP, Call.PASS, 8, width=2)
    for i in range(3):
        costs.call(now + 3 * STEP + i * 0.012, Call.PASS, 8, width=2)
    assert costs.cost(8, 2) == pytest.approx(1.2)  # the steps' median stayed at STEP


def test_a_setting_is_never_measured():
    costs = PassCosts(prior=1.5, measure=False)
    now = steady(costs, 0.0, 5)
    for _ in range(4):
        costs.call(now, Call.PASS, 8, width=3)
        now = steady(costs, now + 0.1, 1)
    assert costs.cost(8, 3) == 1.5


class EveryOtherFour(NgramDrafter):
    """Prompt lookup that proposes only at four lengths of a row's tokens in eight, so that passes and
    plain steps alternate (still deterministic in the row's tokens, as verification requires)."""

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        proposals = super().propose(rows)
        return [p if len(row.tokens) // 4 % 2 == 0 else [] for row, p in zip(rows, proposals, strict=True)]


class RecordingCosts(PassCosts):
    def __init__(self) -> None:
        super().__init__(prior=1.0)
        self.kinds: list[Call] = []

    def call(self, started: float, kind: Call, slots: int, width: int = 0) -> None:
        self.kinds.append(kind)
        super().call(started, kind, slots, width)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_engine_reports_a_pass_its_restart_and_its_steps(tiny_model_dir, overlap):
    """A real compiled engine serving looping prompts with prompt lookup at half its lengths (a pass
    cost of 1, so passes run) reports its calls: with overlap each timed pass that is not followed by another pass is
    followed by a restart, and the costs get measured; without overlap no call is a restart."""
    model, tokenizer = load(tiny_model_dir)
    speculator = speculator_for(EveryOtherFour(), max_k=4, pass_cost=1.0)
    speculator.costs = costs = RecordingCosts()
    engine = CompiledEngine(model, tokenizer, max_num_seqs=4, speculator=speculator, overlap=overlap)
    requests = {f"r{i}": {"prompt_token_ids": looping_prompt(i, 24), "max_tokens": 60, "temperature": 0,
                          "ignore_eos": True} for i in range(4)}
    results = run_all(BatchScheduler(engine, max_num_seqs=4), requests)
    assert all(r.status == "finished" for r in results.values())
    kinds = costs.kinds
    assert Call.PASS in kinds and Call.STEP in kinds, kinds
    after_pass = [b for a, b in zip(kinds, kinds[1:]) if a is Call.PASS]
    if overlap:
        assert set(after_pass) <= {Call.PASS, Call.RESTART, Call.OTHER} and Call.RESTART in after_pass, kinds
    else:
        assert Call.RESTART not in kinds, kinds
    assert costs._steps and costs._passes, kinds


def test_a_declined_look_costs_its_interval_less_a_step():
    """The step in flight read back early for a pass that then did not pay: the call delivers one
    step's tokens, so what the early read cost is its interval less one step."""
    costs = PassCosts(prior=2.0)
    now = steady(costs, 0.0, 4)
    for _ in range(2):
        costs.call(now, Call.DECLINED, 8)
        now = steady(costs, now + 0.017, 1)
    assert costs.early_read_cost(8) is None  # two looks: not measured yet
    costs.call(now, Call.DECLINED, 8)
    steady(costs, now + 0.017, 1)
    assert costs.early_read_cost(8) == pytest.approx(0.7) and costs.early_read_cost(4) is None
    assert costs.cost(8, 2) == 2.0  # looks are not passes


def test_what_was_learnt_lists_each_measured_shape_and_early_read():
    """The bench reports this: shapes with too few passes, and slot counts with too few looks, are left out."""
    costs = PassCosts(prior=2.0)
    now = steady(costs, 0.0, 4)
    for i in range(4):
        costs.call(now, Call.PASS, 8, width=5 if i < 3 else 3)  # three passes of width 5, one of width 3
        costs.call(now + 0.025, Call.RESTART, 8)
        now = steady(costs, now + 0.035, 1)
    for _ in range(3):
        costs.call(now, Call.DECLINED, 8)
        now = steady(costs, now + 0.012, 1)
    assert costs.learnt() == {"pass 8x5": pytest.approx(2.5), "early read 8": pytest.approx(0.2)}


def test_a_draft_models_time_is_taken_off_the_call_it_ran_in_and_priced_per_position():
    """A draft model proposing for a pass takes its seconds off the pass's call: the pass costs its
    verification, and each of its width - 1 proposed positions the draft's median time per position
    over a step's, at a slot count not measured as at the nearest one measured. Unlike a width's
    timings, the draft's are kept: they are the models' and the device's."""
    costs = PassCosts(prior=2.0)
    now = steady(costs, 0.0, 4)
    for _ in range(3):
        costs.drafted(8, 4, 0.020)  # 4 positions in 2 steps' time, before the pass's call reports
        costs.call(now, Call.PASS, 8, width=5)
        costs.call(now + 0.045, Call.RESTART, 8)  # the restart launched a step: the pass took 2.5 steps
        now = steady(costs, now + 0.055, 2)
    assert costs.draft_cost(8) == pytest.approx(0.5) and costs.draft_cost(4) == pytest.approx(0.5)  # (its nearest)
    assert costs.cost(8, 5) == pytest.approx(2.5 + 4 * 0.5)
    assert costs.learnt() == {"pass 8x5": pytest.approx(2.5), "draft position 8": pytest.approx(0.5)}
    steady(costs, now, FORGET_AFTER + 1)
    assert costs.draft_cost(8) == pytest.approx(0.5) and costs.cost(8, 5) == pytest.approx(2.0 + 4 * 0.5)

