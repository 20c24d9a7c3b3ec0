"""examples/grpo/train.py against a real worker on the tiny model: a few GRPO steps, one weight swap
under each policy, and the example's own checks (logprobs equal the trainer's replay under the
recorded versions, no job lost, none below its minimum version), read back from its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.workers import start_worker, stop, workers_live

pytestmark = pytest.mark.slow

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "grpo" / "train.py"


def run_example(url: str, model: str, report: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TRAIN), "--url", url, "--model", model, "--model-name", "tiny",
                           "--prompts", "2", "--max-tokens", "96", "--timeout", "120", "--report", str(report),
                           *args], capture_output=True, text=True, timeout=300)


def rq_result_types(conn: redis.Redis, job_id: str) -> list[int]:
    return [int(fields[b"type"]) for _, fields in conn.xrange(f"rq:results:{job_id}")]


@pytest.fixture
def tiny_worker(redis_url, tiny_model_dir):
    conn = redis.Redis.from_url(redis_url)
    proc = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="grpo")
    workers_live(conn, 1)
    yield conn
    out = stop(proc)
    assert proc.returncode == 0, out


def test_grpo_steps_under_each_policy_pass_every_check(redis_url, tiny_model_dir, tiny_worker, tmp_path):
    conn = tiny_worker
    report_path = tmp_path / "report.json"
    done = run_example(redis_url, tiny_model_dir, report_path, "--steps", "3", "--policies", "drain,abort,inflight")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    steps = report["steps"]
    assert report["ok"] and [s["batch"] for s in steps] == [0, 1, 2, 3]
    for s in steps:
        checks = s["checks"]
        assert checks["ok"] and checks["lost"] == 0 and checks["finished"] == checks["jobs"] == 2, checks
        assert checks["below_min"] == [] and checks["mismatched"] == []
        assert checks["tokens_checked"] > 0 and checks["max_logprob_error"] <= 1e-4
        assert sum(checks["choices_by_version"].values()) == 16
        if s["publish"] is not None:
            assert s["publish"]["ok"] and s["publish"]["acked"] == ["grpo"], s["publish"]
            assert s["publish"]["jobs_running"] == 2  # the swap landed on the next batch mid-decode
    # batch 1 decoded through the drain to version 1: it finished on version 0, its minimum
    assert steps[1]["checks"]["choices_by_version"] == {"0": 16} and steps[1]["checks"]["mixed_version_choices"] == 0
    # batch 2 (minimum 1) was running at the abort to version 2: it went back to the queue and ran again on 2
    assert steps[2]["checks"]["choices_by_version"] == {"2": 16}
    for job_id in steps[2]["job_ids"]:
        assert sorted(set(rq_result_types(conn, job_id))) == [1, 4], job_id  # retried, then succeeded
    # batch 3 (minimum 2) went on through the inflight swap to version 3: its tokens came from both
    assert steps[3]["checks"]["choices_by_version"] == {"2": 16} and steps[3]["checks"]["mixed_version_choices"] > 0
    for s in steps:  # no job ended twice
        for job_id in s["job_ids"]:
            assert rq_result_types(conn, job_id).count(1) == 1, job_id
    assert steps[-1]["min_weight_version"] == 2 and steps[0]["mean_reward"] is not None


def test_requests_after_an_inflight_swap_sample_from_the_new_weights_alone(redis_url, tiny_model_dir, tiny_worker,
                                                                          tmp_path):
    report_path = tmp_path / "report.json"
    done = run_example(redis_url, tiny_model_dir, report_path, "--steps", "2", "--policies", "inflight,drain")
    report = json.loads(report_path.read_text())
    after = report["steps"][2]["checks"]  # batch 2 ran on version 1 only, after batch 1 decoded through the swap
    assert after["choices_by_version"] == {"1": 16} and after["mismatched"] == [], after
    assert done.returncode == 0, done.stdout + done.stderr
