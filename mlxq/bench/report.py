"""Turn a finished run into report.json, table.md and plot.png (and soak.png when soak ran)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from mlxq.bench.images import images_line
from mlxq.bench.structured import summary_line as structured_summary_line
from mlxq.bench import scenario_gateway, scenario_rl_swap, scenario_speculative, scenario_startup, scenario_weights
from mlxq.bench.stats import median, ratio
from mlxq.bench.text_check import identity_lines

ARM_ORDER = ("A", "B", "K", "S", "C1", "C2", "C3", "C4", "D", "E")


def _order(arm: str) -> int:
    return ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER)


def runs(report: dict[str, Any], arm: str, label: str) -> dict[int, dict[str, Any]]:
    """{repeat: metrics} of every run of `arm` on workload `label` that completed."""
    return {entry.get("repeat", 0): entry["metrics"] for entry in report["results"]
            if entry["arm"] == arm and entry["workload"]["label"] == label and entry["status"] == "ok"}


def find(report: dict[str, Any], arm: str, label: str) -> Optional[dict[str, Any]]:
    """The metrics of `arm` on workload `label`; with repeats, those of its median run by tokens/s."""
    found = sorted(runs(report, arm, label).values(), key=lambda m: m["tokens_per_s"] or 0.0)
    return found[(len(found) - 1) // 2] if found else None


def paired_ratios(report: dict[str, Any], label: str, numerator: str, denominator: str) -> list[float]:
    """numerator/denominator tokens/s within each repeat that both completed (interleaved runs
    share that repeat's machine conditions)."""
    top, bottom = runs(report, numerator, label), runs(report, denominator, label)
    values = [ratio(top[r]["tokens_per_s"], bottom[r]["tokens_per_s"]) for r in sorted(top) if r in bottom]
    return [v for v in values if v is not None]


def headline(report: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """The issue's ratios at one closed-loop concurrency: mlxq with one worker against each arm;
    with repeats, the median of the repeats' own ratios, each repeat's listed."""
    label = f"closed-{concurrency}"
    c_arms = sorted({e["arm"] for e in report["results"] if e["arm"].startswith("C")}, key=_order)
    c_key = "C1" if "C1" in c_arms else (c_arms[0] if c_arms else "C1")

    def tps(arm: str) -> Optional[float]:
        metrics = find(report, arm, label)
        return metrics["tokens_per_s"] if metrics else None

    def ttft(arm: str) -> Optional[float]:
        metrics = find(report, arm, label)
        return metrics["ttft_s"]["p50"] if metrics and metrics["ttft_s"] else None

    arms = sorted({e["arm"] for e in report["results"]}, key=_order)
    # C against each other arm; each other worker count against the engine bound and the servers too.
    pairs = [(c_key, other) for other in ("B", "A", "D", "E")]
    pairs += [(extra, other) for extra in c_arms if extra != c_key for other in ("B", "D", "E")]
    each = {f"C/{b}" if a == c_key else f"{a}/{b}": paired_ratios(report, label, a, b) for a, b in pairs}
    if "S" in arms:  # where C's gap to B lies: mlxq's engine wrapper (S/B) or the queue around it (C/S)
        each.update({"S/B": paired_ratios(report, label, "S", "B"), "C/S": paired_ratios(report, label, c_key, "S")})
    if "K" in arms:  # mlxq's compiled decode engine alone against mlx-lm's BatchGenerator
        each["K/B"] = paired_ratios(report, label, "K", "B")
    ratios = {key: median(values) for key, values in each.items()}
    return {
        "concurrency": concurrency,
        "c_arm": c_key,
        "tokens_per_s": {arm: tps(arm) for arm in arms},
        "ttft_p50_s": {arm: ttft(arm) for arm in arms},
        "failed": {arm: (find(report, arm, label) or {}).get("failed") for arm in arms},
        "ratios": ratios,
        "ratios_each_repeat": each,
    }


def write_all(report: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (out / "table.md").write_text(table)
    try:
        if any(e["status"] == "ok" and e["workload"]["kind"] == "closed" for e in report["results"]):
            plot(report, out / "plot.png")
        if "soak" in report.get("scenarios", {}):
            plot_soak(report["scenarios"]["soak"], out / "soak.png")
        spec = report.get("scenarios", {}).get("speculative")
        if spec and "comparisons" in spec:
            scenario_speculative.plot_speculative(spec, out / "speculative.png")
    except ImportError:
        table += "\n(no plot: matplotlib is not installed; pip install 'mlxq[bench]')\n"
    return table


def _f(value: Optional[float], digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pcts(dist: Optional[dict[str, float]]) -> str:
    if not dist:
        return "—"
    return " / ".join(f"{dist[p]:.2f}" for p in ("p50", "p95", "p99"))


def _arm_cell(entry: dict[str, Any], repeats: int) -> str:
    return f"{entry['arm']} #{entry.get('repeat', 0) + 1}" if repeats > 1 else str(entry["arm"])


def markdown(report: dict[str, Any]) -> str:
    settings, model, machine = report["settings"], report["model"], report["machine"]
    repeats = int(settings.get("repeats", 1))
    facts = model.get("facts", {})
    lines = [
        f"mlxq bench: {model.get('source', model['path'])}"
        + (f" ({facts.get('num_hidden_layers')} layers, hidden {facts.get('hidden_size')}, {facts.get('torch_dtype')})"
           if facts else ""),
        f"on {machine.get('cpu_model') or machine.get('machine')} ({machine.get('cpu_count')} CPUs); "
        f"{report['device']}; mlx-lm {report['versions'].get('mlx-lm')}; BLAS: {report['blas']}.",
    ]
    if report["results"]:  # the closed- and open-loop workloads' settings (each scenario states its own)
        lines.append(
            f"{settings['prompt_tokens']}-token prompts, {settings['new_tokens']}"
            + (f" +- {settings['new_tokens_spread']}" if settings.get("new_tokens_spread") else "")
            + " new tokens, greedy, EOS ignored; "
            f"max_num_seqs {settings['max_num_seqs']} for every batching arm. Latencies in seconds, p50 / p95 / p99.")
    lines.append("")
    for kind, title in (("closed", "Closed loop (N requests in flight)"), ("open", "Open loop (Poisson arrivals)")):
        rows = [e for e in report["results"] if e["workload"]["kind"] == kind]
        if not rows:
            continue
        col = "N" if kind == "closed" else "req/s in"
        lines += [f"### {title}", "",
                  f"| arm | {col} | gen tok/s | req/s | TTFT | end to end | queue p50 | failed |",
                  "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
        rows.sort(key=lambda e: (_order(e["arm"]), e["workload"].get("concurrency") or e["workload"].get("rate") or 0,
                                 e.get("repeat", 0)))
        for e in rows:
            w = e["workload"]
            x = w["concurrency"] if kind == "closed" else f"{w['rate']:g}"
            if e["status"] != "ok":
                lines.append(f"| {_arm_cell(e, repeats)} | {x} | {e['status']}: {str(e.get('error') or '')[:70]} "
                             "| | | | | |")
                continue
            m = e["metrics"]
            queue = m["queue_s"]["p50"] if m["queue_s"] else None
            lines.append(f"| {_arm_cell(e, repeats)} | {x} | {_f(m['tokens_per_s'])} | {_f(m['requests_per_s'], 2)} | "
                         f"{_pcts(m['ttft_s'])} | {_pcts(m['e2e_s'])} | {_f(queue, 2)} | "
                         f"{m['failed']}/{m['requests']} |")
        lines.append("")
    split_rows = [e for e in report["results"] if e.get("time_split") and e["status"] == "ok"]
    if split_rows:
        lines += ["### Where the engine's time went", "",
                  "Prefill and decode are mlx-lm's own `BatchGenerator.stats()` counters, plus the prefills "
                  "mlxq's engine runs itself (own); the rest of the wall time is spent outside the engine. "
                  "With several workers, the mean worker.", "",
                  "| arm | workload | wall s | prefill s (calls, own) | decode s (steps, ms/step) | outside s |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for e in sorted(split_rows, key=lambda e: (e["workload"]["label"], _order(e["arm"]), e.get("repeat", 0))):
            t, wall = e["time_split"], e["metrics"]["wall_s"]
            steps = t.get("engine_decode_steps", 0)
            lines.append(
                f"| {_arm_cell(e, repeats)} | {e['workload']['label']} | {_f(wall, 2)} | "
                f"{_f(t.get('engine_prefill_s'), 2)} "
                f"({t.get('engine_prefill_calls', 0):.0f}, {t.get('engine_own_prefills', 0):.0f}) | "
                f"{_f(t.get('engine_decode_s'), 2)} "
                f"({steps:.0f}, {_f(1000 * t['engine_decode_s'] / steps if steps else None)}) | "
                f"{_f(_outside(t, wall), 2)} |")
        lines.append("")
    head = report.get("headline")
    if head and any(v is not None for v in head["ratios"].values()):
        workers = head["c_arm"][1:] or "?"
        each = head.get("ratios_each_repeat", {})
        title = f"### Ratios at N = {head['concurrency']} (C = {head['c_arm']}: mlxq with {workers} worker(s))"
        if repeats > 1:
            lines += [title + f", median of {repeats} interleaved repeats", "",
                      "| ratio | median | each repeat |", "| --- | ---: | --- |"]
        else:
            lines += [title, "", "| ratio | value |", "| --- | ---: |"]
        for key, value in head["ratios"].items():
            runs_cell = f" {', '.join(_f(v, 2) for v in each.get(key, [])) or '—'} |" if repeats > 1 else ""
            lines.append(f"| {key} | {_f(value, 2)} |{runs_cell}")
        lines.append("")
    if report.get("text_identity", {}).get("workloads"):
        lines += identity_lines(report["text_identity"])
    found = scenario_lines(report.get("scenarios", {}))
    if found:
        lines += ["### Scenarios", "", *found, ""]
    unchecked = [k for k, v in report.get("blas_checks", {}).items() if v is False or v == [False]]
    if unchecked:
        lines += [f"WARNING: the BLAS library was not found mapped in arm(s) {', '.join(unchecked)}.", ""]
    arms = report.get("arms", {})
    skipped = [f"- {k}: {v['status']}: {v.get('reason')}" for k, v in arms.items() if v["status"] != "ok"]
    if skipped:
        lines += ["Arms not measured:", *skipped, ""]
    if arms:
        lines += ["Arms: " + "; ".join(f"{k} = {v['label']}" for k, v in arms.items()), ""]
    return "\n".join(lines)


def _outside(split: dict[str, float], wall: Optional[float]) -> Optional[float]:
    if wall is None:
        return None
    return wall - split.get("engine_prefill_s", 0.0) - split.get("engine_decode_s", 0.0)


def time_split_line(split: dict[str, float], wall: Optional[float]) -> str:
    """One console line: prefill, decode, the rest, and for mlxq the batch loop's sections."""
    steps = split.get("engine_decode_steps", 0.0)
    line = (f"prefill {split.get('engine_prefill_s', 0.0):.2f} s in {split.get('engine_prefill_calls', 0):.0f} calls "
            f"({split.get('engine_own_prefills', 0):.0f} own), decode {split.get('engine_decode_s', 0.0):.2f} s in "
            f"{steps:.0f} steps, outside the engine {_f(_outside(split, wall), 2)} s")
    loop = {k[len("loop_"):-2]: v for k, v in split.items() if k.startswith("loop_")}
    if loop:
        line += "; loop: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in sorted(loop.items()))
    workers = int(split.get("workers", 1))
    return line + (f" (the mean of {workers} workers)" if workers > 1 else "")


def scenario_lines(scenarios: dict[str, Any]) -> list[str]:
    """One line per scenario run, in a fixed order; a scenario that failed says why."""
    return [f"- {name}: {s['error']}" if "error" in s else line(s)
            for name, line in _SCENARIO_LINES.items() if (s := scenarios.get(name)) is not None]


def _overhead_line(o: dict[str, Any]) -> str:
    t, p = o["throughput"], o["publish"]
    plain = p.get("plain_step_p50_ms")
    sustained = t.get("sustained") or {}
    return (f"- overhead (FakeEngine worker): {_f(t['jobs_per_s'], 0)} jobs/s end to end for {t['jobs']} "
            f"jobs submitted at once (the worker itself {_f(t.get('worker_jobs_per_s'), 0)}), "
            f"{_f(sustained.get('jobs_per_s'), 0)} jobs/s sustained while "
            f"{_f(sustained.get('offered_per_s'), 0)} jobs/s were offered and "
            f"{_f(sustained.get('submitted_per_s'), 0)} submitted; "
            f"step interval {_f(plain)} ms plain, {_f(p['publish_step_ms'])} ms in the step that ended "
            f"{p['burst_jobs']} jobs (their batch's plain steps {_f(p.get('burst_batch_step_p50_ms'))} ms), "
            f"{_f(p.get('publishing_step_ms'))} ms at most in the steps while their "
            f"results were published, {_f(p['admit_step_ms'])} ms at most while "
            f"they joined (fake step cost {p['fake_step_ms']:g} ms; medians of {len(p.get('rounds', []))} rounds)"
            + (f"; worker metrics on, scraped {o['metrics']['scrapes']} times" if o.get("metrics") else ""))


def _late_joiner_line(s: dict[str, Any]) -> str:
    each = ", ".join(f"{x:.2f}" for x in s.get("steps_to_first_token_each", []))
    return (f"- late joiner ({len(s.get('joins', []))} short jobs, one at a time, while {s['long_jobs']} long ones "
            f"decode): first token after {_f(s['first_token_after_submit_s'], 3)} s = "
            f"{_f(s['steps_to_first_token'], 2)} decode steps of {_f(s['decode_step_s'], 3)} s (median; each: {each})")


def _rl_line(r: dict[str, Any]) -> str:
    return (f"- RL rollouts ({r['prompts']} prompts x n={r['n']}, {r['prompt_tokens']}-token prompts, "
            f"{r['new_tokens']} new): n={r['n']} requests {_f(r['grouped']['tokens_per_s'])} tok/s vs "
            f"{r['prompts'] * r['n']} independent {_f(r['independent']['tokens_per_s'])} tok/s = "
            f"{_f(r['speedup'], 2)}x; independent with the prefix cache "
            f"{_f(r['independent_prefix_cache']['tokens_per_s'])} tok/s. Engine time, n={r['n']} vs independent: "
            f"prefill {_engine_pair(r, 'prefill_s')} s, decode {_engine_pair(r, 'decode_s')} s; the speedup "
            f"that engine time allows: {_f(r.get('engine_time_speedup'), 2)}x")


def _engine_pair(r: dict[str, Any], name: str) -> str:
    def seconds(run: str) -> Optional[float]:
        return r[run].get("engine", {}).get(name)  # reports before the split lack it

    return f"{_f(seconds('grouped'), 1)} vs {_f(seconds('independent'), 1)}"


def _prefix_cache_line(s: dict[str, Any]) -> str:
    on, off = s["cache_on"], s["cache_off"]
    rate = 100 * s["hit_rate"] if s["hit_rate"] is not None else None
    ideal = 100 * s["hit_rate_ideal"] if s["hit_rate_ideal"] is not None else None
    return (f"- prefix cache ({s['requests']} requests at once, a shared {s['shared_tokens']}-token "
            f"prefix + {s['own_tokens']} own tokens, {s['new_tokens']} new): cache on "
            f"{_f(on['tokens_per_s'])} tok/s, TTFT p50 {_f(on['ttft_p50_s'], 3)} s; off "
            f"{_f(off['tokens_per_s'])} tok/s, TTFT p50 {_f(off['ttft_p50_s'], 3)} s; "
            f"{_f(s['speedup'], 2)}x; hit rate {_f(rate)}% (the shared prefix is {_f(ideal)}% of the prompt tokens)")


def _soak_line(s: dict[str, Any]) -> str:
    rss = s["rss_mb"]
    return (f"- soak ({s['engine']} engine): {s['submitted']} jobs over {_f(s['duration_s'], 0)} s, "
            f"{s['lost']} lost, {s.get('still_pending_at_deadline', 0)} still queued or running at the "
            f"drain deadline, {s['valid_not_finished']} valid not finished, {s['invalid_not_failed']} "
            f"invalid not failed; worker RSS {_f(rss['first'] if rss else None, 0)} -> "
            f"{_f(rss['last'] if rss else None, 0)} MB (second half {_f(s['rss_growth_second_half_mb'])} MB)")


_SCENARIO_LINES = {
    "weights": scenario_weights.weights_line,
    "startup": scenario_startup.startup_line,
    "overhead": _overhead_line,
    "late-joiner": _late_joiner_line,
    "rl": lambda r: "\n".join(([_rl_line(r)] if "grouped" in r else []) + scenario_rl_swap.rl_lines(r)),
    "prefix-cache": _prefix_cache_line,
    "soak": _soak_line,
    "structured": structured_summary_line,
    "gateway-stream": scenario_gateway.stream_line,
    "gateway-blocking": scenario_gateway.blocking_line,
    "images": images_line,
    "speculative": scenario_speculative.speculative_lines,
}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [e for e in report["results"] if e["workload"]["kind"] == "closed" and e["status"] == "ok"]
    arms = sorted({e["arm"] for e in closed}, key=_order)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    concurrency_of = {e["workload"]["label"]: e["workload"]["concurrency"] for e in closed}
    labels = sorted(concurrency_of, key=concurrency_of.__getitem__)
    for arm in arms:
        medians = [(concurrency_of[label], m) for label in labels if (m := find(report, arm, label)) is not None]
        xs = [x for x, _ in medians]
        axes[0].plot(xs, [m["tokens_per_s"] or 0 for _, m in medians], marker="o", label=arm)
        ttft = [(m["ttft_s"] or {}) for _, m in medians]
        line, = axes[1].plot(xs, [t.get("p50", float("nan")) for t in ttft], marker="o", label=f"{arm} p50")
        axes[1].plot(xs, [t.get("p99", float("nan")) for t in ttft], linestyle="--", color=line.get_color(),
                     label=f"{arm} p99")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    concurrency = sorted({e["workload"]["concurrency"] for e in closed})
    for ax, title, ylabel in ((axes[0], "generated tokens/s (closed loop)", "tokens/s"),
                              (axes[1], "TTFT p50 (solid) / p99 (dashed)", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    axes[1].set_yscale("log")
    head = report.get("headline") or {}
    label = f"closed-{head.get('concurrency')}"
    bars = [(arm, m["e2e_s"]) for arm in arms if (m := find(report, arm, label)) is not None and m["e2e_s"]]
    bars.sort(key=lambda b: _order(b[0]))
    width = 0.25
    for i, pct in enumerate(("p50", "p95", "p99")):
        axes[2].bar([j + (i - 1) * width for j in range(len(bars))], [b[1][pct] for b in bars], width, label=pct)
    axes[2].set_xticks(range(len(bars)), [b[0] for b in bars])
    axes[2].set_title(f"end-to-end latency at N = {head.get('concurrency')}")
    axes[2].set_ylabel("seconds")
    axes[2].legend()
    fig.suptitle(f"mlxq bench: {Path(report['model']['path']).name}; {report['device']}; "
                 f"BLAS {report['blas'].split(' (')[0]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_soak(soak: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = soak.get("series") or []
    if not series:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    ts = [s["t"] for s in series]
    ax.plot(ts, [s["rss_mb"] for s in series], color="tab:red", label="worker RSS (MB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("worker RSS (MB)", color="tab:red")
    other = ax.twinx()
    other.plot(ts, [s["jobs_per_s"] for s in series], color="tab:blue", alpha=0.6, label="jobs/s")
    other.set_ylabel("jobs completed per second", color="tab:blue")
    ax.set_title(f"soak: {soak['submitted']} jobs, {soak['lost']} lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
