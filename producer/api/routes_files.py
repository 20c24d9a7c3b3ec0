"""OpenAI Files and Batches: `POST /v1/files` (purpose `batch`), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`, `POST /v1/batches`, `GET /v1/batches/{id}`,
`GET /v1/batches`, `POST /v1/batches/{id}/cancel`. A tenant sees only its own files and batches: another's
are 404."""

from __future__ import annotations

from typing import Literal, Optional

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from producer.api.auth import ERRORS, ApiError, Tenant
from producer.api.batches import BatchCreate, BatchList, BatchObject
from producer.api.files import FileDeleted, FileList, FileObject
from producer.openai_responses import ErrorBody
from producer.api.gateway import current_tenant, gateway

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/files", response_model=FileObject, responses=ERRORS)
async def create_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...),
                      expires_after_anchor: Optional[str] = Form(None, alias="expires_after[anchor]"),
                      expires_after_seconds: Optional[int] = Form(None, alias="expires_after[seconds]"),
                      tenant: Tenant = Depends(current_tenant)) -> FileObject:
    """Upload an OpenAI Batch input file (JSON lines, at most 200 MB and 50,000 lines)."""
    gw = gateway(request)
    if expires_after_anchor not in (None, "created_at"):
        raise ApiError(400, "expires_after.anchor: must be created_at", param="expires_after")
    data = await file.read(gw.settings.file_max_bytes + 1)
    record = await gw.files.create(tenant, file.filename or "upload.jsonl", purpose, data, expires_after_seconds)
    return record.public()


@router.get("/v1/files", response_model=FileList, responses=ERRORS)
async def list_files(request: Request, purpose: Optional[Literal["batch", "batch_output"]] = Query(None),
                     limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = Query("desc"),
                     after: Optional[str] = Query(None, max_length=128),
                     tenant: Tenant = Depends(current_tenant)) -> FileList:
    """The tenant's files that have not expired, newest first (`order=asc`: oldest first)."""
    return await gateway(request).files.list(tenant, purpose, limit, order, after)


_IN_USE = {409: {"model": ErrorBody, "description": "An unfinished batch reads this file"}}


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses={**ERRORS, **_IN_USE})
async def delete_file(file_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> FileDeleted:
    """Delete one of the tenant's files; refused while an unfinished batch reads it as its input."""
    gw = gateway(request)
    record = await gw.files.get(tenant, file_id)
    batch_id = await gw.batches.reading(record.id)
    if batch_id is not None:
        raise ApiError(409, f"file {file_id} is the input of batch {batch_id}, which has not ended; cancel it first",
                       param="file_id", code="file_in_use")
    return await gw.files.delete(tenant, file_id)


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=ERRORS)
async def get_file(file_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> FileObject:
    return (await gateway(request).files.get(tenant, file_id)).public()


@router.get("/v1/files/{file_id}/content", responses={**ERRORS, 200: {"content": {"application/jsonl": {}}}})
async def get_file_content(file_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> StreamingResponse:
    files = gateway(request).files
    record = await files.get(tenant, file_id)
    return StreamingResponse(files.content(record), media_type="application/jsonl",
                             headers={"Content-Length": str(record.bytes)})


@router.post("/v1/batches", response_model=BatchObject, responses=ERRORS)
async def create_batch(body: BatchCreate, request: Request, tenant: Tenant = Depends(current_tenant)) -> BatchObject:
    """Run an uploaded file's requests over the queue; the batch's `completion_window` is its expiry."""
    return await gateway(request).batches.create(tenant, body)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=ERRORS)
async def get_batch(batch_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> BatchObject:
    return (await gateway(request).batches.get(tenant, batch_id)).object


@router.get("/v1/batches", response_model=BatchList, responses=ERRORS)
async def list_batches(request: Request, after: Optional[str] = Query(None, max_length=128),
                       limit: int = Query(20, ge=1, le=100), tenant: Tenant = Depends(current_tenant)) -> BatchList:
    """The tenant's batches, newest first."""
    return await gateway(request).batches.list(tenant, after, limit)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=ERRORS)
async def cancel_batch(batch_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> BatchObject:
    return await gateway(request).batches.cancel(tenant, batch_id)
