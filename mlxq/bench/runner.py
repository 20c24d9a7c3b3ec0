"""One `mlxq bench` run: build the workloads once, run every arm on them in turn (each arm warmed
up, started and stopped on its own), then the chosen scenarios, and write the report. A partial
report is written even when a run is interrupted or an arm fails."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from typing import Any, Optional

from tqdm import tqdm

from mlxq.bench.arms import Arm, ArmSkipped
from mlxq.bench.config import ARM_LABELS, BenchConfig
from mlxq.bench.procs import (ProcessSet, machine_facts, model_facts, prepared_copy, redis_server_version,
                              resolve_model, interrupt_on_signals, versions)
from mlxq.bench.report import headline, scenario_lines, time_split_line, write_all
from mlxq.bench.stats import summarize
from mlxq.bench.text_check import Output, TextCheck, reference_outputs
from mlxq.bench.workloads import Tokenizer, Workload, closed_loop, make_prompts, open_loop, spread_lengths
from mlxq.redis_server import existing_or_private

IN_PROCESS = ("A", "B", "S", "K")  # arms that run in this process, on its one loaded model


def build_workloads(cfg: BenchConfig, tokenizer: Tokenizer) -> list[tuple[Workload, Workload]]:
    """(workload, its warm-up pass) pairs; warm-ups use their own prompts, so no prompt cache of a
    peer can serve the measured ones."""
    plan = []
    for n in cfg.concurrency:
        prompts = make_prompts(tokenizer, n * cfg.rounds, cfg.prompt_tokens, seed=cfg.seed, salt=f"closed-{n}")
        warm_n = min(n, cfg.max_num_seqs)
        warm = make_prompts(tokenizer, warm_n, cfg.prompt_tokens, seed=cfg.seed, salt=f"warmup-{n}")
        plan.append((spread_lengths(closed_loop(prompts, n, cfg.rounds, cfg.new_tokens), cfg.new_tokens_spread,
                                    seed=cfg.seed),
                     closed_loop(warm, warm_n, 1, cfg.warmup_tokens, label=f"warmup-{n}")))
    for rate in cfg.rates:
        prompts = make_prompts(tokenizer, cfg.open_requests, cfg.prompt_tokens, seed=cfg.seed, salt=f"open-{rate:g}")
        warm_n = min(8, cfg.max_num_seqs)
        warm = make_prompts(tokenizer, warm_n, cfg.prompt_tokens, seed=cfg.seed, salt=f"warmup-open-{rate:g}")
        plan.append((spread_lengths(open_loop(prompts, rate, cfg.new_tokens, seed=cfg.seed), cfg.new_tokens_spread,
                                    seed=cfg.seed),
                     closed_loop(warm, warm_n, 1, cfg.warmup_tokens, label=f"warmup-open-{rate:g}")))
    return plan


class Runner:
    def __init__(self, cfg: BenchConfig, argv: Optional[list[str]] = None) -> None:
        self.cfg = cfg
        self.argv = argv or sys.argv
        self.report: dict[str, Any] = {}
        self.records_path = cfg.out / "records.jsonl"
        self.progress = tqdm(disable=True)  # run() sets the real one
        self._peer: Optional[str] = None  # the model directory D and E load (_peer_model)
        self.text_check: Optional[TextCheck] = None  # each arm's greedy text (_throughput)

    def run(self) -> int:
        import worker  # noqa: F401  (the BLAS preload must come before anything imports mlx)
        from worker.platform import preload_blas

        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        for stale in ("records.jsonl", "plot.png", "soak.png", "speculative.png"):
            (cfg.out / stale).unlink(missing_ok=True)
        interrupt_on_signals()
        self.blas = preload_blas(os.environ.get("MLXQ_BLAS", "auto"))
        model, model_info = resolve_model(cfg.model, cfg.shape, cfg.dtype, cfg.model_cache)
        model_info["facts"] = model_facts(model)
        self.model = model
        import mlx.core as mx
        from mlx_lm import load

        tokenizer = load(model, lazy=True)[1]  # the tokenizer every arm's server would use
        self.tokenizer = tokenizer
        self.report = {
            "schema": "mlxq-bench/1",
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(self.argv),
            "machine": machine_facts(),
            "device": f"mlx {versions().get('mlx')}, {mx.default_device().type.name}",
            "blas": self.blas.name,
            "blas_path": self.blas.path,
            "versions": versions(),
            "model": model_info,
            "settings": {
                "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
                "new_tokens_spread": cfg.new_tokens_spread, "max_num_seqs": cfg.max_num_seqs,
                "prefill_batch_size": cfg.prefill_batch_size, "concurrency": list(cfg.concurrency),
                "rounds": cfg.rounds, "repeats": cfg.repeats, "rates": list(cfg.rates),
                "open_requests": cfg.open_requests,
                "workers": list(cfg.workers), "warmup_tokens": cfg.warmup_tokens, "seed": cfg.seed,
                "sampling": "greedy (temperature 0); EOS never ends a request (fixed lengths)",
                "scenarios": list(cfg.scenarios), "arms": list(cfg.arms), "weights": cfg.weights,
            },
            "arms": {}, "results": [], "scenarios": {},
        }
        print(f"mlxq bench: model {model}; {self.report['device']}; BLAS {self.blas.name}", flush=True)
        code = 0
        # On a terminal (stderr), one bar over the run: each arm's workloads, then each scenario.
        steps = (len(cfg.arms) * len(build_workloads(cfg, tokenizer)) * cfg.repeats if "throughput" in cfg.scenarios
                 else 0) + sum(name != "throughput" for name in cfg.scenarios)
        self.progress = tqdm(total=steps, desc="mlxq bench", unit="step", file=sys.stderr, disable=None, leave=False)
        try:
            with self.progress, ProcessSet(cfg.logs) as procs, existing_or_private(cfg.url) as url:
                self.report["redis_server"] = redis_server_version(url)
                if "throughput" in cfg.scenarios:
                    self._throughput(procs, url)
                self._scenarios(procs, url)
        except KeyboardInterrupt:
            print("\ninterrupted: every process it started is stopped; writing a partial report", flush=True)
            self.report["interrupted"] = True
            code = 130
        finally:
            if self.text_check is not None:
                self.report["text_identity"] = self.text_check.report()
            if self.report.get("results"):
                hc = min(cfg.concurrency, key=lambda n: abs(n - cfg.headline_concurrency))
                self.report["headline"] = headline(self.report, hc)
            table = write_all(self.report, cfg.out)
            print("\n" + table)
            written = [p.name for p in (cfg.out / n for n in ("report.json", "table.md", "plot.png", "soak.png",
                                                              "speculative.png", "records.jsonl")) if p.exists()]
            print(f"written to {cfg.out}: {', '.join(written)}")
        return code

    # --- the arms -------------------------------------------------------------------------
    def _arms(self, procs: ProcessSet, url: str) -> list[Arm]:
        from mlxq.bench.arm_local import EngineBoundArm, LocalModel, SchedulerArm, SequentialArm
        from mlxq.bench.arm_mlxq import MlxqArm, MlxqCluster
        from mlxq.bench.arm_server import ServerArm
        from mlxq.bench.arm_vllm_mlx import VllmMlxArm

        cfg, blas_path = self.cfg, self.blas.path
        self.local = LocalModel(self.model, cfg.weights)
        arms: list[Arm] = []
        for key in cfg.arms:
            if key == "A":
                arms.append(SequentialArm(self.local))
            elif key == "B":
                arms.append(EngineBoundArm(self.local, cfg.max_num_seqs, cfg.prefill_batch_size))
            elif key == "S":
                arms.append(SchedulerArm(self.local, cfg.max_num_seqs, cfg.prefill_batch_size))
            elif key == "K":
                from mlxq.bench.arm_engine import CompiledEngineArm

                longest = cfg.prompt_tokens + cfg.new_tokens + cfg.new_tokens_spread
                arms.append(CompiledEngineArm(self.local, cfg.max_num_seqs, cfg.prefill_batch_size, longest))
            elif key == "C":
                arms += [MlxqArm(MlxqCluster(url, self.model, w, cfg.max_num_seqs, cfg.prefill_batch_size, procs,
                                             blas_path=blas_path, env=self._weights_env()), cfg.request_timeout_s)
                         for w in cfg.workers]
            elif key == "D":
                eos = sorted(int(t) for t in self.tokenizer.eos_token_ids)
                arms.append(ServerArm(self._peer_model(), cfg.max_num_seqs, cfg.prefill_batch_size, eos, procs,
                                      cfg.request_timeout_s, blas_path))
            elif key == "E":
                arms.append(VllmMlxArm(self._peer_model(), cfg.vllm_mlx_venv, cfg.create_venv, cfg.max_num_seqs,
                                       cfg.prefill_batch_size, procs, cfg.request_timeout_s, blas_path))
        return arms

    def _peer_model(self) -> str:
        """The model directory D and E load as it is: with --weights worker, a copy in the worker's
        weight formats (mlxq/bench/procs.py prepared_copy), so their text and speed compare."""
        if self.cfg.weights == "as-loaded":
            return self.model
        if self._peer is None:
            self._peer, notes = prepared_copy(self.model, self.cfg.model_cache)
            if notes:
                self.report["model"]["peers_load"] = {"path": self._peer, "weight_formats": notes}
        return self._peer

    def _weights_env(self) -> dict[str, str]:
        """The workers' settings for --weights: as-loaded turns both of the worker's steps off."""
        return {"MLXQ_UPCAST": "0", "MLXQ_KEEP_QUANTIZED": "1"} if self.cfg.weights == "as-loaded" else {}

    def _throughput(self, procs: ProcessSet, url: str) -> None:
        """Every arm on every workload, `repeats` times over, interleaved: on a shared machine the
        drift between one repeat and the next then hits every arm of that repeat alike."""
        plan = build_workloads(self.cfg, self.tokenizer)
        arms = self._arms(procs, url)
        self.text_check = TextCheck(self.tokenizer, self._reference_outputs([w for w, _ in plan]))
        if not any(arm.key in IN_PROCESS for arm in arms):
            self.local.unload()
        repeats = self.cfg.repeats
        for repeat in range(repeats):
            for position, arm in enumerate(arms):
                entry = self.report["arms"].get(arm.key)
                if entry is not None and entry["status"] == "skipped":
                    continue
                self._run_arm(arm, plan, repeat)
                later = arms[position + 1:] if repeat == repeats - 1 else arms
                if not any(a.key in IN_PROCESS for a in later):
                    self.local.unload()
        if getattr(self.local, "formats", None):  # what the in-process arms' model was given at load
            self.report.setdefault("model", {})["weight_formats"] = self.local.formats
        self.report["blas_checks"] = {
            key: entry.get("info", {}).get("blas_loaded") for key, entry in self.report["arms"].items()
            if key not in IN_PROCESS  # they run in this process, whose BLAS is the report's `blas`
        }

    def _reference_outputs(self, workloads: list[Workload]) -> dict[str, Output]:
        """Each workload's first request alone through mlx-lm, greedy: the text every arm must write."""
        print(f"\n== the reference texts: {len(workloads)} request(s) alone through mlx-lm", flush=True)
        return reference_outputs(self.local.load(), self.local.tokenizer, workloads)

    def _run_arm(self, arm: Arm, plan: list[tuple[Workload, Workload]], repeat: int) -> None:
        label = ARM_LABELS[arm.key[0]] + (f", {arm.key[1:]} worker(s)" if arm.key.startswith("C") else "")
        entry: dict[str, Any] = self.report["arms"].setdefault(
            arm.key, {"label": label, "status": "ok", "methods": arm.methods})
        which = f" (repeat {repeat + 1} of {self.cfg.repeats})" if self.cfg.repeats > 1 else ""
        print(f"\n== {label}{which}", flush=True)
        try:
            arm.start()
            todo = [(w, warm) for w, warm in plan if self._wanted(arm, w, entry)]
            arm.run_all(todo, lambda workload, outcome: self._record(arm, workload, outcome, repeat))
            entry["info"] = arm.info()
        except ArmSkipped as exc:
            entry.update(status="skipped", reason=str(exc))
            print(f"   skipped: {exc}", flush=True)
            self.progress.update(len(plan))
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:2000])
            print(f"   failed: {exc}", flush=True)
            traceback.print_exc()
        finally:
            arm.stop()

    def _wanted(self, arm: Arm, workload: Workload, entry: dict[str, Any]) -> bool:
        cap = self.cfg.a_max_concurrency
        if arm.key == "A" and workload.kind == "closed" and (workload.concurrency or 0) > cap:
            if any(workload.label in note for note in entry.get("not_run", [])):
                return False
            entry.setdefault("not_run", []).append(
                f"{workload.label}: one job at a time, so N > {cap} only lengthens its queue (--a-max-concurrency)")
            return False
        return True

    def _record(self, arm: Arm, workload: Workload, outcome: Any, repeat: int) -> None:
        self.progress.update()
        result: dict[str, Any] = {"arm": arm.key, "workload": workload.describe(), "repeat": repeat}
        if isinstance(outcome, BaseException):
            result.update(status="failed", error=f"{type(outcome).__name__}: {outcome}"[:2000])
            print(f"   {workload.label:<14} failed: {outcome}", flush=True)
        else:
            metrics = summarize(workload, outcome)
            result.update(status="ok", metrics=metrics)
            ttft = metrics["ttft_s"]["p50"] if metrics["ttft_s"] else None
            print(f"   {workload.label:<14} {metrics['tokens_per_s'] or 0:9.1f} tok/s  "
                  f"TTFT p50 {ttft if ttft is not None else float('nan'):.3f} s  "
                  f"failed {metrics['failed']}/{metrics['requests']}", flush=True)
            if arm.time_split:
                result["time_split"] = arm.time_split
                print(f"   {'':<14} {time_split_line(arm.time_split, metrics['wall_s'])}", flush=True)
            if self.text_check is not None:
                self.text_check.add(arm.key, workload, repeat, outcome)
            with open(self.records_path, "a") as f:
                f.write(json.dumps({"arm": arm.key, "workload": workload.label, "repeat": repeat,
                                    "records": [r.to_json() for r in outcome]}) + "\n")
        self.report["results"].append(result)

    # --- scenarios ------------------------------------------------------------------------
    def _scenarios(self, procs: ProcessSet, url: str) -> None:
        from mlxq.bench import (images, scenario_gateway, scenario_rl_swap, scenario_speculative, scenario_startup,
                                scenario_weights, scenarios, soak, structured)
        from mlxq.bench.arm_mlxq import MlxqCluster

        cfg = self.cfg

        def make_cluster(workers: int, max_num_seqs: int, env: Optional[dict[str, str]] = None) -> MlxqCluster:
            return MlxqCluster(url, self.model, workers, max_num_seqs, cfg.prefill_batch_size, procs,
                               blas_path=self.blas.path, env={**self._weights_env(), **(env or {})})

        def soak_run() -> dict[str, Any]:
            if cfg.soak_engine == "fake":
                steps = str(cfg.logs / "soak-steps.json")
                cluster = scenarios.fake_cluster(cfg, url, procs, cfg.max_num_seqs, 0.0, steps)
                return soak.soak(cfg, None, cluster)
            return soak.soak(cfg, self.tokenizer, make_cluster(1, cfg.max_num_seqs))

        runs = {
            "overhead": lambda: scenarios.overhead(cfg, url, procs),
            "late-joiner": lambda: scenarios.late_joiner(cfg, self.tokenizer, make_cluster),
            "rl": lambda: scenario_rl_swap.rl(cfg, self.tokenizer, make_cluster, url, procs, self.model, self.blas.path),
            "prefix-cache": lambda: scenarios.prefix_cache(cfg, self.tokenizer, make_cluster),
            "soak": soak_run,
            "structured": lambda: structured.structured(cfg, self.model),
            "gateway-stream": lambda: scenario_gateway.gateway_stream(cfg, self.tokenizer, make_cluster, url, procs),
            "gateway-blocking": lambda: scenario_gateway.gateway_blocking(cfg, url, procs),
            "images": lambda: images.images(cfg, url, procs, self.blas.path),
            "weights": lambda: scenario_weights.weights(cfg, self.model, self.tokenizer),
            "startup": lambda: scenario_startup.startup(cfg, self.tokenizer, make_cluster),
            "speculative": lambda: scenario_speculative.speculative(cfg, self.tokenizer, make_cluster, self.model),
        }
        for name, run in runs.items():
            if name not in cfg.scenarios:
                continue
            print(f"\n== scenario {name}", flush=True)
            try:
                self.report["scenarios"][name] = run()
                print("\n".join(scenario_lines({name: self.report["scenarios"][name]})), flush=True)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                self.report["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                traceback.print_exc()
            finally:
                procs.stop_all()
                self.progress.update()


def run_bench(cfg: BenchConfig, argv: Optional[list[str]] = None) -> int:
    cfg.validate()
    return Runner(cfg, argv).run()


__all__ = ["BenchConfig", "Runner", "build_workloads", "run_bench"]
