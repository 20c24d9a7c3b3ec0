"""Scenario `speculative`: tokens/s with and without speculative decoding, side by side, per drafter.

One worker process per arm, all started before anything is measured and left idle while another
runs: `off` (no speculation: the baseline) and one per drafter of --spec-drafters:

- ngram: prompt lookup (`--speculative ngram`);
- draft-self: the served model as its own draft (`--speculative draft --draft-model <the model>`):
  every proposal is accepted under greedy decoding, the most a draft model can give. Its pass cost
  is fixed at the platform's default (MLXQ_SPECULATIVE_PASS_COST), so its draft calls are not priced
  and every pass its rows' acceptance asks for runs: the path at full acceptance. A worker measures
  what its draft calls cost and would run none (docs/speculative.md); `draft` with
  --spec-draft-model <the model> serves it so;
- draft-random: a tiny random-weight model with the served model's tokenizer and vocabulary
  (`mlxq make-tiny-model --tokenizer-from`), whose proposals are almost never accepted: what
  speculation costs when it cannot help;
- draft: --spec-draft-model, a real draft model;
- control: a second worker without speculation, measured as a drafter is: its ratio to `off` is the
  spread a shared machine's load alone gives two identical workers.

For each workload (spec_workloads.py: grounded, chat), sampling (greedy; sampled: --spec-temperature,
seeded per request) and row count of --spec-rows, every arm runs the same requests, all sent at once,
one arm after the other (the order reversed in every other of --repeats, so drift on a shared machine
hits every arm alike); a ratio is drafter tokens/s over `off` tokens/s within one repeat, the median
over repeats. Requests end at EOS (or --spec-new-tokens) unless --spec-ignore-eos. The workers' prefix
caches are off, so every repeat prefills as the first did. Acceptance is the accepted over the
proposed tokens the results report (their `speculation` field), summed over the run. Every greedy
arm's tokens must equal `off`'s, request by request (`text_identity`). Interrupted (Ctrl-C, SIGTERM),
the scenario stops its workers and reports the runs it made, marked `interrupted`.

With --spec-in-process each arm is its worker's scheduler and engine in the bench's own process
instead (spec_engines.py), built from the same settings, so the spread between worker processes does
not enter the ratios; the queue around the engine, the same in every arm, is left out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from mlxq.bench.arm_mlxq import MlxqCluster, drive
from mlxq.bench.config import BenchConfig
from mlxq.bench.spec_engines import EngineArm
from mlxq.bench.spec_workloads import spec_prompts
from mlxq.bench.stats import distribution, median, ratio
from mlxq.bench.text_check import TextCheck
from mlxq.bench.workloads import BenchRequest, RequestRecord, Tokenizer, Workload, all_at_once

SPEC_DRAFTERS = ("ngram", "draft-self", "draft-random", "draft", "control")
SAMPLINGS = ("greedy", "sampled")
BASELINE = "off"
SETTLE_TIMEOUT_S = 900.0
# The floor's draft: the tiny shape (2 layers of 64), so its own cost is next to nothing.
RANDOM_DRAFT_SHAPE, RANDOM_DRAFT_SEED = "tiny", 1


def random_draft(model_path: str, where: Path) -> str:
    """A random-weight draft model sharing `model_path`'s tokenizer and vocabulary size."""
    from worker.tiny_model import make_tiny_model

    path = where / "draft-random"
    if not (path / "config.json").exists():
        make_tiny_model(path, shape=RANDOM_DRAFT_SHAPE, seed=RANDOM_DRAFT_SEED, tokenizer_from=model_path)
    return str(path)


def arm_env(cfg: BenchConfig, arm: str, model_path: str, random_path: Optional[str]) -> dict[str, str]:
    """The worker settings of one arm (MLXQ_* variables: `mlxq worker`'s flags)."""
    env = {"MLXQ_PREFIX_CACHE_MB": "0"}  # every repeat prefills alike
    if arm in (BASELINE, "control"):
        return {**env, "MLXQ_SPECULATIVE": "off"}
    if cfg.spec_k is not None:
        env["MLXQ_SPECULATIVE_K"] = str(cfg.spec_k)
    if arm == "ngram":
        return {**env, "MLXQ_SPECULATIVE": "ngram"}
    draft = {"draft-self": model_path, "draft-random": random_path, "draft": cfg.spec_draft_model}[arm]
    if draft is None:
        raise ValueError(f"--spec-drafters {arm}: no draft model")
    if arm == "draft-self":  # unpriced: the path at full acceptance (module docstring)
        from worker.engines.speculation.speculator import DEFAULT_PASS_COST
        from worker.weight_prep import current_platform

        env["MLXQ_SPECULATIVE_PASS_COST"] = str(DEFAULT_PASS_COST[current_platform()])
    return {**env, "MLXQ_SPECULATIVE": "draft", "MLXQ_DRAFT_MODEL": str(draft)}


def payload(request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_token_ids": list(request.prompt.ids), "max_tokens": request.max_tokens,
                            "temperature": request.temperature, "ignore_eos": ignore_eos}
    if request.seed is not None:
        body["seed"] = request.seed
    return body


def speculation_of(records: list[RequestRecord]) -> dict[str, Any]:
    """The proposed and accepted draft tokens the results of `records` report (extra["speculation"],
    arm_mlxq.fill_from_result), summed."""
    reported = [r.extra["speculation"] for r in records if r.extra.get("speculation")]
    proposed = sum(int(spec.get("proposed", 0)) for spec in reported)
    accepted = sum(int(spec.get("accepted", 0)) for spec in reported)
    return {"proposed": proposed, "accepted": accepted, "results_reporting": len(reported),
            "acceptance": accepted / proposed if proposed else None}


def metrics(records: list[RequestRecord]) -> dict[str, Any]:
    """Throughput of one run: every token the finished requests produced, over first arrival to last finish."""
    done = [r for r in records if r.ok]
    finishes = [r.finished for r in records if r.finished is not None]
    wall = (max(finishes) - min(r.arrival for r in records)) if finishes else 0.0
    tokens = sum(r.tokens for r in done)
    reasons: dict[str, int] = {}
    for r in records:
        if not r.ok:
            reasons[(r.error or "unfinished")[:160]] = reasons.get((r.error or "unfinished")[:160], 0) + 1
    ttft = distribution([r.first_token - r.arrival if r.first_token is not None else None for r in done])
    return {"requests": len(records), "completed": len(done), "failed": len(records) - len(done),
            "failure_reasons": reasons, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": ttft["p50"] if ttft else None}


def worker_cpu_s(cluster: MlxqCluster) -> float:
    """CPU seconds the cluster's worker processes have used: the work a run costs, which the load of
    other processes on a shared machine changes far less than the wall time it takes."""
    import psutil

    total = 0.0
    for pid in cluster.pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def decode_rate(engine: dict[str, float]) -> Optional[float]:
    """Tokens per second of the worker's decode steps (verification steps among them), prefill left
    out: what speculation changes, where a CPU's prefill takes much of the wall time."""
    return ratio(engine.get("engine_decode_tokens"), engine.get("engine_decode_s"))


class SpeculativeRun:
    """The arms' workers, the runs, and what the report says of them."""

    def __init__(self, cfg: BenchConfig, tokenizer: Tokenizer,
                 make_cluster: Callable[[int, int, Optional[dict[str, str]]], MlxqCluster], model_path: str) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.make_cluster = make_cluster
        self.model_path = model_path
        self.arms = [BASELINE, *cfg.spec_drafters]
        self.rows = max(cfg.spec_rows)
        self.prompts = {kind: spec_prompts(tokenizer, kind, self.rows) for kind in cfg.spec_workloads}
        self.runs: list[dict[str, Any]] = []
        eos = {int(t) for t in getattr(tokenizer, "eos_token_ids", ())}
        self.text_check = TextCheck(tokenizer, {}, eos)
        self.clusters: dict[str, Any] = {}  # an MlxqCluster per arm, or an EngineArm (--spec-in-process)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        random_path = random_draft(self.model_path, cfg.logs) if "draft-random" in self.arms else None
        envs = {arm: arm_env(cfg, arm, self.model_path, random_path) for arm in self.arms}
        plan = [(kind, sampling, n) for kind in cfg.spec_workloads for sampling in cfg.spec_sampling
                for n in cfg.spec_rows]
        interrupted = False
        try:
            for arm in self.arms:
                where = "engine in this process" if cfg.spec_in_process else "worker"
                print(f"   starting the {arm} {where} ({', '.join(f'{k}={v}' for k, v in envs[arm].items())})",
                      flush=True)
                cluster = (EngineArm(envs[arm], self.model_path, self.rows) if cfg.spec_in_process
                           else self.make_cluster(1, self.rows, envs[arm]))
                self.clusters[arm] = cluster
                cluster.start()
            for arm, cluster in self.clusters.items():
                self._settle(arm, cluster)
            for repeat in range(cfg.repeats):
                for kind, sampling, n in plan:
                    order = self.arms if repeat % 2 == 0 else self.arms[::-1]
                    for arm in order:
                        self._one(arm, kind, sampling, n, repeat)
        except KeyboardInterrupt:  # a run stopped by a time limit still reports what it measured
            interrupted = True
            print("   interrupted: reporting the runs made so far", flush=True)
        finally:
            for cluster in self.clusters.values():
                cluster.stop()
        section = self.section(envs, random_path)
        return {**section, "interrupted": True} if interrupted else section

    def _settle(self, arm: str, cluster: Any) -> None:
        """Until the worker's background kernel build has ended (an engine in this process compiled its
        shapes when it was built), then one warm-up per row count with the first workload's prompts:
        they make the drafters propose, so the verification pass's shapes are traced before the timed
        runs (random prompts left that to the first repeat)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        tick = {"prompt_token_ids": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
        while (isinstance(cluster, MlxqCluster) and cluster.worker_stats("engine_").get("kernels_prebuilding") == "1"
               and time.monotonic() < deadline):
            time.sleep(2.0)
            cluster.results([cluster.client.submit(tick, queue=cluster.queue)], 120.0)  # type: ignore[union-attr]
        for n in self.cfg.spec_rows:
            prompts = self.prompts[self.cfg.spec_workloads[0]][:n]
            cluster.warm(all_at_once([BenchRequest(i, p, self.cfg.warmup_tokens) for i, p in enumerate(prompts)],
                                     f"warm-{n}"))
        print(f"   {arm}: warmed up at {', '.join(map(str, self.cfg.spec_rows))} rows", flush=True)

    def _one(self, arm: str, kind: str, sampling: str, n: int, repeat: int) -> None:
        cfg, cluster = self.cfg, self.clusters[arm]
        temperature = cfg.spec_temperature if sampling == "sampled" else 0.0
        requests = [BenchRequest(i, self.prompts[kind][i], cfg.spec_new_tokens, client=i, temperature=temperature,
                                 seed=cfg.seed + i if sampling == "sampled" else None) for i in range(n)]
        workload: Workload = all_at_once(requests, f"{kind}-{sampling}-{n}")
        make_payload: Callable[[BenchRequest], dict[str, Any]] = lambda r: payload(r, cfg.spec_ignore_eos)
        in_process = not isinstance(cluster, MlxqCluster)
        cpu_s = cluster.cpu_s if in_process else (lambda: worker_cpu_s(cluster))
        before, cpu_before = cluster.time_counters(), cpu_s()
        if in_process:
            records = cluster.drive(workload, make_payload)
        else:
            records = drive(cluster, workload, cfg.request_timeout_s, make_payload=make_payload)
        after, cpu_after = cluster.time_counters(), cpu_s()
        engine = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
        entry = {"arm": arm, "workload": kind, "sampling": sampling, "rows": n, "repeat": repeat,
                 **metrics(records), "decode_tokens_per_s": decode_rate(engine),
                 "worker_cpu_s": cpu_after - cpu_before,
                 "speculation": speculation_of(records), "engine": engine}
        if in_process:
            entry["pass_costs"] = cluster.pass_costs()
        first = min(records, key=lambda r: r.index)
        if repeat == 0 and first.extra.get("token_ids") is not None:  # what the model wrote, for the reader
            entry["first_text"] = self.tokenizer.decode(first.extra["token_ids"])[:400]
        self.runs.append(entry)
        if sampling == "greedy":
            self.text_check.add(arm, workload, repeat, records)
        acceptance = entry["speculation"]["acceptance"]
        print(f"   {workload.label:<18} {arm:<13} {entry['tokens_per_s'] or 0:8.1f} tok/s  {entry['tokens']:5d} tokens "
              f"in {entry['wall_s']:6.1f} s  failed {entry['failed']}/{n}"
              + (f"  accepted {100 * acceptance:.0f}%" if acceptance is not None else "")
              + "".join(f"  {name} {cost:.2f}" for name, cost in entry.get("pass_costs", {}).items()), flush=True)

    def section(self, envs: dict[str, dict[str, str]], random_path: Optional[str]) -> dict[str, Any]:
        cfg = self.cfg
        identity = self.text_check.report()
        return {
            "arms": {arm: {"env": envs[arm]} for arm in self.arms},
            "random_draft": random_path,
            "rows": list(cfg.spec_rows), "repeats": cfg.repeats, "new_tokens": cfg.spec_new_tokens,
            "ignore_eos": cfg.spec_ignore_eos, "temperature": cfg.spec_temperature, "k": cfg.spec_k,
            "prompt_tokens": {kind: _lengths(prompts) for kind, prompts in self.prompts.items()},
            "runs": self.runs,
            "comparisons": compare(self.runs, self.arms),
            "text_identity": {**identity, "all_equal_off": all_equal_baseline(identity)},
            "in_process": cfg.spec_in_process,
            "method": ("one engine per arm in the bench's process (the worker's scheduler and engine, built from "
                       "its settings; no queue), all built first" if cfg.spec_in_process else
                       "one worker per arm, all started first") + "; each workload's requests sent at once to one arm "
                      "after the other, the order reversed every other repeat; ratio = drafter tok/s / off tok/s "
                      "within a repeat, median over repeats (decode ratio: of the workers' decode-step tokens/s; "
                      "CPU-time ratio: off's worker CPU seconds over the drafter's); acceptance = accepted / proposed draft tokens "
                      "summed over the results' `speculation` fields; prefix cache off in every worker",
        }


def _lengths(prompts: list[Any]) -> dict[str, float]:
    sizes = [len(p.ids) for p in prompts]
    return {"min": min(sizes), "max": max(sizes), "mean": sum(sizes) / len(sizes)}


def compare(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """Each drafter against `off` per (workload, sampling, rows): tokens/s (median over repeats), the
    paired ratio of each repeat and their median, and the acceptance over all repeats."""
    out = []
    cases = list(dict.fromkeys((r["workload"], r["sampling"], r["rows"]) for r in runs))
    for kind, sampling, n in cases:
        here = [r for r in runs if (r["workload"], r["sampling"], r["rows"]) == (kind, sampling, n)]
        base = {r["repeat"]: r["tokens_per_s"] for r in here if r["arm"] == BASELINE}
        for arm in arms:
            if arm == BASELINE:
                continue
            mine = {r["repeat"]: r for r in here if r["arm"] == arm}
            each = [x for rep in sorted(mine) if (x := ratio(mine[rep]["tokens_per_s"], base.get(rep))) is not None]
            cpu_base = {r["repeat"]: r for r in here if r["arm"] == BASELINE}
            cpu_each = [x for rep in sorted(mine) if rep in cpu_base
                        and (x := ratio(cpu_base[rep].get("worker_cpu_s"), mine[rep].get("worker_cpu_s"))) is not None]
            decode_base = {r["repeat"]: r.get("decode_tokens_per_s") for r in here if r["arm"] == BASELINE}
            decode_each = [x for rep in sorted(mine)
                           if (x := ratio(mine[rep].get("decode_tokens_per_s"), decode_base.get(rep))) is not None]
            proposed = sum(r["speculation"]["proposed"] for r in mine.values())
            accepted = sum(r["speculation"]["accepted"] for r in mine.values())
            out.append({"workload": kind, "sampling": sampling, "rows": n, "drafter": arm,
                        "tokens_per_s": median([r["tokens_per_s"] for r in mine.values()]),
                        "off_tokens_per_s": median(list(base.values())),
                        "ratio": median(each), "ratios_each_repeat": each,
                        "decode_ratio": median(decode_each), "decode_ratios_each_repeat": decode_each,
                        "cpu_ratio": median(cpu_each), "cpu_ratios_each_repeat": cpu_each,
                        "proposed": proposed, "accepted": accepted,
                        "acceptance": accepted / proposed if proposed else None,
                        "reported_speculation": any(r["speculation"]["results_reporting"] for r in mine.values())})
    return out


def all_equal_baseline(identity: dict[str, Any]) -> Optional[bool]:
    """Whether every greedy request of every arm wrote `off`'s tokens (None: nothing compared)."""
    if identity.get("agreement_arm") != BASELINE:
        return None
    key = f"requests_same_as_{BASELINE}"
    checked = [(same, compared, a["requests"]) for w in identity["workloads"].values() for a in w["arms"].values()
               for same, compared in zip(a[key], a["requests_compared"])]
    return bool(checked) and all(same == compared == total for same, compared, total in checked)


def _f(value: Optional[float], digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def speculative_lines(s: dict[str, Any]) -> str:
    """The scenario's summary line and its table (markdown)."""
    same = {None: "not compared", True: "yes", False: "NO"}[s["text_identity"].get("all_equal_off")]
    arms = "engines in one process" if s.get("in_process") else "workers"
    lines = [f"- speculative decoding (rows {', '.join(map(str, s['rows']))}; up to {s['new_tokens']} new tokens"
             f"{', EOS ignored' if s['ignore_eos'] else ', ending at EOS'}; {s['repeats']} repeat(s), arms "
             f"({arms}) interleaved; ratio = drafter / off tok/s end to end, median of the repeats' own; decode "
             f"ratio: the same of the decode steps' tokens/s, prefill left out; CPU-time ratio: off's CPU seconds "
             f"over the drafter's for the same requests; every greedy request's tokens "
             f"= off's: {same})", "",
             "| workload | sampling | rows | off tok/s | drafter | tok/s | ratio | each repeat | decode ratio "
             "| CPU-time ratio | acceptance |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for c in s["comparisons"]:
        acceptance = (f"{100 * c['acceptance']:.0f}% ({c['accepted']}/{c['proposed']})" if c["acceptance"] is not None
                      else ("0 proposed" if c["reported_speculation"] else "not reported"))
        lines.append(f"| {c['workload']} | {c['sampling']} | {c['rows']} | {_f(c['off_tokens_per_s'])} | "
                     f"{c['drafter']} | {_f(c['tokens_per_s'])} | {_f(c['ratio'], 2)} | "
                     f"{', '.join(_f(x, 2) for x in c['ratios_each_repeat']) or '—'} | {_f(c.get('decode_ratio'), 2)} "
                     f"| {_f(c.get('cpu_ratio'), 2)} | {acceptance} |")
    return "\n".join(lines)


def plot_speculative(s: dict[str, Any], path: Path) -> None:
    """One column per workload and sampling: tokens/s per arm (top) and each drafter's ratio to `off`
    (bottom: the median line, each repeat's a dot; the legend gives its acceptance), against the row count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    comparisons = s["comparisons"]
    if not comparisons:
        return
    cases = list(dict.fromkeys((c["workload"], c["sampling"]) for c in comparisons))
    drafters = list(dict.fromkeys(c["drafter"] for c in comparisons))
    colors = {arm: f"C{i}" for i, arm in enumerate([BASELINE, *drafters])}
    fig, axes = plt.subplots(2, len(cases), figsize=(4.6 * len(cases), 8), squeeze=False)
    for j, (kind, sampling) in enumerate(cases):
        top, bottom = axes[0][j], axes[1][j]
        mine = [c for c in comparisons if (c["workload"], c["sampling"]) == (kind, sampling)]
        base = {c["rows"]: c["off_tokens_per_s"] for c in mine}
        xs = sorted(base)
        top.plot(xs, [base[x] or float("nan") for x in xs], marker="o", color=colors[BASELINE], label=BASELINE)
        for drafter in drafters:
            pts = sorted(((c["rows"], c) for c in mine if c["drafter"] == drafter), key=lambda p: p[0])
            rows = [x for x, _ in pts]
            top.plot(rows, [c["tokens_per_s"] or float("nan") for _, c in pts], marker="o", color=colors[drafter],
                     label=drafter)
            proposed = sum(c["proposed"] for _, c in pts)
            accepted = sum(c["accepted"] for _, c in pts)
            reported = any(c["reported_speculation"] for _, c in pts)
            share = (f"{100 * accepted / proposed:.0f}% accepted" if proposed
                     else "none proposed" if reported else "not reported")
            bottom.plot(rows, [c["ratio"] or float("nan") for _, c in pts], marker="o", color=colors[drafter],
                        label=f"{drafter} ({share})")
            for x, c in pts:  # each repeat's own ratio: the spread the medians come from
                bottom.scatter([x] * len(c["ratios_each_repeat"]), c["ratios_each_repeat"], s=14, alpha=0.4,
                               color=colors[drafter])
        bottom.axhline(1.0, color="grey", linewidth=1)
        for ax, title, ylabel in ((top, f"{kind}, {sampling}: generated tokens/s", "tokens/s"),
                                  (bottom, f"{kind}, {sampling}: drafter / off", "tokens/s ratio (paired)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(s["rows"]))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("rows (requests at once)")
            ax.set_title(title, fontsize=10)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"mlxq bench --scenario speculative: up to {s['new_tokens']} new tokens a request, "
                 f"median of {s['repeats']} interleaved repeat(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speculative(cfg: BenchConfig, tokenizer: Tokenizer,
                make_cluster: Callable[[int, int, Optional[dict[str, str]]], MlxqCluster],
                model_path: str) -> dict[str, Any]:
    return SpeculativeRun(cfg, tokenizer, make_cluster, model_path).run()
