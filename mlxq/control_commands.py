"""CLI verbs of the control plane (docs/rl.md): `publish-weights`, `publish-adapter`, `pause`, `resume`,
`abort`, `reset-prefix-cache`. Each prints the outcome as JSON (who acknowledged, who refused and why, who did
not answer) and exits 0 only if every live worker of the model applied the command."""

from __future__ import annotations

import argparse
import sys

from mlxq.producer_commands import add_url, handler
from producer import Client
from schemas.control import ControlOutcome

__all__ = ["register"]


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("publish-weights", help="swap a new weight version into a model's workers",
                              description="Make VERSION (a directory of safetensors in MLX's parameter naming) the "
                              "weights of every live worker serving MODEL.")
    p.add_argument("model")
    p.add_argument("version", type=int)
    p.add_argument("path", help="the version's directory (the workers read it, unless --upload)")
    p.add_argument("--policy", choices=("drain", "abort", "inflight"), default="drain",
                   help="running sequences finish on the old weights (drain), go back to their queues (abort), "
                   "or go on under the new ones (inflight); default drain")
    p.add_argument("--upload", action="store_true", help="stream the files through Redis (small models, adapters)")
    _common(p, lambda args, client: client.publish_weights(args.model, args.version, args.path, args.policy,
                                                           upload=args.upload, timeout=args.timeout))

    p = subparsers.add_parser("publish-adapter", help="make a LoRA adapter servable by a model's workers",
                              description="Make the LoRA adapter in PATH (adapter_config.json and "
                              "adapters.safetensors, as mlx_lm.lora writes them) the adapter NAME on every live "
                              "worker serving MODEL; requests name it in `adapter`.")
    p.add_argument("model")
    p.add_argument("name")
    p.add_argument("path", help="the adapter's directory (the workers read it, unless --upload)")
    p.add_argument("--upload", action="store_true", help="stream the files through Redis")
    _common(p, lambda args, client: client.publish_adapter(args.model, args.name, args.path, upload=args.upload,
                                                           timeout=args.timeout))

    p = subparsers.add_parser("pause", help="stop a model's workers taking and stepping jobs")
    p.add_argument("model")
    p.add_argument("--mode", choices=("keep", "abort"), default="keep",
                   help="keep running sequences frozen until resume, or send them back to their queues")
    _common(p, lambda args, client: client.pause(args.model, args.mode, timeout=args.timeout))

    p = subparsers.add_parser("resume", help="let a paused model's workers go on")
    p.add_argument("model")
    _common(p, lambda args, client: client.resume(args.model, timeout=args.timeout))

    p = subparsers.add_parser("abort", help="end one job, or every running job of a model, as cancelled")
    p.add_argument("model", nargs="?")
    p.add_argument("--job", dest="job_id", help="only this job")
    _common(p, lambda args, client: client.abort(args.model, args.job_id, timeout=args.timeout))

    p = subparsers.add_parser("reset-prefix-cache", help="empty a model's workers' prefix caches")
    p.add_argument("model")
    _common(p, lambda args, client: client.reset_prefix_cache(args.model, timeout=args.timeout))


def _common(parser: argparse.ArgumentParser, call) -> None:  # type: ignore[no-untyped-def]
    add_url(parser)
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for every worker (default 60)")

    def run(args: argparse.Namespace, client: Client) -> int:
        outcome: ControlOutcome = call(args, client)
        print(outcome.model_dump_json(indent=2))
        if not outcome.ok:
            problems = [f"{name}: {message}" for name, message in outcome.errors.items()]
            problems += [f"{name}: no answer in {args.timeout} s" for name in outcome.missing]
            print("mlxq: " + "; ".join(problems), file=sys.stderr)
        return 0 if outcome.ok else 1

    parser.set_defaults(func=handler(run))
