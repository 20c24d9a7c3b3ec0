"""`mlxq bench --scenario rl`, the weight swap (docs/rl.md): what publishing a weight version costs
a fleet that is decoding, under each policy, with one and with two workers.

A closed loop keeps a fixed number of streaming sequences decoding (each that ends is replaced at
once; lengths spread so that they end at different times). Once the load has settled, a version
is published under each policy in turn, with a steady stretch before and after each. Every token
event's time comes from its stream entry id (Redis's clock, ms), so the fleet's decode timeline is
read afterwards from the streams, and measured against the publish (the command's `issued_at`)
and each worker's acknowledgement (`at`): the longest gap between two token events of one worker
around the swap against its ordinary step interval, the tokens the fleet did not produce while it
recovered against its rate just before, the tokens thrown away (an `abort`'s first attempts), and
the swap's own duration from the worker's log line.

Mixed-adapter throughput, the scenario's `adapters` part, is mlxq/bench/scenario_rl_adapters.py.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import redis

from mlxq.bench import scenarios
from mlxq.bench.arm_mlxq import JOB_TIMEOUT_S, MlxqCluster
from mlxq.bench.config import BenchConfig
from mlxq.bench.procs import ProcessSet
from mlxq.bench.scenario_rl_adapters import adapter_lines, mixed_adapters
from mlxq.bench.stats import distribution, median
from mlxq.bench.workloads import Tokenizer, make_prompts
from producer import Client
from producer.pubsub import read_burst
from schemas import GenerationResult, keys

POLICIES = ("drain", "abort", "inflight")
ALIAS = "bench-swap"  # the name the workers serve the model under: the control stream's name
BIN_S = 0.1  # the timeline's bins in report.json
SWAP_LINE = re.compile(r"swapped in version (\d+) of the weights \((\w+)\) in ([\d.]+) s")


def save_version(model_path: str, directory: Path, weights: str = "worker") -> Path:
    """The served model's own parameters, in MLX's naming, as a version's directory; with
    `weights="worker"` in the formats the workers serve them in (worker/weight_prep.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from worker.weight_prep import prepare_weights

    model, _ = load(model_path)
    if weights == "worker":
        prepare_weights(model)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return directory


class ClosedLoad:
    """`sequences` streaming requests in flight at all times, on its own thread: each one that ends
    is replaced by the next until `stop`."""

    def __init__(self, url: str, queue: str, requests: list[dict[str, Any]], sequences: int) -> None:
        self._conn = redis.Redis.from_url(url)
        self._client = Client(connection=self._conn)
        self._queue, self._requests, self._sequences = queue, requests, sequences
        self.job_ids: list[str] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rl-swap-load", daemon=True)
        self.error: Optional[BaseException] = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Submit nothing more and wait until every job submitted has ended."""
        self._stopping.set()
        self._thread.join(timeout)
        self._conn.close()
        if self.error is not None:
            raise RuntimeError(f"the load's driver failed: {self.error!r}")

    def _submit(self, count: int) -> set[str]:
        start = len(self.job_ids)
        payloads = [self._requests[(start + i) % len(self._requests)] for i in range(count)]
        ids = self._client.submit_many(payloads, queue=self._queue, timeout=JOB_TIMEOUT_S, result_ttl=JOB_TIMEOUT_S)
        self.job_ids += ids
        return set(ids)

    def _run(self) -> None:
        pubsub = self._conn.pubsub()
        try:
            pubsub.psubscribe(keys.done_channel("*"))
            while (message := pubsub.get_message(timeout=10.0)) is not None and message["type"] != "psubscribe":
                pass
            inflight = self._submit(self._sequences)
            next_poll = time.monotonic() + 2.0
            while inflight:
                messages, whole = read_burst(pubsub, 0.5)
                ended = {m["data"].decode() for m in messages if m["type"] == "pmessage"} & inflight
                if not whole or time.monotonic() >= next_poll:  # a missed message: read the result keys
                    pending = list(inflight)
                    ended |= {j for j, raw in zip(pending, self._conn.mget([keys.result_key(j) for j in pending]))
                              if raw is not None}
                    next_poll = time.monotonic() + 2.0
                inflight -= ended
                if ended and not self._stopping.is_set():
                    inflight |= self._submit(len(ended))
        except BaseException as exc:  # reported by stop()
            self.error = exc
        finally:
            pubsub.close()


@dataclass
class Swap:
    """One publish: when it was issued, when each worker acknowledged it, and how."""

    workers: int
    policy: str
    round: int
    version: int
    issued_at: float
    acks: dict[str, float]
    ok: bool
    errors: dict[str, str] = field(default_factory=dict)
    swap_s: dict[str, Optional[float]] = field(default_factory=dict)  # from each worker's log


def _fleet_run(cfg: BenchConfig, url: str, procs: ProcessSet, model: str, blas_path: Optional[str],
               tokenizer: Tokenizer, version_dir: Path, workers: int, first_version: int
               ) -> tuple[list[Swap], "LoadTrace"]:
    """One fleet of `workers` under the load, a publish under each policy each round; its trace."""
    sequences = cfg.rl_swap_sequences

    def argv(name: str, queues: list[str]) -> list[str]:  # INFO: the swap's duration is in its log line
        return [sys.executable, "-m", "mlxq", "worker", "--url", url, "--model", model, "--alias", ALIAS,
                "--name", name, "--log-level", "INFO", *queues]

    cluster = MlxqCluster(url, model, workers, sequences, cfg.prefill_batch_size, procs, blas_path=blas_path,
                          worker_argv=argv)
    prompts = make_prompts(tokenizer, 4 * sequences, cfg.prompt_tokens, seed=cfg.seed, salt="rl-swap")
    rng = random.Random(cfg.seed)
    spread = cfg.rl_swap_new_tokens // 2
    requests = [{"prompt_token_ids": list(p.ids), "max_tokens": cfg.rl_swap_new_tokens + rng.randint(-spread, spread),
                 "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True} for i, p in enumerate(prompts)]
    cluster.start()
    swaps: list[Swap] = []
    try:
        client = cluster.client
        assert client is not None
        load = ClosedLoad(url, cluster.queue, requests, sequences)
        load.start()
        time.sleep(2 * cfg.rl_swap_steady_s)  # every sequence decoding, their ends spread out
        version = first_version
        for round_no in range(cfg.rl_swap_rounds):
            for policy in POLICIES:
                outcome = client.publish_weights(ALIAS, version, str(version_dir), policy, timeout=cfg.request_timeout_s)
                swaps.append(Swap(workers, policy, round_no, version, outcome.command.issued_at,
                                  {name: ack.at for name, ack in outcome.acked.items()}, outcome.ok, outcome.errors))
                version += 1
                time.sleep(cfg.rl_swap_steady_s)
        load.stop(cfg.request_timeout_s)
        trace = read_trace(cluster.conn, client, load.job_ids)
    finally:
        cluster.stop()
    durations = swap_durations([procs.log_dir / f"{name}.log" for name in cluster.names])
    for swap in swaps:
        swap.swap_s = {name: durations.get((name, swap.version)) for name in cluster.names}
    return swaps, trace


def swap_durations(logs: list[Path]) -> dict[tuple[str, int], float]:
    """(worker, version) -> seconds, from the workers' "swapped in version N ... in S s" lines."""
    found = {}
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        for match in SWAP_LINE.finditer(text):
            found[(path.stem, int(match.group(1)))] = float(match.group(3))
    return found


@dataclass
class Span:
    """One attempt of one sequence decoding: its first and last token events, on which worker (None:
    an attempt `abort` threw away, whose worker the stream does not say), and its tokens."""

    start: float
    end: float
    worker: Optional[str]
    tokens: int


@dataclass
class LoadTrace:
    """The load's token events (time s, tokens, worker; None for a discarded attempt's), its
    decoding spans, and how many jobs finished."""

    events: list[tuple[float, int, Optional[str]]]
    spans: list[Span]
    jobs: int
    finished: int

    def active(self, start: float, end: float) -> float:
        """Sequence-seconds decoding within [start, end): the spans' overlap with it."""
        return sum(max(0.0, min(s.end, end) - max(s.start, start)) for s in self.spans)


def read_trace(conn: Optional[redis.Redis], client: Client, job_ids: list[str]) -> LoadTrace:
    """The load's trace, from its jobs' streams and results. A choice whose stream holds more tokens
    than its result ran an attempt before (an abort sent it back): those tokens came first."""
    assert conn is not None
    results: dict[str, GenerationResult] = client.wait_many(job_ids, timeout=60)
    events: list[tuple[float, int, Optional[str]]] = []
    spans: list[Span] = []
    for job_id in job_ids:
        result = results[job_id]
        kept = {c.index: len(c.token_ids) for c in result.choices}
        by_choice: dict[int, list[tuple[float, int]]] = {}
        for entry_id, fields in conn.xrange(keys.stream_key(job_id)):
            event = json.loads(fields[b"data"])
            if event.get("event") == "token" and event["token_ids"]:
                by_choice.setdefault(event["index"], []).append((int(entry_id.split(b"-")[0]) / 1000,
                                                                 len(event["token_ids"])))
        for index, entries in by_choice.items():
            earlier = sum(n for _, n in entries) - kept.get(index, 0)  # tokens of attempts thrown away
            attempts: dict[Optional[str], list[tuple[float, int]]] = {None: [], result.worker: []}
            for t, n in entries:
                thrown = max(0, min(n, earlier))
                earlier -= thrown
                for worker, count in ((None, thrown), (result.worker, n - thrown)):
                    if count:
                        attempts[worker].append((t, count))
                        events.append((t, count, worker))
            spans += [Span(a[0][0], a[-1][0], worker, sum(n for _, n in a)) for worker, a in attempts.items() if a]
    events.sort(key=lambda event: event[0])
    return LoadTrace(events, spans, len(job_ids), sum(r.status == "finished" for r in results.values()))


def analyze(swap: Swap, trace: LoadTrace, steady_s: float) -> dict[str, Any]:
    """A swap's cost, from the load's trace around it (times on one machine's clock): the decoding
    the fleet did not do from the publish until steady_s after the last ack, against the sequences
    it kept decoding in the steady_s before, plus the decoding `abort` threw away."""
    start, end = swap.issued_at, max(swap.acks.values(), default=swap.issued_at) + steady_s
    decoding_before = trace.active(start - steady_s, start) / steady_s  # sequences, on average
    idle = decoding_before * (end - start) - trace.active(start, end)
    thrown = [s for s in trace.spans if s.worker is None and start - 1.0 <= s.end <= end]
    wasted = sum(s.end - s.start for s in thrown)
    per_worker = {}
    for name, ack in swap.acks.items():
        times = sorted({t for t, _, w in trace.events if w == name})
        steps = [b - a for a, b in zip(times, times[1:]) if start - steady_s <= a and b < start]
        around = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= ack + 0.5]
        per_worker[name] = {"ack_s": ack - start, "swap_s": swap.swap_s.get(name),
                            "step_ms": distribution([1000 * s for s in steps]),
                            "longest_gap_ms": 1000 * max(around) if around else None}
    cost = idle + wasted
    return {"workers": swap.workers, "policy": swap.policy, "round": swap.round, "version": swap.version,
            "ok": swap.ok, "errors": swap.errors, "publish_s": max(swap.acks.values(), default=start) - start,
            "window_s": end - start, "sequences_decoding_before": decoding_before,
            "tokens_per_s_before": sum(n for t, n, _ in trace.events if start - steady_s <= t < start) / steady_s,
            "idle_sequence_s": idle, "discarded_tokens": sum(s.tokens for s in thrown),
            "discarded_sequence_s": wasted, "sequence_s_lost": cost,
            "fleet_s_lost": cost / decoding_before if decoding_before else None,
            "per_worker": per_worker, "series": _series(trace, start - 1.0, end)}


def _series(trace: LoadTrace, start: float, end: float) -> dict[str, Any]:
    """Tokens/s and sequences decoding, in bins of BIN_S from 1 s before the publish."""
    count = max(1, int((end - start) / BIN_S) + 1)
    tokens = [0] * count
    for t, n, _ in trace.events:
        if start <= t < start + count * BIN_S:
            tokens[int((t - start) / BIN_S)] += n
    decoding = [trace.active(start + i * BIN_S, start + (i + 1) * BIN_S) / BIN_S for i in range(count)]
    return {"from_s": -1.0, "bin_s": BIN_S, "tokens_per_s": [n / BIN_S for n in tokens],
            "sequences_decoding": [round(d, 2) for d in decoding]}


def rl(cfg: BenchConfig, tokenizer: Tokenizer, make_cluster: scenarios.ClusterFactory, url: str, procs: ProcessSet,
       model: str, blas_path: Optional[str]) -> dict[str, Any]:
    """The rl scenario's parts (--rl-parts): n samples against independent requests
    (scenarios.rl, whose figures stay at the top level), `swap` and `adapters`."""
    out = scenarios.rl(cfg, tokenizer, make_cluster) if "samples" in cfg.rl_parts else {}
    if "swap" in cfg.rl_parts:
        out["swap"] = weight_swap(cfg, url, procs, model, blas_path, tokenizer)
    if "adapters" in cfg.rl_parts:
        out["adapters"] = mixed_adapters(cfg, url, procs, model, blas_path, tokenizer)
    return out


def weight_swap(cfg: BenchConfig, url: str, procs: ProcessSet, model: str, blas_path: Optional[str],
                tokenizer: Tokenizer) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    load_jobs: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="mlxq-bench-version-") as tmp:
        version_dir = save_version(model, Path(tmp), cfg.weights)
        version = 1
        for workers in cfg.workers:
            swaps, trace = _fleet_run(cfg, url, procs, model, blas_path, tokenizer, version_dir, workers, version)
            version += len(swaps)
            if trace.finished != trace.jobs:
                raise RuntimeError(f"{trace.jobs - trace.finished} of {trace.jobs} load jobs did not finish")
            load_jobs[workers] = trace.jobs
            runs += [analyze(swap, trace, cfg.rl_swap_steady_s) for swap in swaps]
    return {"sequences": cfg.rl_swap_sequences, "new_tokens": cfg.rl_swap_new_tokens,
            "new_tokens_spread": cfg.rl_swap_new_tokens // 2, "prompt_tokens": cfg.prompt_tokens,
            "steady_s": cfg.rl_swap_steady_s, "rounds": cfg.rl_swap_rounds, "workers": list(cfg.workers),
            "load_jobs": load_jobs, "summary": summarize_swaps(runs), "runs": runs,
            "method": "a closed loop keeps `sequences` streaming requests in flight (temperature 1.0, ignore_eos, "
                      "new_tokens +- spread each); after 2 x steady_s, a version (the model's own weights, from a "
                      "directory) is published under each policy in turn, steady_s apart. A token's time is its "
                      "stream entry id; a sequence decodes from its first token to its last. publish_s: issued_at "
                      "to the last ack. Per worker: step_ms, the intervals between its token events in the steady_s "
                      "before; longest_gap_ms, its longest from the publish to 0.5 s after its ack; swap_s, its log "
                      "line. idle_sequence_s: (sequences decoding on average in the steady_s before) x (the window: "
                      "publish to last ack + steady_s) - the sequence-seconds decoded in it; discarded: the attempts "
                      "abort threw away; fleet_s_lost = (idle + discarded sequence-seconds) / the sequences "
                      "decoding before: how long the whole fleet's decoding the swap cost"}


def summarize_swaps(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Optional[float]]]]:
    """Medians over rounds (and workers), by fleet size and policy."""
    out: dict[str, dict[str, dict[str, Optional[float]]]] = {}
    for run in runs:
        out.setdefault(str(run["workers"]), {}).setdefault(run["policy"], {})
    for workers, policies in out.items():
        for policy in policies:
            chosen = [r for r in runs if str(r["workers"]) == workers and r["policy"] == policy]
            workers_of = [w for r in chosen for w in r["per_worker"].values()]
            policies[policy] = {
                "publish_s": median([r["publish_s"] for r in chosen]),
                "swap_s": median([w["swap_s"] for w in workers_of]),
                "longest_gap_ms": median([w["longest_gap_ms"] for w in workers_of]),
                "step_p50_ms": median([(w["step_ms"] or {}).get("p50") for w in workers_of]),
                "tokens_per_s_before": median([r["tokens_per_s_before"] for r in chosen]),
                "discarded_tokens": median([r["discarded_tokens"] for r in chosen]),
                "fleet_s_lost": median([r["fleet_s_lost"] for r in chosen]),
            }
    return out


def rl_lines(r: dict[str, Any]) -> list[str]:
    """table.md's lines for the swap and adapter parts of the rl scenario."""
    lines = swap_table(r["swap"]) if "swap" in r else []
    if "adapters" in r:
        lines += adapter_lines(r["adapters"])
    return lines


def swap_table(s: dict[str, Any]) -> list[str]:
    lines = [f"- RL weight swap: {s['sequences']} streaming sequences decoding over the fleet ({s['new_tokens']} +- "
             f"{s['new_tokens_spread']} new tokens each, replaced as they end), a version published under each "
             f"policy; medians of {s['rounds']} round(s) (and of the workers). Fleet s lost: the decoding the swap "
             "cost the whole fleet, idle or thrown away, in seconds of all its sequences.", "",
             "  | workers | policy | publish -> last ack s | swap s (log) | longest decode gap ms | step p50 ms "
             "| tok/s before | tokens thrown away | fleet s lost |",
             "  | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for workers, policies in s["summary"].items():
        for policy, m in policies.items():
            lines.append(f"  | {workers} | {policy} | {_f(m['publish_s'], 2)} | {_f(m['swap_s'], 2)} | "
                         f"{_f(m['longest_gap_ms'], 0)} | {_f(m['step_p50_ms'], 1)} | "
                         f"{_f(m['tokens_per_s_before'], 0)} | {_f(m['discarded_tokens'], 0)} | "
                         f"{_f(m['fleet_s_lost'], 2)} |")
    return lines


def _f(value: Optional[float], digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"

