"""The graded speculation policy (worker/engines/speculation/graded.py), prompt lookup's: each proposal
judged by the length of the match it continues, each grade's acceptance learnt from every guess, the
ones a pass verified and the ones the rows' own tokens settled. Exactness on the engine is
tests/test_speculative.py's (its prompt-lookup rows run this policy)."""

from __future__ import annotations

from typing import Optional

import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from worker.engines.base import SamplingParams, SequenceSpec
from worker.engines.speculation import GradedSpeculator, speculator_for
from worker.engines.speculation.graded import GradeAcceptance
from worker.engines.speculation.ngram import NgramDrafter
from worker.engines.speculation.pass_cost import Call
from worker.engines.speculation.speculator import StepPlan

GREEDY_MATCH_OF_3, GREEDY_MATCH_OF_1 = (3, True), (1, True)


class Row:
    """What the policy reads of a decoding row (speculator.py's `Row`)."""

    def __init__(self, uid: str, tokens: list[int], temperature: float = 0.0) -> None:
        self.spec = SequenceSpec(uid=uid, prompt_token_ids=tokens[:-1], max_tokens=100,
                                 sampling=SamplingParams(temperature=temperature))
        self.prompt, self.generated, self.constraint = tokens[:-1], tokens[-1:], None


def long_match(uid: str, temperature: float = 0.0) -> Row:
    """Its last three tokens occurred before, followed by 4, 5, 6, 7."""
    return Row(uid, [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3], temperature)


def short_match(uid: str) -> Row:
    """Only its last token occurred before, followed by 20, 21, 22, 23."""
    return Row(uid, [3, 20, 21, 22, 23, 8, 9, 3])


def taught(speculator: GradedSpeculator) -> GradedSpeculator:
    """Matches of 3 tokens were accepted whole, matches of 1 never."""
    for _ in range(20):
        speculator.grades.record(GREEDY_MATCH_OF_3, 4, 4)
        speculator.grades.record(GREEDY_MATCH_OF_1, 4, 0)
    return speculator


def lookup(pass_cost: float) -> GradedSpeculator:
    speculator = speculator_for(NgramDrafter(), max_k=4, pass_cost=pass_cost)
    assert isinstance(speculator, GradedSpeculator)
    return speculator


def test_a_grade_learns_the_chance_that_a_proposed_token_is_accepted_after_those_before_it():
    grades = GradeAcceptance()
    assert grades.chance("new") == 0.5  # the prior
    grades.record("half", 4, 2)  # 2 accepted of 3 tried: the third was rejected, the fourth never tried
    assert grades.chance("half") == pytest.approx(3 / 5)
    grades.record("half", 0, 0)  # nothing proposed says nothing
    assert grades.chance("half") == pytest.approx(3 / 5)
    for _ in range(30):
        grades.record("hit", 4, 4)
        grades.record("miss", 4, 0)
    hit = grades.chance("hit")
    assert hit > 0.95 and grades.chance("miss") < 0.05
    assert grades.expected("hit", 3) == pytest.approx(hit + hit ** 2 + hit ** 3)


def test_a_long_match_is_worth_a_pass_and_a_short_one_is_not():
    speculator = taught(lookup(pass_cost=2.0))
    plan = speculator.plan([long_match("long")], slot_count=1)
    assert plan is not None and plan.width == 5 and plan.rows[0].draft == [4, 5, 6, 7]
    assert speculator.plan([short_match("short")], slot_count=1) is None


def test_a_sampled_rows_grade_is_learnt_apart_from_a_greedy_rows():
    speculator = taught(lookup(pass_cost=2.0))
    sampled = long_match("sampled", temperature=0.8)
    # (3, False) is at its prior: 0.94 tokens expected, short of the pass's extra cost of one step
    assert speculator.plan([sampled], slot_count=1) is None


def test_a_guess_that_no_pass_verifies_is_settled_by_the_tokens_the_row_makes():
    speculator = lookup(pass_cost=2.0)
    row = short_match("short")
    speculator.step_began([row], slot_count=1)  # guesses 20, 21, 22, 23
    assert speculator.width([row], 1) == 1  # 0.94 tokens expected at the prior: no pass for them
    row.generated += [20, 21]
    speculator.step_began([row], slot_count=1)
    assert speculator.probed == 0  # two of four made, all as guessed: not decided yet
    row.generated += [5]
    speculator.step_began([row], slot_count=1)
    assert (speculator.probed, speculator.probes_accepted) == (4, 2)
    assert speculator.grades.chance(GREEDY_MATCH_OF_1) == pytest.approx(3 / 5)
    assert speculator.proposed == 0  # (guesses are not verified proposals)


def test_wants_judges_each_row_by_its_latest_guess():
    """Before the step in flight is read back, a pass is wanted where the rows' latest guesses,
    made from the tokens read back so far, are worth one."""
    speculator = taught(lookup(pass_cost=2.0))
    long, short = long_match("long"), short_match("short")
    assert not speculator.wants([long], slot_count=1)  # no guess yet
    speculator.step_began([long, short], slot_count=2)
    assert speculator.wants([long], slot_count=1) and not speculator.wants([short], slot_count=1)


def test_a_pass_must_be_expected_to_add_twice_its_extra_cost_to_the_batch():
    """At 8 rows and a pass cost of 1.25, a pass must be expected to add 2 x 0.25 x 8 = 4 tokens:
    one row's four well-graded tokens (3.9 expected) are not enough, two rows' are."""
    speculator = taught(lookup(pass_cost=1.25))
    others = [short_match("short")] + [Row(f"n{i}", [10 + i, 20 + i]) for i in range(5)]  # (these match nothing)
    assert speculator.plan([long_match("a"), Row("x", [1, 2])] + others, slot_count=8) is None
    plan = speculator.plan([long_match("a"), long_match("b")] + others, slot_count=8)
    assert plan is not None and plan.width == 5
    assert {r.seq.spec.uid for r in plan.rows} == {"a", "b", "short"}  # every guess rides along


def moved_ahead(row: Row, by: int = 6) -> Row:
    """The same tokens, `by` more of them generated (fewer in the prompt): the same guess, further ahead."""
    row.prompt, row.generated = row.prompt[:-by], row.prompt[-by:] + row.generated
    return row


def batch_with_rows_ahead(ahead: int, by: int) -> list[Row]:
    """A batch of 8: `ahead` well-graded rows `by` tokens ahead of the rest, of which one matches a
    single token and the others nothing."""
    others = [short_match("short")] + [Row(f"n{i}", [10 + i, 20 + i]) for i in range(7 - ahead)]
    return [moved_ahead(long_match(f"a{i}"), by) for i in range(ahead)] + others


def plan_with_rows_ahead(speculator: GradedSpeculator, ahead: int, by: int, backlog: bool = False) -> Optional[StepPlan]:
    """`batch_with_rows_ahead`'s plan at a pass cost of 1.25."""
    rows = batch_with_rows_ahead(ahead, by)
    speculator.step_began(rows, slot_count=8, backlog=backlog)
    return speculator.plan(rows, slot_count=8)


def test_with_nothing_waiting_a_pass_that_only_rows_well_ahead_gain_from_is_not_run():
    """A batch waits for its slowest row: where no request waits for a slot, a token added to a row
    more than a pass's reach (k) ahead of the row with the most left counts for the share of rows
    that end early, a quarter before any ended. The two well-graded rows that pay for a pass at 8
    rows above no longer do from 6 tokens ahead; they still do where requests wait, or 4 tokens ahead."""
    def plan(ahead_by: int, backlog: bool) -> Optional[StepPlan]:
        return plan_with_rows_ahead(taught(lookup(pass_cost=1.25)), ahead=2, by=ahead_by, backlog=backlog)

    assert lookup(pass_cost=1.25).endings.batch_share(batch_with_rows_ahead(2, 6)) == 0.25
    assert plan(ahead_by=6, backlog=False) is None
    assert plan(ahead_by=6, backlog=True) is not None and plan(ahead_by=4, backlog=False) is not None


def end_rows(speculator: GradedSpeculator, count: int, early: bool, like: list[Row]) -> None:
    """Ends `count` rows like each of `like` (its prompt's length and max_tokens: its kind), early or at
    their length."""
    for template in like:
        for i in range(count):
            row = Row(f"ended{i}", [0] * (len(template.prompt) + 1))
            if not early:
                row.generated = [0] * row.spec.max_tokens
            speculator.ended(row)


def test_rows_well_ahead_count_for_the_share_of_rows_that_ended_before_their_length():
    """Where rows run to their max_tokens, the row a batch waits for is the one with the most left, and
    tokens added to rows well ahead are worth nothing to the batch; where rows end early, any row may
    be the last. Two rows 6 ahead are worth a pass once most rows ended early; four rows, worth one at
    the prior's quarter, are not once most rows ran to their length."""
    speculator, batch = taught(lookup(pass_cost=1.25)), batch_with_rows_ahead(4, 6) + batch_with_rows_ahead(2, 6)
    assert plan_with_rows_ahead(speculator, ahead=4, by=6) is not None
    end_rows(speculator, 30, early=True, like=batch)
    assert speculator.endings.batch_share(batch) > 0.9
    assert plan_with_rows_ahead(speculator, ahead=2, by=6) is not None
    end_rows(speculator, 60, early=False, like=batch)
    assert speculator.endings.batch_share(batch) < 0.1
    assert plan_with_rows_ahead(speculator, ahead=4, by=6) is None
    assert plan_with_rows_ahead(speculator, ahead=4, by=6, backlog=True) is not None


def test_where_rows_run_to_their_length_a_pass_must_shorten_the_batchs_wait():
    """Once rows run to their max_tokens, a closed batch waits for the row with the most left: a pass
    takes a step off that wait only if every row within reach of it gains. Two well-graded rows of 8,
    worth a pass were any row to end early (the test above), are not; eight are, and so are seven
    beside a row 6 tokens ahead that proposes nothing."""
    def plan(rows: list[Row]) -> Optional[StepPlan]:
        speculator = taught(lookup(pass_cost=1.25))
        end_rows(speculator, 20, early=False, like=rows)
        speculator.step_began(rows, slot_count=8)
        return speculator.plan(rows, slot_count=8)

    nothing = [Row(f"n{i}", [10 + i, 20 + i]) for i in range(6)]
    assert plan([long_match("a"), long_match("b")] + nothing) is None
    every = plan([long_match(f"a{i}") for i in range(8)])
    assert every is not None and every.width == 5
    assert plan([moved_ahead(Row("x", [30, 31, 32, 33, 34, 35, 36, 37]))] + [long_match(f"a{i}") for i in range(7)]) is not None


def test_a_worker_learns_how_each_kind_of_row_ends_apart():
    """Rows of short prompts ran to their length and rows of long documents ended early: a batch of the
    first kind is still judged by its wait (two well-graded rows of 8 are no pass), however many
    documents ended early since. One share for all rows lay between the two, and the pass ran."""
    def chat_batch() -> list[Row]:
        nothing = [Row(f"n{i}", list(range(100 + 10 * i, 111 + 10 * i))) for i in range(6)]  # (prompts of 10)
        return [long_match("a"), long_match("b")] + nothing

    def plan(chat_early: bool) -> Optional[StepPlan]:
        speculator, rows, documents = taught(lookup(pass_cost=1.25)), chat_batch(), [Row("doc", list(range(200, 300)))]
        end_rows(speculator, 30, early=chat_early, like=rows[:1])
        end_rows(speculator, 30, early=True, like=documents)
        assert speculator.endings.batch_share(documents) > 0.9
        speculator.step_began(rows, slot_count=8)
        return speculator.plan(rows, slot_count=8)

    assert plan(chat_early=False) is None
    assert plan(chat_early=True) is not None


def test_a_verified_proposal_teaches_its_grade_once():
    speculator = lookup(pass_cost=1.25)  # 0.94 tokens expected at the prior pay for a pass
    row = long_match("long")
    speculator.step_began([row], slot_count=1)
    plan = speculator.plan([row], slot_count=1)
    assert plan is not None and plan.rows[0].draft == [4, 5, 6, 7]
    speculator.outcome(row, 4, 1)
    assert speculator.grades.chance(GREEDY_MATCH_OF_3) == pytest.approx(2 / 4)  # 1 kept of 2 tried
    row.generated += [4, 8]
    speculator.step_began([row], slot_count=1)  # its guess went into the pass: nothing left to settle
    assert speculator.probed == 0 and (speculator.proposed, speculator.accepted) == (4, 1)


def test_an_ended_row_and_a_reset_leave_nothing_behind():
    speculator = taught(lookup(pass_cost=2.0))
    row = long_match("long")
    speculator.step_began([row], slot_count=1)
    speculator.forget("long")
    assert speculator.tracked_rows == 0 and speculator.width([row], 1) == 1
    speculator.reset()  # new weights: what was learnt of the grades no longer holds
    assert speculator.grades.chance(GREEDY_MATCH_OF_3) == 0.5


def test_a_row_decoding_alone_needs_its_pass_paid_for_once():
    """The margin is for the rows a batch waits on: a row alone has no other. At a pass cost of 1.5,
    a proposal at the prior (0.94 tokens expected) pays for the pass alone, not in a batch of two."""
    speculator = lookup(pass_cost=1.5)
    plan = speculator.plan([long_match("alone")], slot_count=1)
    assert plan is not None and plan.width == 5
    assert speculator.plan([long_match("a"), Row("x", [1, 2])], slot_count=2) is None


def test_nobody_guesses_where_no_pass_could_pay():
    """At 32 slots a pass verifies one proposed token a row: at a pass cost of 2 it could not pay even
    were every row's token accepted, so no row guesses (the host's work stays that of a decode step);
    at a cost of 1.25 it could."""
    for cost, guessing in ((2.0, False), (1.25, True)):
        speculator = taught(lookup(pass_cost=cost))
        rows = [long_match(f"r{i}") for i in range(32)]
        speculator.step_began(rows, slot_count=32)
        assert speculator.wants(rows, slot_count=32) is guessing


def early_reads(speculator: GradedSpeculator, look_s: float, step_s: float = 0.010) -> None:
    """Decode steps of `step_s` at one slot, then three declined looks (the step in flight read back
    early, no pass run) whose calls took `look_s` each."""
    now = 0.0
    for _ in range(4):
        speculator.costs.call(now, Call.STEP, 1)
        now += step_s
    for _ in range(3):
        speculator.costs.call(now, Call.DECLINED, 1)
        speculator.costs.call(now + look_s, Call.STEP, 1)
        now += look_s + step_s


@pytest.mark.parametrize("look_s,judged_as_made", [(0.012, True), (0.015, False)])
def test_a_dear_early_read_judges_a_guess_by_what_is_left_after_the_step_in_flight(look_s, judged_as_made):
    """A sampled row's long match at its grade's prior is expected to add 0.94 tokens as guessed, 0.44
    once the step in flight must have made its first token; a pass of 1.5 steps needs 0.5. Where an
    early read-back was measured to cost 0.2 of a step, the guess is judged as made; where it cost
    0.5, by what is left after the step in flight. With nothing in flight, always as made."""
    speculator = speculator_for(NgramDrafter(), max_k=4, pass_cost=1.5, measure_cost=True)
    row = long_match("sampled", temperature=0.8)
    for _ in range(3):  # passes wait for a step timed at their slot count
        speculator.costs.step_took(1, 0.010)
    speculator.step_began([row], slot_count=1)
    assert speculator.wants([row], 1, in_flight=True)  # the early read's cost not measured yet
    early_reads(speculator, look_s)
    assert speculator.costs.early_read_cost(1) == pytest.approx(look_s / 0.010 - 1)
    assert speculator.wants([row], 1, in_flight=True) == judged_as_made
    assert speculator.wants([row], 1, in_flight=False)


@pytest.mark.parametrize("lead", [0, 1, 2])
def test_the_gain_at_each_width_sums_each_proposals_expected_tokens(lead: int) -> None:
    """What `_width_for` weighs at width w: each proposal's expected tokens up to w - 1 of them, past
    its `lead` (GradeAcceptance.expected), times its row's weight, summed; in one sweep a proposal."""
    speculator = taught(GradedSpeculator(NgramDrafter(), pass_cost=2.0))
    proposals = [(1.0, 4, GREEDY_MATCH_OF_3), (0.25, 2, GREEDY_MATCH_OF_1), (1.0, 1, (2, False)), (0.5, 3, GREEDY_MATCH_OF_3)]
    gains = speculator._gains(proposals, lead)
    assert len(gains) == max(0, 4 - lead)
    for width in range(2, 2 + len(gains)):
        assert gains[width - 2] == pytest.approx(sum(
            weight * speculator.grades.expected(grade, max(0, min(length - lead, width - 1)), lead)
            for weight, length, grade in proposals))
    assert gains == sorted(gains) and (not gains or gains[0] > 0)
