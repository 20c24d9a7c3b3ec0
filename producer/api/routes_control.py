"""The control plane over HTTP (docs/rl.md), for tenants named in MLXQ_API_ADMIN_TENANTS only:
`POST /v1/control/{model}/weights`, `/adapter`, `/pause`, `/resume`, `/abort`, `/reset_prefix_cache`. Each answers
once every live worker of the model has applied the command (or after `timeout` seconds), with who
acknowledged, who refused and why, and who did not answer."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from producer.api.auth import ERRORS, ApiError, Tenant
from producer.openai_responses import ErrorBody
from producer.api.gateway import Gateway, current_tenant, gateway
from schemas.control import ControlOutcome, PauseMode, WeightPolicy

__all__ = ["router"]

router = APIRouter(prefix="/v1/control")
RESPONSES = {**ERRORS, 403: {"model": ErrorBody, "description": "This API key's tenant may not drive the control plane"}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    timeout: float = Field(60, gt=0, le=3600)


class WeightsBody(_Body):
    version: int = Field(ge=0, lt=2**53)
    path: str
    policy: WeightPolicy = "drain"
    upload: bool = False  # stream the files through Redis (the gateway reads `path`)


class AdapterBody(_Body):
    name: str  # the adapter's name (may hold '/': in the body, not the path)
    path: str
    upload: bool = False  # stream the files through Redis (the gateway reads `path`)


class PauseBody(_Body):
    mode: PauseMode = "keep"


class AbortBody(_Body):
    job_id: Optional[str] = None


def _admin(tenant: Tenant, gw: Gateway) -> None:
    if tenant.name not in gw.settings.admin_tenants:
        raise ApiError(403, "this API key may not drive the control plane (MLXQ_API_ADMIN_TENANTS)",
                       type_="permission_error", code="forbidden")


@router.post("/{model}/weights", response_model=ControlOutcome, responses=RESPONSES)
async def publish_weights(model: str, body: WeightsBody, gw: Gateway = Depends(gateway),
                          tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.publish_weights(model, body.version, body.path, body.policy, upload=body.upload,
                                           timeout=body.timeout)


@router.post("/{model}/adapter", response_model=ControlOutcome, responses=RESPONSES)
async def publish_adapter(model: str, body: AdapterBody, gw: Gateway = Depends(gateway),
                          tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.publish_adapter(model, body.name, body.path, upload=body.upload, timeout=body.timeout)


@router.post("/{model}/pause", response_model=ControlOutcome, responses=RESPONSES)
async def pause(model: str, body: PauseBody, gw: Gateway = Depends(gateway),
                tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.pause(model, body.mode, timeout=body.timeout)


@router.post("/{model}/resume", response_model=ControlOutcome, responses=RESPONSES)
async def resume(model: str, body: _Body, gw: Gateway = Depends(gateway),
                 tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.resume(model, timeout=body.timeout)


@router.post("/{model}/abort", response_model=ControlOutcome, responses=RESPONSES)
async def abort(model: str, body: AbortBody, gw: Gateway = Depends(gateway),
                tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.abort(model, body.job_id, timeout=body.timeout)


@router.post("/{model}/reset_prefix_cache", response_model=ControlOutcome, responses=RESPONSES)
async def reset_prefix_cache(model: str, body: _Body, gw: Gateway = Depends(gateway),
                             tenant: Tenant = Depends(current_tenant)) -> ControlOutcome:
    _admin(tenant, gw)
    return await gw.client.reset_prefix_cache(model, timeout=body.timeout)
