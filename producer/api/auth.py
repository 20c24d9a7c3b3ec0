"""Who is calling: bearer API keys (stored as SHA-256 digests) mapped to tenants, and the gateway's
error type, answered in OpenAI's error shape."""

from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Optional

from producer.api import keys as api_keys
from producer.api.settings import GatewaySettings
from producer.openai_responses import ErrorBody, error_body

__all__ = ["ApiError", "Authenticator", "ERRORS", "Tenant", "not_found"]


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, param, code)
        self.headers = headers


def not_found(what: str, ident: str) -> ApiError:
    """The answer for something that does not exist, or belongs to another tenant (the same answer)."""
    return ApiError(404, f"No such {what}: {ident}", param=None, code="not_found")


# The error responses every route may give, for the OpenAPI schema.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in ((400, "Invalid request (the field is named in `param`)"),
                                (401, "Missing or unknown API key"),
                                (404, "Unknown model, or no such object for this tenant"),
                                (413, "Body too large"),
                                (429, "Queue too deep, or the tenant's jobs in flight at the cap"),
                                (503, "No live worker serves the model"))
}


@dataclass(frozen=True)
class Tenant:
    name: str

    @functools.cached_property
    def tag(self) -> str:  # a hash, read several times per request
        return api_keys.tenant_tag(self.name)

    def owns_job(self, job_id: str) -> bool:
        return job_id.startswith(f"{self.tag}-")


DEFAULT_TENANT = Tenant("default")


class Authenticator:
    """Bearer keys -> tenants. With no key configured every caller is the tenant "default" (the
    gateway then listens on loopback only, unless started insecure)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._tenants = {key.sha256: Tenant(key.tenant) for key in settings.api_keys}

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: Optional[str]) -> Tenant:
        if self.open:
            return DEFAULT_TENANT
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "Missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        for known, tenant in self._tenants.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
