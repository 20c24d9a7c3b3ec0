"""CLI verbs on the producer side: `submit`, `status`, `result`, `cancel`.

`register(subparsers)` adds them; each sets `func(args) -> exit code`. Exit codes: 0 ok,
2 invalid input, 1 anything else (unknown job, timeout, broker down, a job that did not
finish). Errors print one line to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producer import Client, GenerationResult, InvalidRequest, MlxqError
from producer.wire import URL_ENV

__all__ = ["register"]

Handler = Callable[[argparse.Namespace], int]

# Every --url help ends with this: a command line is visible to every user of the host.
URL_PASSWORD_NOTE = f"a password in --url shows in `ps` and shell history: prefer ${URL_ENV}"


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the submit, status, result and cancel verbs to the main CLI's subparsers."""
    _add_submit(subparsers)

    status = subparsers.add_parser("status", help="print a job's status", description="Print a job's status.")
    add_url(status)
    status.add_argument("job_id", help="the job id")
    status.set_defaults(func=handler(_status))

    result = subparsers.add_parser(
        "result",
        help="print a job's result as JSON",
        description="Print a job's result (pretty JSON). Exit 0 if it finished, 1 if it failed, was "
        "cancelled, or has no result yet.",
    )
    add_url(result)
    # Optional here only so that `--wait ID` (the flag without SECONDS, then the id) reads right.
    result.add_argument("job_id", nargs="?", help="the job id")
    result.add_argument(
        "--wait", nargs="?", const="-1", default=None, metavar="SECONDS",
        help="wait for the result (for at most SECONDS; no limit without a value)",
    )
    result.set_defaults(func=handler(_result))

    cancel = subparsers.add_parser(
        "cancel",
        help="cancel a job",
        description="Cancel a job: a queued job is removed from its queue, a running one stops within one step.",
    )
    add_url(cancel)
    cancel.add_argument("job_id", help="the job id")
    cancel.set_defaults(func=handler(_cancel))


def add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get(URL_ENV),
        help=f"Redis URL: redis://, rediss:// or unix://, may carry user:password (default: ${URL_ENV}, "
        f"else redis://127.0.0.1:6379/0; {URL_PASSWORD_NOTE})",
    )


def _add_submit(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "submit",
        help="enqueue a generation job",
        description="Validate and enqueue one generation request; print its job id. With --wait, print "
        "the result JSON instead (the id goes to stderr) and exit 0 only if it finished.",
    )
    add_url(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="plain-text prompt (no chat template)")
    source.add_argument("--messages", metavar="JSON", help='chat messages, e.g. \'[{"role":"user","content":"hi"}]\'')
    source.add_argument("--prompt-token-ids", metavar="1,2,3", help="comma-separated prompt token ids")
    source.add_argument(
        "--json", metavar="FILE", dest="json_file",
        help="a whole request object from FILE ('-' for stdin); the flags below override its fields",
    )
    parser.add_argument("--model", help="model name; also picks the queue mlxq:<model> unless --queue is given")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--n", type=int, help="number of completions")
    parser.add_argument("--logprobs", action="store_true", default=None, help="return per-token logprobs")
    parser.add_argument("--queue", help="queue name (default: mlxq:<model>, or mlxq without a model)")
    parser.add_argument("--priority", help="high | default | low: the queue's @<priority> sibling (docs/producer.md)")
    parser.add_argument("--timeout", type=int, help="job timeout in seconds (-1: none)")
    parser.add_argument(
        "--wait", type=float, nargs="?", const=-1.0, default=None, metavar="SECONDS",
        help="wait for the result and print it (for at most SECONDS; no limit without a value)",
    )
    parser.set_defaults(func=handler(_submit))


def handler(body: Callable[[argparse.Namespace, Client], int]) -> Handler:
    """Open a client for `args.url`, run `body`, and map errors to one line and an exit code."""

    def run(args: argparse.Namespace) -> int:
        try:
            with Client(args.url) as client:
                return body(args, client)
        except InvalidRequest as exc:
            print(f"mlxq: {exc}", file=sys.stderr)
            return 2
        except MlxqError as exc:
            print(f"mlxq: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("mlxq: interrupted", file=sys.stderr)
            return 130

    return run


def _wait_timeout(value: float | None) -> float | None:
    return None if value is None or value < 0 else value


def _print_result(result: GenerationResult) -> int:
    print(result.model_dump_json(indent=2))
    return 0 if result.status == "finished" else 1


def _request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Build the request object from `submit`'s flags; InvalidRequest for unparsable input."""
    payload: dict[str, Any] = {}
    if args.json_file is not None:
        payload = _load_json(args.json_file)
    elif args.prompt is not None:
        payload["prompt"] = args.prompt
    elif args.messages is not None:
        try:
            payload["messages"] = json.loads(args.messages)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"messages: not valid JSON: {exc}", "messages") from None
    elif args.prompt_token_ids is not None:
        try:
            payload["prompt_token_ids"] = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            raise InvalidRequest(
                f"prompt_token_ids: expected comma-separated integers, got {args.prompt_token_ids!r}",
                "prompt_token_ids",
            ) from None
    for field in ("model", "max_tokens", "temperature", "seed", "n", "logprobs"):
        value = getattr(args, field)
        if value is not None:
            payload[field] = value
    return payload


def _load_json(source: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise InvalidRequest(f"--json: cannot read {source}: {exc.strerror or exc}", "json") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"--json: {source} is not valid JSON: {exc}", "json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest(f"--json: {source} must hold a JSON object (one request)", "json")
    return payload


def _submit(args: argparse.Namespace, client: Client) -> int:
    job_id = client.submit(_request_from_args(args), queue=args.queue, priority=args.priority, timeout=args.timeout)
    if args.wait is None:
        print(job_id)
        return 0
    print(f"submitted {job_id}", file=sys.stderr)
    return _print_result(client.wait(job_id, _wait_timeout(args.wait)))


def _status(args: argparse.Namespace, client: Client) -> int:
    print(client.status(args.job_id))
    return 0


def _result(args: argparse.Namespace, client: Client) -> int:
    if args.job_id is None and args.wait is not None and not _is_number(args.wait):
        args.job_id, args.wait = args.wait, "-1"  # `mlxq result --wait ID`
    if args.job_id is None:
        raise InvalidRequest("job_id: give the id of the job to read", "job_id")
    if args.wait is not None:
        if not _is_number(args.wait):
            raise InvalidRequest(f"--wait: expected a number of seconds, got {args.wait!r}", "wait")
        return _print_result(client.wait(args.job_id, _wait_timeout(float(args.wait))))
    result = client.result(args.job_id)
    if result is None:
        print(f"mlxq: job {args.job_id} has no result yet (status: {client.status(args.job_id)})", file=sys.stderr)
        return 1
    return _print_result(result)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cancel(args: argparse.Namespace, client: Client) -> int:
    if client.cancel(args.job_id):
        print(f"cancel requested for {args.job_id}")
    else:
        print(f"job {args.job_id} had already ended; nothing to cancel")
    return 0
