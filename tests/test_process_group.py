"""`mlxq worker --processes N`: how the host's settings are shared out, when a process is started
again, and the group on real worker processes (start, serve, restart, stop)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import redis
from rq import Worker

from producer import Client
from tests.workers import wait_for
from worker.engines.fake import fake_token
from worker.process_group import MAX_QUICK_EXITS, QUICK_EXIT_S, RestartPolicy, child_settings, share
from worker.settings import WorkerSettings
from schemas import keys


def test_share_adds_up_and_differs_by_at_most_one():
    for total in (1, 7, 32, 33):
        for parts in range(1, min(total, 5) + 1):
            parts_list = [share(total, parts, i) for i in range(parts)]
            assert sum(parts_list) == total
            assert max(parts_list) - min(parts_list) <= 1


def test_child_settings_share_the_hosts_totals():
    host = WorkerSettings(model="m", max_num_seqs=32, kv_budget_mb=1000, prefix_cache_mb=1024)
    children = child_settings(host, 3, cpu_count=4, split_blas_threads=True)
    assert [c.max_num_seqs for c in children] == [11, 11, 10]
    assert [c.kv_budget_mb for c in children] == [334, 333, 333]
    assert {c.prefix_cache_mb for c in children} == {341}
    assert {c.blas_threads for c in children} == {1}
    assert {c.model for c in children} == {"m"}


def test_child_settings_default_kv_budget_is_split_and_blas_left_alone_where_mlxq_loaded_none():
    host = WorkerSettings(max_num_seqs=8)
    children = child_settings(host, 2, cpu_count=16, split_blas_threads=False)
    assert sum(c.kv_budget_mb for c in children) == host.kv_budget_bytes // (1024 * 1024)
    assert {c.blas_threads for c in children} == {None}
    explicit = child_settings(WorkerSettings(max_num_seqs=8, blas_threads=6), 2, cpu_count=16, split_blas_threads=True)
    assert {c.blas_threads for c in explicit} == {3}


def test_child_settings_refuses_more_processes_than_sequences():
    with pytest.raises(ValueError, match=r"MLXQ_PROCESSES \(5\) must not exceed MLXQ_MAX_NUM_SEQS \(4\)"):
        child_settings(WorkerSettings(max_num_seqs=4), 5, cpu_count=2, split_blas_threads=False)
    with pytest.raises(ValueError, match="MLXQ_PROCESSES must be >= 1"):
        child_settings(WorkerSettings(), 0, cpu_count=2, split_blas_threads=False)


def test_settings_round_trip_through_the_environment():
    settings = WorkerSettings(model="/m", alias="a", max_num_seqs=5, kv_budget_mb=77, trust_remote_code=True,
                              fake_step_delay_s=0.25, callback_allowlist=("app.hooks.", "ops."))
    assert WorkerSettings.from_env(settings.to_env()) == settings
    assert "MLXQ_BLAS_THREADS" not in settings.to_env()  # unset stays unset


def test_restart_policy_backs_off_then_gives_up_and_leaves_clean_exits_alone():
    policy = RestartPolicy()
    assert policy.delay(0, 1.0) is None
    delays = [policy.delay(1, 2.0) for _ in range(MAX_QUICK_EXITS)]
    assert delays[:-1] == [1.0, 2.0, 4.0, 8.0][: MAX_QUICK_EXITS - 1]
    assert delays[-1] is None
    recovering = RestartPolicy(quick_exits=MAX_QUICK_EXITS - 1)
    assert recovering.delay(-9, QUICK_EXIT_S + 1) == 0.0  # a long run resets the count
    assert recovering.delay(1, 1.0) == 1.0


# --- real processes -----------------------------------------------------------------------

def start_group(url: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "mlxq", "worker", "--url", url, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env})


def registered(conn: redis.Redis) -> dict[str, int]:
    return {w.name: w.pid for w in Worker.all(connection=conn) if w.death_date is None}


def alive(pid: int) -> bool:
    """Running (an exited child whose parent is gone may linger as a zombie until init reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not sys.platform.startswith("linux")  # no /proc: kill(0) is all there is


FAKE = {"MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": "0.02", "MLXQ_HEARTBEAT_INTERVAL_S": "1",
        "MLXQ_SWEEP_INTERVAL_S": "2"}


@pytest.mark.slow
def test_group_shares_a_burst_restarts_a_killed_process_and_stops_warm(redis_url, redis_conn):
    group = start_group(redis_url, "--processes", "2", "--name", "g", "--max-num-seqs", "16", env=FAKE)
    out = ""
    try:
        wait_for(lambda: set(redis_conn.hkeys(keys.group_key("g"))) == {b"g-1", b"g-2"}, timeout=30,
                 what="both processes ready, in their group")
        client = Client(redis_url)
        # 8 jobs at once, 8 slots each: one idle process could take them all; the group shares them out.
        requests = [{"prompt_token_ids": [100 + i, 7], "max_tokens": 60, "temperature": 0} for i in range(8)]
        ids = client.submit_many(requests)
        most = {"g-1": 0, "g-2": 0}

        def sample_running() -> bool:
            for name in most:
                most[name] = max(most[name], redis_conn.scard(keys.running_key(name)))
            return all(client.status(j) in ("finished", "failed") for j in ids)

        wait_for(sample_running, timeout=60, interval=0.01, what="the jobs")
        assert most == {"g-1": 4, "g-2": 4}
        results = client.wait_many(ids, timeout=10)
        for job_id, request in zip(ids, requests):
            assert results[job_id].status == "finished"
            assert results[job_id].choices[0].token_ids == [fake_token(request["prompt_token_ids"], k)
                                                            for k in range(60)]
        assert {results[j].worker for j in ids} == {"g-1", "g-2"}

        pids = registered(redis_conn)
        os.kill(pids["g-1"], signal.SIGKILL)
        wait_for(lambda: "g-1.1" in registered(redis_conn), timeout=30, what="the killed process started again")
        assert registered(redis_conn)["g-2"] == pids["g-2"]  # its sibling ran on untouched
        late = client.submit({"prompt_token_ids": [5, 6], "max_tokens": 200, "temperature": 0})
        wait_for(lambda: client.status(late) == "started", timeout=30, what="a job on the group")
        survivors = registered(redis_conn)

        group.send_signal(signal.SIGTERM)  # warm: the running job still finishes
        out, _ = group.communicate(timeout=60)
        assert group.returncode == 0, out
        assert client.wait(late, timeout=5).status == "finished"
        wait_for(lambda: not any(alive(pid) for pid in survivors.values()), timeout=10, what="no process left")
        client.close()
    finally:
        if group.poll() is None:
            group.kill()
            out, _ = group.communicate()
    assert "worker process 1/2" in out and "8 sequences" in out  # half of --max-num-seqs 16


@pytest.mark.slow
def test_group_gives_up_on_a_process_that_keeps_failing_at_start(redis_url, tmp_path):
    missing = str(tmp_path / "no-such-model")
    group = start_group(redis_url, "--processes", "2", "--model", missing, "--burst", env={})
    out, _ = group.communicate(timeout=120)
    assert group.returncode == 1
    assert f"failed {MAX_QUICK_EXITS} times in a row" in out
    # The process that gave up was started again after 1, 2, 4 and 8 s, then the group stopped (what
    # its log says; the wall time depends on the machine's load and is not asserted).
    (index,) = re.findall(rf"worker process (\d+) failed {MAX_QUICK_EXITS} times in a row", out)
    delays = re.findall(rf"worker process {index} exited with code \S+; starting it again in (\d+) s", out)
    assert delays == ["1", "2", "4", "8"], (delays, out[-3000:])


@pytest.mark.slow
def test_group_on_the_tiny_model_serves_a_burst_and_exits(redis_url, tiny_model_dir):
    client = Client(redis_url)
    request = {"prompt": "the same prompt", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ids = client.submit_many([request] * 8)
    group = start_group(redis_url, "--processes", "2", "--model", tiny_model_dir, "--max-num-seqs", "2",
                        "--burst", env={})
    out, _ = group.communicate(timeout=300)
    assert group.returncode == 0, out
    assert out.count(f"loaded {tiny_model_dir}") == 2  # each process loaded the model itself
    results = client.wait_many(ids, timeout=5)
    assert {results[j].status for j in ids} == {"finished"}
    assert len({tuple(results[j].choices[0].token_ids) for j in ids}) == 1  # greedy: one answer, whoever served
    client.close()


@pytest.mark.parametrize("platform, expect_hook", [("linux", True), ("darwin", False)])
def test_the_parent_death_signal_is_asked_for_on_linux_only(monkeypatch, platform, expect_hook):
    import worker.process_group as pg

    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, argv, **kwargs):
            seen.update(kwargs, argv=argv)

    monkeypatch.setattr(pg.sys, "platform", platform)
    monkeypatch.setattr(pg.subprocess, "Popen", FakePopen)
    group = pg.WorkerGroup([WorkerSettings(max_num_seqs=2)], "redis://x", ["--burst"], name="n")
    group._spawn(group._children[0])
    assert (seen["preexec_fn"] is pg._die_with_parent) is expect_hook
    assert seen["start_new_session"] is True
    assert seen["argv"][-3:] == ["--name", "n-1", "--burst"]
    assert seen["env"]["MLXQ_MAX_NUM_SEQS"] == "2" and seen["env"]["MLXQ_PROCESSES"] == "1"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_processes_stop_when_their_parent_is_killed(redis_url, redis_conn):
    group = start_group(redis_url, "--processes", "2", "--name", "orphan", env=FAKE)
    try:
        wait_for(lambda: set(redis_conn.hkeys(keys.group_key("orphan"))) == {b"orphan-1", b"orphan-2"},
                 timeout=30, what="both processes ready")
        pids = registered(redis_conn).values()
        group.kill()  # SIGKILL: the parent cannot pass anything on
        group.wait()
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=20, what="the orphans to stop")
    finally:
        if group.poll() is None:
            group.kill()
