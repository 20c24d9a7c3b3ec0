"""Every Redis key the gateway writes, under `mlxq:api:` (schemas/keys.py holds the contract's).

Tenants are named in keys by their tag, a hash of the tenant's name, which also opens the id of
every job the gateway submits for it: `<tag>-<hex>`.
"""

from __future__ import annotations

import hashlib

PREFIX = "mlxq:api:"

# Model names seen served by a live worker, name -> Unix time last seen (a model seen lately but
# without a live worker now is answered 503, not 404).
MODELS_SEEN = f"{PREFIX}models"
# Batches not yet in a final state; every gateway process drives them (producer/api/batch_driver.py).
ACTIVE_BATCHES = f"{PREFIX}batches:active"


def tenant_tag(tenant: str) -> str:
    return hashlib.sha256(f"mlxq-tenant:{tenant}".encode()).hexdigest()[:16]


def in_flight(tag: str) -> str:
    """A sorted set of the tenant's job ids submitted and not yet ended, scored by submit time."""
    return f"{PREFIX}inflight:{tag}"


def file_record(file_id: str) -> str:
    """A file's metadata (FileRecord JSON); expires with the file."""
    return f"{PREFIX}file:{file_id}"


def file_data(file_id: str) -> str:
    """A file's contents as a list of its lines (without their newlines), when files live in Redis."""
    return f"{PREFIX}file:{file_id}:data"


def tenant_files(tag: str) -> str:
    """A sorted set of the tenant's file ids by creation time, for listing; ids of expired files are
    dropped as a listing meets them."""
    return f"{PREFIX}files:{tag}"


def storage_usage(tag: str) -> str:
    """A hash of the tenant's stored files: file id -> bytes, and `total` (producer/api/quota.py)."""
    return f"{PREFIX}usage:{tag}"


def storage_expiry(tag: str) -> str:
    """A sorted set of the same file ids by the Unix time each expires."""
    return f"{PREFIX}usage:{tag}:expiry"


def batch_record(batch_id: str) -> str:
    """A batch's hash: `record` (the OpenAI Batch JSON), counters and the driver's position."""
    return f"{PREFIX}batch:{batch_id}"


def batch_in_flight(batch_id: str) -> str:
    """A hash of the batch's jobs in flight: job id -> the input line that made it."""
    return f"{PREFIX}batch:{batch_id}:inflight"


def batch_lines(batch_id: str, errors: bool) -> str:
    """The output (or error) lines written so far, a list, until the batch's files are made."""
    return f"{PREFIX}batch:{batch_id}:{'errors' if errors else 'output'}"


def batch_lease(batch_id: str) -> str:
    """Held by the one gateway process advancing the batch right now (SET NX with a TTL)."""
    return f"{PREFIX}batch:{batch_id}:lease"


def tenant_batches(tag: str) -> str:
    """A sorted set of the tenant's batch ids by creation time, for listing."""
    return f"{PREFIX}batches:{tag}"
