"""`mlxq api --url U --host H --port P`: the HTTP gateway (producer/api/, extra `api`), served by uvicorn.

Every flag has an `MLXQ_API_*` twin (the flags win). Without an API key configured it listens on loopback
only, unless started with `--insecure`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from producer.wire import URL_ENV

__all__ = ["register"]


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser(
        "api", help="serve the OpenAI-compatible HTTP gateway",
        description="Serve OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models, /v1/files, "
        "/v1/batches and mlxq's /v1/jobs over the queue. Settings: MLXQ_API_* variables (docs/gateway.md); "
        "API keys as MLXQ_API_KEYS=tenant:sha256hex,... (the SHA-256 of each key, never the key).")
    p.add_argument("--url", help=f"Redis URL (default: ${URL_ENV}; prefer the variable for a URL with a password, "
                                 "flags show in `ps`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="gateway processes on this port (default 1)")
    p.add_argument("--insecure", action="store_true",
                   help="with no API key configured, listen on a non-loopback address anyway (anyone can use it)")
    p.add_argument("--files-dir", help="keep file contents in this directory (shared by replicas), not in Redis")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
        from pydantic import ValidationError

        from producer.api.http_deadlines import uvicorn_options
        from producer.api.settings import GatewaySettings
    except ImportError as exc:
        print(f"mlxq api: the gateway needs the api extra (pip install 'mlxq[api]'): {exc}", file=sys.stderr)
        return 2
    overrides = {"MLXQ_REDIS_URL": args.url, "MLXQ_API_FILES_DIR": args.files_dir,
                 "MLXQ_API_INSECURE": "1" if args.insecure else None}
    os.environ.update({name: value for name, value in overrides.items() if value is not None})
    try:
        settings = GatewaySettings()
    except ValidationError as exc:
        for error in exc.errors(include_input=False, include_url=False):
            print(f"mlxq api: {'.'.join(str(p) for p in error['loc'])}: {error['msg']}", file=sys.stderr)
        return 2
    if not settings.api_keys and not settings.insecure and not _is_loopback(args.host):
        print(f"mlxq api: no API key is configured (MLXQ_API_KEYS), so the gateway listens on loopback only; "
              f"pass --insecure to listen on {args.host} anyway", file=sys.stderr)
        return 2
    uvicorn.run("producer.api.app:create_app", factory=True, host=args.host, port=args.port, workers=args.workers,
                log_level=args.log_level, proxy_headers=False, timeout_graceful_shutdown=settings.shutdown_grace_s,
                **uvicorn_options())
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
