"""`mlxq bench`: the pure parts (percentiles, arrivals, accounting, prompts, step analysis) and a
smoke run of the real harness on the tiny model. No timing assertions: only accounting and shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxq.bench.cli import config_from_args
from mlxq.bench.scenarios import PUBLISH_ROUNDS, SUSTAINED_JOBS_PER_BURST_JOB, analyze_steps, stats_delta
from mlxq.bench.stats import percentile, summarize
from mlxq.bench.workloads import Arrivals, Prompt, RequestRecord, closed_loop, make_prompts, open_loop, spread_lengths


class WordTokenizer:
    """One token per word: enough to check prompt building."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int], **kwargs: object) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def prompts(count: int) -> list[Prompt]:
    return [Prompt(f"p{i}", (i, i + 1)) for i in range(count)]


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_make_prompts_have_the_asked_length_and_differ() -> None:
    made = make_prompts(WordTokenizer(), 5, 12, seed=0, salt="t")
    assert all(len(p.ids) == 12 for p in made)
    assert len({p.ids[0] for p in made}) == 5  # distinct first tokens: no shared prefix


def test_closed_loop_releases_each_clients_next_request_after_the_previous() -> None:
    workload = closed_loop(prompts(6), concurrency=2, rounds=3, max_tokens=4)
    arrivals = Arrivals(workload)
    first = arrivals.due(0.0)
    assert sorted(r.index for r, _ in first) == [0, 1]
    assert arrivals.due(5.0) == []
    arrivals.completed(first[0][0], 1.5)
    (request, arrival), = arrivals.due(1.5)
    assert request.client == first[0][0].client and arrival == 1.5
    assert not arrivals.exhausted


def test_spread_lengths_varies_max_tokens_within_the_spread_and_repeats() -> None:
    workload = closed_loop(prompts(200), concurrency=20, rounds=10, max_tokens=64)
    spread = spread_lengths(workload, 16, seed=3)
    lengths = [r.max_tokens for r in spread.requests]
    assert min(lengths) >= 48 and max(lengths) <= 80 and len(set(lengths)) > 10
    assert [r.max_tokens for r in spread_lengths(workload, 16, seed=3).requests] == lengths
    assert [(r.index, r.client, r.prompt) for r in spread.requests] == [(r.index, r.client, r.prompt)
                                                                        for r in workload.requests]
    assert spread_lengths(workload, 0, seed=3) is workload


def test_open_loop_arrivals_follow_their_times() -> None:
    workload = open_loop(prompts(20), rate=10.0, max_tokens=4, seed=1)
    times = [r.arrival_s for r in workload.requests]
    assert times == sorted(times) and times[0] == 0.0
    arrivals = Arrivals(workload)
    early = arrivals.due(times[5])
    assert [r.index for r, _ in early] == list(range(6))
    arrivals.due(times[-1] + 1)
    assert arrivals.exhausted


def test_summarize_accounts_for_every_request() -> None:
    workload = closed_loop(prompts(3), concurrency=3, rounds=1, max_tokens=4)
    records = [
        RequestRecord(0, 0.0, started=0.1, first_token=0.2, finished=1.0, tokens=4),
        RequestRecord(1, 0.0, first_token=0.3, finished=2.0, tokens=3),  # short: a failure
    ]
    summary = summarize(workload, records)
    assert summary["completed"] == 1 and summary["failed"] == 2  # one short, one without a record
    assert summary["tokens"] == 4 and summary["wall_s"] == 2.0
    assert summary["ttft_s"]["p50"] == pytest.approx(0.2)
    assert "no record" in summary["failure_reasons"]


def test_analyze_steps_finds_the_publish_and_admit_intervals() -> None:
    steps = [[0.00, 4, False], [0.01, 4, False], [0.02, 4, False], [0.50, 36, False], [0.51, 36, False],
             [0.90, 4, True], [0.93, 4, True], [0.95, 4, False], [0.96, 4, False]]
    found = analyze_steps(steps, 32, running=4)
    assert found["admit_step_ms"] == pytest.approx(480)
    assert found["publish_step_ms"] == pytest.approx(390)
    # steps of the same batch while bookkeeping wrote the burst's results: 30 and 20 ms
    assert found["publishing_step_ms"] == pytest.approx(30) and found["publishing_steps"] == 2
    assert found["burst_batch_step_ms"]["p50"] == pytest.approx(10)  # the one plain step at 36 active
    assert found["plain_step_ms"]["p50"] == pytest.approx(10)


def test_cli_lists_parse() -> None:
    import argparse

    from mlxq.cli import build_parser

    args = build_parser().parse_args(["bench", "--arms", "a,c", "--concurrency", "1,4", "--rates", "",
                                      "--scenario", "all", "--workers", "2"])
    assert isinstance(args, argparse.Namespace)
    config = config_from_args(args)
    config.validate()
    assert config.arms == ("A", "C") and config.concurrency == (1, 4) and config.rates == ()
    assert config.workers == (2,) and "soak" in config.scenarios and "prefix-cache" in config.scenarios


def test_prefix_cache_flags_and_the_measured_share_of_worker_counters() -> None:
    from mlxq.cli import build_parser

    args = build_parser().parse_args(["bench", "--scenario", "prefix-cache", "--prefix-requests", "8",
                                      "--prefix-shared-tokens", "100", "--prefix-suffix-tokens", "5",
                                      "--prefix-new-tokens", "3", "--prefix-cache-mb", "64"])
    config = config_from_args(args)
    config.validate()
    assert (config.prefix_requests, config.prefix_shared_tokens, config.prefix_suffix_tokens,
            config.prefix_new_tokens, config.prefix_cache_mb) == (8, 100, 5, 3, 64)
    # The worker's hash is cumulative (warm-up included) and holds strings.
    before = {"lookups": "8", "prompt_tokens": "800", "reused_tokens": "700", "hit_rate": "0.875", "enabled": "1"}
    after = {"lookups": "72", "prompt_tokens": "35616", "reused_tokens": "32956", "hit_rate": "0.925", "enabled": "1"}
    delta = stats_delta(before, after)
    assert delta["lookups"] == 64 and delta["prompt_tokens"] == 34816 and delta["reused_tokens"] == 32256
    assert delta["hit_rate"] == pytest.approx(32256 / 34816) and delta["enabled"] == "1"
    assert stats_delta({}, {}) == {}


@pytest.mark.slow
def test_bench_smoke_on_the_tiny_model(tiny_model_dir: str, tmp_path: Path) -> None:
    import psutil

    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--out", str(out),
            "--arms", "A,B,C,S", "--workers", "1", "--concurrency", "4", "--rates", "", "--prompt-tokens", "16",
            "--new-tokens", "6", "--warmup-tokens", "2", "--headline-concurrency", "4",
            "--scenario", "throughput,overhead", "--overhead-jobs", "150", "--overhead-publish", "24",
            "--overhead-step-ms", "5"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    marker = f"bench-{proc.pid}-"  # every worker the harness starts carries its pid in its name
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, "the harness left worker processes behind"

    report = json.loads((out / "report.json").read_text())
    assert report["machine"]["cpu_count"] >= 1 and report["blas"]
    assert report["versions"]["mlx"] and report["versions"]["mlx-lm"]
    assert report["model"]["path"] == tiny_model_dir
    by_arm = {e["arm"]: e for e in report["results"]}
    assert set(by_arm) == {"A", "B", "C1", "S"}
    for arm, entry in by_arm.items():
        assert entry["status"] == "ok", entry
        m = entry["metrics"]
        assert m["requests"] == 4 and m["completed"] == 4 and m["failed"] == 0, (arm, m)
        assert m["tokens"] == m["expected_tokens"] == 4 * 6
        assert m["tokens_per_s"] > 0 and m["requests_per_s"] > 0
        for name in ("ttft_s", "e2e_s"):
            d = m[name]
            assert d["count"] == 4 and 0 <= d["p50"] <= d["p95"] <= d["p99"] <= d["max"]
        assert m["ttft_s"]["p50"] <= m["e2e_s"]["p50"]
    assert all(report["arms"][arm]["status"] == "ok" for arm in by_arm)
    ratios = report["headline"]["ratios"]
    assert ratios["C/B"] is not None and ratios["C/A"] is not None and ratios["C/D"] is None
    # S splits C's gap to B: mlxq's engine wrapper (S/B) and the queue around it (C/S)
    assert ratios["S/B"] is not None and ratios["C/S"] is not None
    assert ratios["S/B"] * ratios["C/S"] == pytest.approx(ratios["C/B"])
    assert "targets" not in report["headline"] and "met" not in report["headline"]  # it reports, never judges

    overhead = report["scenarios"]["overhead"]
    assert overhead["throughput"]["completed"] == 150 and overhead["throughput"]["failed"] == 0
    assert overhead["throughput"]["jobs_per_s"] > 0
    sustained = overhead["throughput"]["sustained"]
    assert sustained["completed"] == sustained["jobs"] == SUSTAINED_JOBS_PER_BURST_JOB * 150
    assert sustained["jobs_per_s"] > 0 and sustained["submitted_per_s"] > 0
    assert overhead["publish"]["burst_finished"] == overhead["publish"]["joiners_finished"] == PUBLISH_ROUNDS * 24
    assert overhead["publish"]["publish_step_ms"] is not None
    assert all(r["publishing_steps"] > 0 for r in overhead["publish"]["rounds"])

    # Where the time went: mlx-lm's own counters for B, the same plus the loop's sections for C.
    for arm in ("B", "S", "C1"):
        split = by_arm[arm]["time_split"]
        assert split["engine_decode_tokens"] == 4 * 6, (arm, split)
        # mlx-lm prefills a prompt but its last token, which its first decode step runs
        assert split["engine_prefill_tokens"] == 4 * 15 and split["engine_prefill_calls"] >= 1, (arm, split)
        assert 0 < split["engine_prefill_s"] + split["engine_decode_s"] < by_arm[arm]["metrics"]["wall_s"]
    assert "loop_step_s" not in by_arm["B"]["time_split"]
    assert by_arm["C1"]["time_split"]["loop_step_s"] > by_arm["C1"]["time_split"]["engine_decode_s"]
    table = (out / "table.md").read_text()
    assert table.count("| C1 | 4 |") == 1 and table.count("| C1 | closed-4 |") == 1
    assert "for every batching arm" in table  # the closed-loop workloads' settings
    assert (out / "plot.png").stat().st_size > 0
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(len(json.loads(line)["records"]) == 4 for line in lines)
    # every arm wrote mlx-lm's greedy text, alone, for the first request, and B's for all four
    identity = report["text_identity"]
    assert identity["agreement_arm"] == "B" and identity["all_same_as_reference"], identity
    arms = identity["workloads"]["closed-4"]["arms"]
    assert set(arms) == {"A", "B", "C1", "S"}
    assert all(a["same_as_reference"] == [True] and a["requests_same_as_B"] == [4] for a in arms.values()), arms
    assert "| closed-4 | C1 | yes | 4/4 |" in table


def test_rl_scenario_shares_each_prompts_prefill_among_its_n_samples(tiny_model_dir: str, tmp_path: Path) -> None:
    prompts, n, prompt_tokens, new_tokens = 2, 3, 16, 4
    out = tmp_path / "rl"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--out", str(out), "--arms", "",
            "--scenario", "rl", "--rl-parts", "samples", "--rl-prompts", str(prompts), "--rl-n", str(n),
            "--rl-prompt-tokens", str(prompt_tokens), "--rl-new-tokens", str(new_tokens), "--warmup-tokens", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rl = json.loads((out / "report.json").read_text())["scenarios"]["rl"]
    runs = {label: rl[label] for label in ("grouped", "independent", "independent_prefix_cache")}
    for label, run in runs.items():
        assert run["completed"] == run["requests"] and run["failed"] == 0, (label, run)
        assert run["tokens"] == prompts * n * new_tokens, (label, run)
    # n=3 requests prefill each prompt once; without the prefix cache, every independent request
    # prefills its own copy (mlx-lm leaves the last prompt token to the first decode step). On
    # mlx-lm's engine a shared prefill runs the whole prompt; the compiled engine (the worker's
    # default where it runs) leaves the last token to the first decode step there too.
    from mlx_lm import load

    from worker.engines.decode_path import choose_decode_path

    compiled = choose_decode_path(load(tiny_model_dir)[0]).name == "compiled"
    shared = prompts * (prompt_tokens - 1 if compiled else prompt_tokens)
    assert runs["grouped"]["engine"]["prefill_tokens"] == shared
    assert runs["independent"]["engine"]["prefill_tokens"] == prompts * n * (prompt_tokens - 1)
    # With the cache, identical prompts admitted together share one prefill, as the n choices do.
    assert runs["independent_prefix_cache"]["engine"]["prefill_tokens"] == shared
    assert rl["engine_time_speedup"] > 0
    assert "the speedup that engine time allows" in (out / "table.md").read_text()


class ScriptedArm:
    """An arm whose every request takes the wall time the test gives for that repeat."""

    methods: dict[str, str] = {}
    time_split = None

    def __init__(self, key: str, walls: list[float], log: list[str]) -> None:
        self.key, self.walls, self.log, self.repeat = key, walls, log, 0

    def start(self) -> None:
        self.log.append(self.key)

    def stop(self) -> None:
        self.repeat += 1

    def info(self) -> dict[str, object]:
        return {}

    def run_all(self, plan, on_outcome) -> None:  # type: ignore[no-untyped-def]
        wall = self.walls[self.repeat]
        for workload, _ in plan:
            on_outcome(workload, [RequestRecord(r.index, 0.0, first_token=0.1, finished=wall, tokens=r.max_tokens)
                                  for r in workload.requests])


def test_repeats_interleave_the_arms_and_report_median_paired_ratios(tmp_path: Path, monkeypatch) -> None:
    from mlxq.bench import runner as runner_module
    from mlxq.bench.config import BenchConfig
    from mlxq.bench.report import headline, markdown

    log: list[str] = []
    # B and C slow down together in repeat 2 (a noisy neighbour): C/B per repeat 0.8, 0.9, 0.5.
    # Two workers (C2) and D: the extra worker count is compared with B, D and E too.
    arms = [ScriptedArm("B", [1.0, 2.0, 1.0], log), ScriptedArm("C1", [1.25, 2.0 / 0.9, 2.0], log),
            ScriptedArm("C2", [1.0, 1.0, 1.0], log), ScriptedArm("D", [1.5, 1.0, 1.2], log)]
    cfg = BenchConfig(out=tmp_path, arms=("B", "C", "D"), concurrency=(4,), rates=(), repeats=3, workers=(1, 2))
    cfg.validate()
    run = runner_module.Runner(cfg)
    monkeypatch.setattr(run, "_arms", lambda procs, url: arms)
    run.tokenizer = WordTokenizer()
    run.local = type("Unloaded", (), {"unload": lambda self: None})()
    monkeypatch.setattr(run, "_reference_outputs", lambda workloads: {})
    run.report = {"settings": {"repeats": 3}, "arms": {}, "results": []}
    run._throughput(None, "")  # type: ignore[arg-type]

    assert log == ["B", "C1", "C2", "D"] * 3
    assert [(e["arm"], e["repeat"]) for e in run.report["results"] if e["arm"] in ("B", "C1")] == [
        ("B", 0), ("C1", 0), ("B", 1), ("C1", 1), ("B", 2), ("C1", 2)]
    head = headline(run.report, 4)
    assert head["ratios_each_repeat"]["C/B"] == pytest.approx([0.8, 0.9, 0.5])
    assert head["ratios"]["C/B"] == pytest.approx(0.8)  # the median of the paired ratios
    assert head["ratios_each_repeat"]["C2/D"] == pytest.approx([1.5, 1.0, 1.2])
    assert head["ratios"]["C2/D"] == pytest.approx(1.2) and head["ratios"]["C2/B"] == pytest.approx(1.0)
    assert head["ratios"]["C/D"] == pytest.approx(0.6)  # per repeat 1.2, 0.45, 0.6
    assert head["ratios"]["C2/E"] is None  # E did not run
    b_runs = sorted(e["metrics"]["tokens_per_s"] for e in run.report["results"] if e["arm"] == "B")
    assert head["tokens_per_s"]["B"] == pytest.approx(b_runs[1])  # B's median run
    run.report.update(headline=head, model={"path": "m"}, machine={}, device="cpu", blas="x",
                      versions={}, settings={**run.report["settings"], "prompt_tokens": 64, "new_tokens": 64,
                                             "max_num_seqs": 32})
    table = markdown(run.report)
    assert "| B #2 | 4 |" in table and "| C1 #3 | 4 |" in table
    assert "| C/B | 0.80 | 0.80, 0.90, 0.50 |" in table


def test_greedy_texts_agree_up_to_the_first_eos_where_an_arm_masks_it() -> None:
    from mlxq.bench.text_check import Output, TextCheck, agree, from_token_ids, identity_lines

    tokenizer = WordTokenizer()
    ids = tokenizer.encode("the sea is blue EOS and then more")
    eos = {tokenizer.vocab["EOS"]}
    emitted = from_token_ids(ids, tokenizer, eos)  # an arm that emits EOS and decodes past it
    assert emitted == Output("the sea is blue", True)
    assert agree(emitted, Output("the sea is blue but masked", None))  # D, E: the next best token instead
    assert not agree(emitted, Output("the sea is red", None))
    assert not agree(emitted, Output("the sea is blue", False))  # no EOS where the other had one
    assert agree(Output("all of it", False), Output("all of it", None))
    assert agree(Output(" all of it", False), Output("all of it", None))  # mlx_lm.server's first token
    assert not agree(Output(" all of it", False), Output(" all of it", True))
    assert not agree(Output("all of it", False), Output("all of it and more", None))

    check = TextCheck(tokenizer, {"w": emitted}, eos)
    workload = closed_loop(prompts(2), 2, 1, 8, label="w")

    def records(*texts: str) -> list[RequestRecord]:
        return [RequestRecord(i, 0.0, finished=1.0, extra={"token_ids": tokenizer.encode(t)})
                for i, t in enumerate(texts)]

    check.add("B", workload, 0, records("the sea is blue EOS x", "second one"))
    check.add("C1", workload, 0, records("the sea is blue EOS y", "second other"))
    check.add("D", workload, 0, [RequestRecord(0, 0.0, finished=1.0, extra={"text": "the sea is grey"}),
                                 RequestRecord(1, 0.0, error="HTTP 500")])
    report = check.report()
    arms = report["workloads"]["w"]["arms"]
    assert arms["B"]["same_as_reference"] == [True] and arms["B"]["requests_same_as_B"] == [2]
    assert arms["C1"]["same_as_reference"] == [True] and arms["C1"]["requests_same_as_B"] == [1]
    assert arms["D"]["same_as_reference"] == [False] and arms["D"]["requests_same_as_B"] == [0]
    assert arms["D"]["requests_compared"] == [1] and arms["C1"]["requests_compared"] == [2]  # D lost one
    assert "| w | D | NO | 0/1 (1 not compared: failed) |" in "\n".join(identity_lines(report))
    assert arms["D"]["first_text_differing"] == {"text": "the sea is grey", "ended_at_eos": None}
    assert report["all_same_as_reference"] is False


def test_repeats_must_be_positive() -> None:
    from mlxq.cli import build_parser

    config = config_from_args(build_parser().parse_args(["bench", "--repeats", "0"]))
    with pytest.raises(ValueError, match="--repeats"):
        config.validate()


def test_a_multi_worker_time_split_is_the_mean_worker() -> None:
    from mlxq.bench.report import time_split_line

    # Two workers, each 8 s in the engine during a 10 s run: summed, the engine would outlast the wall.
    split = {"engine_prefill_s": 1.0, "engine_decode_s": 7.0, "engine_decode_steps": 300.0, "workers": 2}
    line = time_split_line(split, 10.0)
    assert "outside the engine 2.00 s" in line and line.endswith("(the mean of 2 workers)")
    assert "mean" not in time_split_line({**split, "workers": 1}, 10.0)


@pytest.fixture(scope="module")
def quantized_bf16_dir(tiny_model_dir: str, tmp_path_factory) -> str:
    """The tiny model as mlx-community ships real ones: 4-bit, bfloat16 scales and norms."""
    import worker  # noqa: F401  (BLAS before MLX)
    from mlx_lm import convert

    path = tmp_path_factory.mktemp("quantized") / "tiny-4bit"
    convert(tiny_model_dir, mlx_path=str(path), quantize=True, q_group_size=32, q_bits=4, dtype="bfloat16")
    return str(path)


def test_the_weights_scenario_times_each_format(quantized_bf16_dir: str, tmp_path: Path) -> None:
    from mlx_lm import load

    from mlxq.bench.config import BenchConfig
    from mlxq.bench.scenario_weights import weights, weights_line

    cfg = BenchConfig(out=tmp_path, weights_variants=("as-loaded", "upcast", "dequantized", "worker"),
                      weights_rows=(1, 2), weights_steps=1, weights_prefill=16)
    tokenizer = load(quantized_bf16_dir, lazy=True)[1]
    out = weights(cfg, quantized_bf16_dir, tokenizer)
    variants = out["variants"]
    assert list(variants) == ["as-loaded", "upcast", "dequantized", "worker"]
    assert "bfloat16" in variants["as-loaded"]["dtypes"] and "uint32" in variants["as-loaded"]["dtypes"]
    assert set(variants["upcast"]["dtypes"]) == {"float32", "uint32"}  # still quantized, float32 scales
    assert set(variants["dequantized"]["dtypes"]) == {"bfloat16"}  # dense, in the checkpoint's precision
    assert set(variants["worker"]["dtypes"]) == {"float32"}  # this CPU: upcast and dequantized
    for entry in variants.values():
        assert set(entry["decode_step_ms"]) == {"1", "2"} and all(ms > 0 for ms in entry["decode_step_ms"].values())
        assert entry["prefill_ms"] > 0 and entry["prefill_speedup"] > 0
    assert variants["as-loaded"]["decode_speedup"] == {"1": 1.0, "2": 1.0}
    assert "weight formats" in weights_line(out) and "worker: step 1 rows" in weights_line(out)


@pytest.mark.slow
def test_the_startup_scenario_compares_the_decode_paths(tiny_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--out", str(out), "--scenario",
            "startup", "--startup-wave", "2", "--prompt-tokens", "8", "--new-tokens", "4", "--no-startup-cold",
            "--max-num-seqs", "4"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    startup = json.loads((out / "report.json").read_text())["scenarios"]["startup"]
    assert set(startup["paths"]) == {"batch-generator", "auto"} and startup["same_first_answer"], startup
    for path in ("batch-generator", "auto"):
        assert startup[path]["first_answer_s"] > 0 and startup[path]["settled_tokens_per_s"] > 0
    engine = startup["paths"]["auto"][0]["engine"]
    assert engine["kernels_prebuilding"] == "0" and int(engine["compiled_shapes"]) > 0, engine
    assert startup["first_answer_ratio"] > 0 and "start-up (kernels on disk" in done.stdout
