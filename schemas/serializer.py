"""The serializer producers and workers give rq: `rq.serializers.JSONSerializer`, byte for byte.

Two things make it cheaper than passing rq's class:
- it is an instance of a class that names rq's `Serializer` protocol as a base. rq resolves the
  serializer for every Job and Result it builds; on Python 3.11 the runtime Protocol check of
  rq's class (`isinstance(JSONSerializer, Serializer)`) takes ~8 us, of this instance ~4 us;
- `dumps` passes `EncodedJSON` through as is: a worker that has already encoded a result for its
  result key hands rq that same text as the job's return value instead of a second encoding.
"""

from __future__ import annotations

from typing import Any

from rq.serializers import JSONSerializer, Serializer


class EncodedJSON(str):
    """Text that is already a JSON document: stored as is by `JSON_SERIALIZER.dumps`."""


class _JobJSONSerializer(JSONSerializer, Serializer):
    def __init__(self) -> None:
        # rq records a worker's serializer as `module.qualname`, to import it again elsewhere.
        self.__qualname__ = "JSON_SERIALIZER"

    @staticmethod
    def dumps(*args: Any, **kwargs: Any) -> bytes:
        if len(args) == 1 and not kwargs and type(args[0]) is EncodedJSON:
            return args[0].encode("utf-8")
        return JSONSerializer.dumps(*args, **kwargs)


JSON_SERIALIZER = _JobJSONSerializer()
