"""`mlxq bench --scenario speculative`: the report's shape, and that its ratios and acceptance are
computed from the measured runs (never a timing assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxq.bench.scenario_speculative import all_equal_baseline, compare, metrics, speculation_of
from mlxq.bench.spec_workloads import PASSAGES, grounded_messages, misspell, spec_prompts
from mlxq.bench.workloads import RequestRecord


def test_grounded_prompts_hold_their_passage_and_cycle(tiny_model_dir: str) -> None:
    from mlx_lm import load

    tokenizer = load(tiny_model_dir, lazy=True)[1]
    chats = grounded_messages()
    assert len(chats) == len({c[0]["content"] for c in chats}) == 32
    assert sum(PASSAGES[0] in c[0]["content"] for c in chats) == 3  # copied as is, but in the spelling task
    assert misspell(PASSAGES[0]) != PASSAGES[0] and len(misspell(PASSAGES[0])) == len(PASSAGES[0])
    prompts = spec_prompts(tokenizer, "chat", 40)
    assert prompts[32] == prompts[0] and prompts[1] != prompts[0]
    assert list(prompts[0].ids) == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompts[0].text}], add_generation_prompt=True))
    with pytest.raises(ValueError, match="--spec-workloads"):
        spec_prompts(tokenizer, "poetry", 1)


def test_comparisons_pair_each_repeat_and_sum_acceptance() -> None:
    def run(arm: str, repeat: int, tps: float, proposed: int = 0, accepted: int = 0) -> dict:
        return {"arm": arm, "workload": "grounded", "sampling": "greedy", "rows": 8, "repeat": repeat,
                "tokens_per_s": tps, "decode_tokens_per_s": 2 * tps, "worker_cpu_s": 100.0 / tps,
                "speculation": {"proposed": proposed, "accepted": accepted,
                                "results_reporting": 8 if arm != "off" else 0}}

    runs = [run("off", 0, 10.0), run("ngram", 0, 25.0, 100, 60), run("off", 1, 20.0), run("ngram", 1, 30.0, 50, 40),
            run("off", 2, 10.0), run("ngram", 2, 12.0, 10, 0)]
    (c,) = compare(runs, ["off", "ngram"])
    assert c["ratios_each_repeat"] == [2.5, 1.5, 1.2] and c["ratio"] == 1.5
    assert c["decode_ratios_each_repeat"] == [2.5, 1.5, 1.2] and c["cpu_ratio"] == pytest.approx(1.5)
    assert c["tokens_per_s"] == 25.0 and c["off_tokens_per_s"] == 10.0
    assert (c["proposed"], c["accepted"]) == (160, 100) and c["acceptance"] == 100 / 160


def test_metrics_count_every_finished_token_and_the_speculation_fields() -> None:
    from mlxq.bench.arm_mlxq import fill_from_result
    from schemas.result import GenerationResult

    records = [RequestRecord(0, 0.0, started=0.1, first_token=0.5, finished=2.0, tokens=30, extra={"job_id": "a"}),
               RequestRecord(1, 0.0, started=0.1, first_token=0.6, finished=4.0, tokens=10, extra={"job_id": "b"}),
               RequestRecord(2, 0.0, finished=1.0, error="failed: boom", extra={"job_id": "c"})]
    m = metrics(records)
    assert (m["tokens"], m["wall_s"], m["completed"], m["failed"]) == (40, 4.0, 2, 1) and m["tokens_per_s"] == 10.0
    reported = [RequestRecord(0, 0.0), RequestRecord(1, 0.0)]
    fill_from_result(reported[0], GenerationResult.model_validate(
        {"id": "a", "status": "finished", "speculation": {"drafter": "ngram", "proposed": 12, "accepted": 9}}), 0.0)
    fill_from_result(reported[1], GenerationResult.model_validate({"id": "b", "status": "finished"}), 0.0)
    records = reported + records[2:]
    spec = speculation_of(records)
    assert spec == {"proposed": 12, "accepted": 9, "results_reporting": 1, "acceptance": 0.75}
    assert records[0].extra["speculation"]["drafter"] == "ngram" and "speculation" not in records[1].extra


def test_all_equal_baseline_needs_every_request_compared_and_equal() -> None:
    def identity(same: list[int], compared: list[int]) -> dict:
        arm = {"requests_same_as_off": same, "requests_compared": compared, "requests": 4}
        return {"agreement_arm": "off", "workloads": {"w": {"arms": {"off": {**arm, "requests_same_as_off": compared},
                                                                     "ngram": arm}}}}

    assert all_equal_baseline(identity([4, 4], [4, 4])) is True
    assert all_equal_baseline(identity([4, 3], [4, 4])) is False
    assert all_equal_baseline(identity([3], [3])) is False  # a lost request is not an equal one
    assert all_equal_baseline({"agreement_arm": "ngram", "workloads": {}}) is None


def test_a_random_draft_shares_the_models_tokenizer_and_vocabulary(tiny_model_dir: str, tmp_path: Path) -> None:
    from mlx_lm import load

    from mlxq.bench.scenario_speculative import random_draft

    draft = random_draft(tiny_model_dir, tmp_path)
    target_config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    config = json.loads((Path(draft) / "config.json").read_text())
    assert config["vocab_size"] == target_config["vocab_size"] and config["eos_token_id"] == target_config["eos_token_id"]
    target_tok, draft_tok = load(tiny_model_dir, lazy=True)[1], load(draft, lazy=True)[1]
    text = "Copy the following text exactly, word for word."
    assert draft_tok.encode(text) == target_tok.encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("in_process", [False, True], ids=["workers", "in-process"])
def test_the_speculative_scenario_reports_each_drafter_against_off(tiny_model_dir: str, tmp_path: Path,
                                                                   in_process: bool) -> None:
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--out", str(out),
            "--scenario", "speculative", "--spec-rows", "1", "--spec-new-tokens", "6", "--warmup-tokens", "2",
            "--spec-workloads", "grounded,chat", "--max-num-seqs", "4", *(["--spec-in-process"] if in_process else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    spec = report["scenarios"]["speculative"]
    assert "error" not in spec, spec
    assert spec["in_process"] is in_process and ("in the bench's process" in spec["method"]) is in_process
    assert set(spec["arms"]) == {"off", "ngram", "draft-self", "draft-random"}
    assert spec["arms"]["draft-self"]["env"]["MLXQ_DRAFT_MODEL"] == tiny_model_dir
    assert spec["arms"]["draft-random"]["env"]["MLXQ_DRAFT_MODEL"] == spec["random_draft"]
    runs = spec["runs"]
    assert len(runs) == 4 * 2  # arms x workloads, one row count, one repeat
    for run in runs:
        assert run["completed"] == run["requests"] == 1 and run["failed"] == 0, run
        assert 0 < run["tokens"] <= 6 and run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
    by = {(r["arm"], r["workload"]): r for r in runs}
    assert len(spec["comparisons"]) == 3 * 2
    for c in spec["comparisons"]:
        mine, base = by[(c["drafter"], c["workload"])], by[("off", c["workload"])]
        assert c["ratio"] == pytest.approx(mine["tokens_per_s"] / base["tokens_per_s"])
        assert c["decode_ratio"] == pytest.approx(mine["decode_tokens_per_s"] / base["decode_tokens_per_s"])
        # CPU times come in clock ticks (10 ms): a run this short may read 0, and has no CPU ratio then.
        cpu_ratio = base["worker_cpu_s"] / mine["worker_cpu_s"] if mine["worker_cpu_s"] else None
        assert c["cpu_ratio"] == (pytest.approx(cpu_ratio) if cpu_ratio is not None else None)
        assert (c["proposed"], c["accepted"]) == (mine["speculation"]["proposed"], mine["speculation"]["accepted"])
        assert c["acceptance"] == (c["accepted"] / c["proposed"] if c["proposed"] else None)
        # The model as its own draft (its pass cost fixed) says what it proposed from its first step;
        # prompt lookup and the random draft measure their costs, and a pass waits for steps timed at
        # its slot count, which six tokens may not give.
        assert c["reported_speculation"] or c["drafter"] != "draft-self", c
    assert all(by[("off", kind)]["speculation"]["results_reporting"] == 0 for kind in ("grounded", "chat"))
    # the model as its own draft: every proposal is the model's own greedy token
    self_draft = [c for c in spec["comparisons"] if c["drafter"] == "draft-self"]
    assert all(c["proposed"] > 0 and c["accepted"] == c["proposed"] for c in self_draft), self_draft
    if in_process:  # the engines' own counters of the run: its passes and the proposals its results report
        for c in self_draft:
            engine = by[("draft-self", c["workload"])]["engine"]
            assert engine["engine_speculative_steps"] > 0 and engine["engine_speculative_proposed"] == c["proposed"]
        # what each arm's engine learnt of its passes: nothing without speculation, and only measured shapes
        assert all(by[("off", kind)]["pass_costs"] == {} for kind in ("grounded", "chat"))
        assert all(name.startswith(("pass ", "early read ")) and cost >= 0 or name.startswith("ending early, prompt ")
                   and 0 <= cost <= 1
                   for run in runs for name, cost in run["pass_costs"].items())
        # prompt lookup's share of rows ending early, learnt from the rows of each kind that ended (graded.py)
        assert all(any(name.startswith("ending early") for name in run["pass_costs"]) for run in runs
                   if run["arm"] == "ngram"), runs
    assert spec["text_identity"]["all_equal_off"] is True, spec["text_identity"]
    assert (out / "speculative.png").stat().st_size > 0
    table = (out / "table.md").read_text()
    assert "| grounded | greedy | 1 |" in table and "| draft-random |" in table
    assert "for every batching arm" not in table  # no closed-loop workload ran: no line of their settings
