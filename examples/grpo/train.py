"""A small GRPO loop on the tiny random-weight model, driven only through the queue.

    python examples/grpo/train.py --steps 6                    # its own Redis, tiny model and worker
    python examples/grpo/train.py --url redis://... --model DIR --steps 20   # your workers (serving DIR)

Each step waits for the batch submitted the step before (prompts x n samples), checks it (every job
finished, none on a version below its minimum, the returned logprobs equal the trainer's replay
under the versions each result records, within 1e-4), takes one GRPO step on it, submits the next
batch (at least the version just published), and once that batch is decoding publishes the new
parameters as the next version under the step's policy (drain, abort, inflight in turn), so that
every swap lands on running sequences. README.md says more.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import worker  # noqa: F401  (points MLX at an optimized BLAS on Linux, before mlx is imported)

from policy import Sample, Trainer, save_version
from rollouts import Batch, BatchCheck, batch_requests, collect

from mlxq.demo import worker_process
from mlxq.redis_server import existing_or_private
from producer import Client, WaitTimeout
from schemas import GenerationResult

POLICIES = ("drain", "abort", "inflight")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="Redis of running workers (default: start a private redis-server and a worker)")
    p.add_argument("--model", help="the model directory the workers serve, which the trainer loads too "
                                   "(default without --url: build the tiny random-weight model)")
    p.add_argument("--model-name", help="the name the workers serve it under (default: the directory's name)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (default 4)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the importance ratio")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="the swap policies the steps cycle through (default drain,abort,inflight)")
    p.add_argument("--versions-dir", type=Path,
                   help="where versions are written; the workers must read it unless --upload (default: a temp dir)")
    p.add_argument("--upload", action="store_true", help="stream each version through Redis instead")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a batch or a publish")
    p.add_argument("--report", type=Path, help="write the run's steps and checks as JSON here")
    args = p.parse_args(argv)
    args.policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    if bad := [x for x in args.policies if x not in POLICIES]:
        p.error(f"--policies: {bad} not among {', '.join(POLICIES)}")
    if args.url and not args.model:
        p.error("--model: with --url, name the model directory the workers serve (the trainer starts from it)")
    return args


class Loop:
    """The training loop: check and train on a batch, submit the next at the version just published,
    and publish the new version once that batch is decoding, so that each swap lands on it."""

    def __init__(self, args: argparse.Namespace, client: Client, model_path: str, versions_dir: Path) -> None:
        self.args, self.client, self.versions_dir = args, client, versions_dir
        self.name = args.model_name or Path(model_path).name
        self.trainer = Trainer(model_path, args.learning_rate, args.clip)
        self.steps: list[dict[str, Any]] = []
        self.version = 0  # the latest published version (0: the weights the workers loaded)

    def submit(self, step: int) -> Batch:
        requests = batch_requests(self.name, step, self.args.prompts, self.args.n, self.args.max_tokens, self.version)
        return Batch(step, self.client.submit_many(requests), self.version)

    def gather(self, batch: Batch) -> dict[str, GenerationResult]:
        try:
            return self.client.wait_many(batch.job_ids, timeout=self.args.timeout)
        except WaitTimeout:  # those without a result count as lost
            found = {job_id: self.client.result(job_id) for job_id in batch.job_ids}
            return {job_id: r for job_id, r in found.items() if r is not None}

    def check(self, batch: Batch, results: dict[str, GenerationResult]) -> tuple[list[Sample], BatchCheck]:
        return collect(batch, results, set(self.trainer.versions.versions), self.trainer.replay)

    def catch_up(self) -> Optional[dict[str, Any]]:
        """Workers on a version an earlier run published get the trainer's starting parameters as
        the next version first, so that both go on from the same weights."""
        published = self.client.latest_weights(self.name)
        latest = published.version if published is not None else None
        if not latest:
            return None
        self.version = latest
        published = self.publish("drain", None)
        self.trainer.versions.forget_below(self.version)
        return published

    def publish(self, policy: str, decoding: Optional[Batch]) -> dict[str, Any]:
        """The current parameters as the next version, while `decoding` runs."""
        version = self.version + 1
        path = save_version(self.trainer.snapshot(version), self.versions_dir / f"v{version}")
        running = sum(self.client.status(j) == "started" for j in decoding.job_ids) if decoding else 0
        started = time.perf_counter()
        outcome = self.client.publish_weights(self.name, version, str(path), policy, upload=self.args.upload,
                                              timeout=self.args.timeout)
        self.version = version
        return {"version": version, "policy": policy, "ok": outcome.ok, "seconds": time.perf_counter() - started,
                "jobs_running": running, "acked": sorted(outcome.acked), "missing": outcome.missing,
                "errors": outcome.errors}

    def run(self) -> bool:
        pending = self.submit(0)
        for step in range(self.args.steps):
            samples, check = self.check(pending, self.gather(pending))
            loss = self.trainer.update(samples) if samples else None
            ahead = self.submit(step + 1)  # at the version just published; the new one is swapped in as it decodes
            self.wait_started(ahead)
            published = self.publish(self.args.policies[step % len(self.args.policies)], ahead)
            # every result of `ahead` records a version >= its minimum: older parameters are not needed again
            self.trainer.versions.forget_below(ahead.min_version)
            self.record(step, pending, check, samples, loss, published)
            pending = ahead
        samples, check = self.check(pending, self.gather(pending))  # the last batch: checked, not trained on
        self.record(self.args.steps, pending, check, samples, None, None)
        return all(s["checks"]["ok"] and (s["publish"] is None or s["publish"]["ok"]) for s in self.steps)

    def wait_started(self, batch: Batch) -> None:
        """Until a worker has taken every job of the batch (or the timeout passed)."""
        deadline = time.monotonic() + self.args.timeout
        while any(self.client.status(j) == "queued" for j in batch.job_ids) and time.monotonic() < deadline:
            time.sleep(0.01)

    def record(self, step: int, batch: Batch, check: BatchCheck, samples: list[Sample], loss: Optional[float],
               published: Optional[dict[str, Any]]) -> None:
        mean_reward = sum(s.reward for s in samples) / len(samples) if samples else None
        mean_tokens = sum(len(s.token_ids) for s in samples) / len(samples) if samples else None
        self.steps.append({"step": step, "batch": batch.step, "job_ids": batch.job_ids,
                           "min_weight_version": batch.min_version, "mean_reward": mean_reward,
                           "mean_tokens": mean_tokens, "loss": loss, "checks": check.as_json(), "publish": published})
        by_version = ", ".join(f"v{v}: {c}" for v, c in sorted(check.versions.items()))
        line = (f"step {step}: batch {batch.step} (min v{batch.min_version}) {check.finished}/{check.jobs} jobs, "
                f"choices by version {{{by_version}}}, {check.mixed} mixed; logprobs max |diff| "
                f"{check.max_logprob_error:.1e} over {check.tokens_checked} tokens")
        if mean_reward is not None:
            line += f"; reward {mean_reward:.1f} in {mean_tokens:.0f} tokens"
        if loss is not None:
            line += f", loss {loss:+.4f}"
        if published is not None:
            line += (f"; v{published['version']} published ({published['policy']}, {published['jobs_running']} jobs "
                     f"of batch {batch.step + 1} running) in {published['seconds']:.2f} s"
                     + ("" if published["ok"] else f" FAILED {published['errors'] or published['missing']}"))
        if not check.ok:
            line += f"  CHECK FAILED: {json.dumps(check.as_json())}"
        print(line, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mlxq-grpo-")))
        url = stack.enter_context(existing_or_private(args.url, announce=True))
        model = args.model
        if model is None:
            from worker.tiny_model import make_tiny_model

            model = str(make_tiny_model(workdir / "tiny", dtype="float32"))
        client = stack.enter_context(Client(url))
        if args.url is None:
            log_path = (args.report.parent if args.report else workdir) / "grpo-worker.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = stack.enter_context(log_path.open("wb"))
            stack.enter_context(worker_process(url, model, name="grpo", log_level="INFO", log=log))
            print(f"started a worker on {model} (log: {log_path})", flush=True)
        loop = Loop(args, client, model, args.versions_dir or workdir / "versions")
        # the first job waits for a worker that has loaded the model
        client.wait(client.submit({"model": loop.name, "prompt": "warm up", "max_tokens": 2}), timeout=args.timeout)
        if (start := loop.catch_up()) is not None:
            print(f"the workers were on version {start['version'] - 1}: published the starting weights as "
                  f"version {start['version']}", flush=True)
            if not start["ok"]:
                print(f"that publish failed: {start['errors'] or start['missing']}")
                return 1
        started = time.perf_counter()
        ok = loop.run()
        summary = {"ok": ok, "seconds": time.perf_counter() - started, "policies": list(args.policies),
                   "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "steps": loop.steps}
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(summary, indent=1))
        print(f"{'every check passed' if ok else 'CHECKS FAILED'} ({summary['seconds']:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
