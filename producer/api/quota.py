"""Each tenant's storage quota for Files (`MLXQ_API_FILE_QUOTA_BYTES`): the bytes of its files that have not
expired nor been deleted, uploads and batch outputs alike, kept in Redis so that every replica shares it.

A tenant's usage is a hash (file id -> bytes, and `total`, their sum) and a sorted set of the same ids by
the Unix time each file expires. One script reserves an upload's bytes before its contents are written,
refusing it when the total would pass the quota, so concurrent uploads cannot pass it together; the same
script first releases the files that expired. Deleting a file releases its bytes at once.

A batch's output is counted as its lines are written (under `batch:<id>`, until the batch's output and
error files take their place), and never refused: a batch whose tenant's files fill the quota sends no
more of its lines (producer/api/batch_driver.py); its jobs in flight still end and are written, so a tenant
can pass its quota by what those jobs make, and then uploads wait for room.
"""

from __future__ import annotations

import time
from typing import Optional

import redis.asyncio as aioredis

from producer.api import keys as api_keys
from producer.api.auth import ApiError, Tenant

__all__ = ["StorageQuota"]

USAGE_TTL_S = 31 * 24 * 3600  # a tenant's usage keys outlive every file they count ...
USAGE_MARGIN_S = 24 * 3600  # ... by at least this much

# KEYS[1] the usage hash, KEYS[2] the expiry set. ARGV: now, then for a reservation: file id, bytes,
# expires at, quota (0: none), force ('1': count it whatever the quota), the keys' least ttl. Releases the files that
# expired; then reserves, returning {1, total} or {0, total} (refused), or with no reservation {1, total}.
_RESERVE = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
for _, id in ipairs(expired) do
  local size = redis.call('HGET', KEYS[1], id)
  if size then
    redis.call('HINCRBY', KEYS[1], 'total', -tonumber(size))
    redis.call('HDEL', KEYS[1], id)
  end
end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1]) end
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
if #ARGV == 1 then return {1, total} end
local size, quota = tonumber(ARGV[3]), tonumber(ARGV[5])
if ARGV[6] ~= '1' and quota > 0 and total + size > quota then return {0, total} end
redis.call('HINCRBY', KEYS[1], ARGV[2], size)
total = redis.call('HINCRBY', KEYS[1], 'total', size)
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2])
for _, key in ipairs(KEYS) do
  if redis.call('TTL', key) < tonumber(ARGV[7]) then redis.call('EXPIRE', key, ARGV[7]) end
end
return {1, total}
"""

# KEYS as above; ARGV[1] the file id. Releases its bytes (once).
_RELEASE = """
local size = redis.call('HGET', KEYS[1], ARGV[1])
if size then
  redis.call('HINCRBY', KEYS[1], 'total', -tonumber(size))
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return size
"""


class StorageQuota:
    def __init__(self, connection: aioredis.Redis, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes  # 0: none
        self._reserve = connection.register_script(_RESERVE)
        self._release = connection.register_script(_RELEASE)

    @staticmethod
    def _keys(tenant: Tenant) -> list[str]:
        return [api_keys.storage_usage(tenant.tag), api_keys.storage_expiry(tenant.tag)]

    async def reserve(self, tenant: Tenant, file_id: str, size: int, expires_at: float, *, force: bool = False,
                      now: Optional[float] = None) -> None:
        """Count `size` more bytes for `file_id` until `expires_at` (Unix seconds), or answer 413 naming the
        quota. With `force` (a batch's output, and its lines as they are written, under `batch:<id>`),
        count them whatever the quota."""
        now = now if now is not None else time.time()
        keep = max(USAGE_TTL_S, int(expires_at - now) + USAGE_MARGIN_S)
        allowed, total = await self._reserve(keys=self._keys(tenant), args=[
            now, file_id, size, expires_at, self.quota_bytes, "1" if force else "0", keep])
        if not allowed:
            raise ApiError(413, f"file: {size} bytes would bring this tenant's stored files to {int(total) + size} "
                           f"bytes, past its quota of {self.quota_bytes} bytes (MLXQ_API_FILE_QUOTA_BYTES); delete "
                           "files, or wait for some to expire", param="file", code="storage_quota_exceeded")

    async def release(self, tenant: Tenant, file_id: str) -> None:
        await self._release(keys=self._keys(tenant), args=[file_id])

    async def full(self, tenant: Tenant) -> bool:
        """Whether the tenant's files take its whole quota (or more)."""
        return bool(self.quota_bytes) and await self.used(tenant) >= self.quota_bytes

    async def used(self, tenant: Tenant, now: Optional[float] = None) -> int:
        """The bytes the tenant's files take now (those that expired released first)."""
        _, total = await self._reserve(keys=self._keys(tenant), args=[now if now is not None else time.time()])
        return int(total)
