"""Django views in front of mlxq, with the sync `producer.Client`: enqueue, then poll.

    POST /jobs        {"prompt": ..., "max_tokens": 64}  ->  202 {"id": ...}
    GET  /jobs/<id>   ->  {"id", "status", "text"}  (text once the job has ended)
"""

from __future__ import annotations

import json
from functools import lru_cache

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from producer import Client, JobNotFound


@lru_cache(maxsize=1)
def client() -> Client:
    """One Client per process (it holds a Redis connection pool); MLXQ_REDIS_URL names the Redis."""
    return Client()


@csrf_exempt  # an API endpoint; a browser form would keep Django's CSRF check
@require_POST
def create_job(request: HttpRequest) -> JsonResponse:
    try:
        body = json.loads(request.body or b"{}")
        job_id = client().submit({"prompt": body.get("prompt"), "max_tokens": int(body.get("max_tokens", 64))})
    except (ValueError, TypeError) as exc:  # InvalidRequest is a ValueError naming the field
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"id": job_id}, status=202)


@require_GET
def job(request: HttpRequest, job_id: str) -> JsonResponse:
    try:
        # The status first, then the result: a job that ends between the two reads has its result read
        # (the other order could answer "finished" with no text).
        status = client().status(job_id)
        result = client().result(job_id)
        status = result.status if result is not None else status
    except JobNotFound:
        return JsonResponse({"error": f"no job {job_id}"}, status=404)
    text = result.choices[0].text if result is not None and result.choices else None
    return JsonResponse({"id": job_id, "status": status, "text": text})

