"""vLLM's fault-tolerance endpoints: ``GET /fault_tolerance/status`` (every engine core's status
and fault) and ``POST /fault_tolerance/apply`` (a recovery command for every engine core).

``apply`` takes ``{"instruction": "retry", "params": {}}``, answers 202 with the command's
``request_id`` at once and runs the command in the background (a task kept until it ends; a
failure is logged, and each engine core's rejection shows in the status as ``ft_error``). Any
other instruction, or a malformed body, is a 400; with no engine core known, a 503. Without a
fault-tolerance API in the engine client, both answer 501. The engine cores' status changes
also feed ``/metrics`` (``Metrics.observe_engine_status``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from aiohttp import web

from shoal.bus.messages.fault import INSTRUCTIONS, FaultToleranceRequest, FaultToleranceResult
from shoal.engine.client.interface import FaultToleranceApi
from shoal.gateway.errors import ApiError, bad_request, unavailable
from shoal.gateway.metrics import Metrics
from shoal.gateway.serving import decode_body

log = logging.getLogger(__name__)


class ApplyBody(msgspec.Struct, forbid_unknown_fields=True):
    instruction: str
    params: dict[str, Any] = {}


class ApplyAccepted(msgspec.Struct):
    message: str
    request_id: str


class FaultToleranceEndpoints:
    """The two endpoints for one engine client's ``FaultToleranceApi`` (None: not available)."""

    def __init__(self, api: FaultToleranceApi | None, metrics: Metrics) -> None:
        self.api = api
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()

    def install(self, app: web.Application) -> None:
        """Add the routes, and feed ``/metrics`` with status changes while the app runs."""
        app.router.add_get("/fault_tolerance/status", self.status)
        app.router.add_post("/fault_tolerance/apply", self.apply)
        if self.api is not None:
            self.api.listeners.append(self.metrics.observe_engine_status)
            for engine in self.api.status().engines:  # what happened before the app existed
                self.metrics.observe_engine_status(engine.id, engine.status)
        app.on_cleanup.append(self._cleanup)

    def require_api(self) -> FaultToleranceApi:
        if self.api is None:
            raise ApiError(
                501, "this engine client has no fault-tolerance API", code="not_supported"
            )
        return self.api

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.require_api().status())

    async def apply(self, request: web.Request) -> web.Response:
        api = self.require_api()
        body = await decode_body(request, ApplyBody)
        if body.instruction not in INSTRUCTIONS:
            raise bad_request(
                f"unknown instruction {body.instruction!r}; supported: {', '.join(INSTRUCTIONS)}",
                param="instruction",
            )
        if not api.status().engines:
            raise unavailable("no engine core is known")
        command = FaultToleranceRequest(body.instruction, body.params, f"ft-{uuid.uuid4().hex}")
        task = asyncio.get_running_loop().create_task(self._run(api, command))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        message = f"{command.instruction} sent to {len(api.status().engines)} engine core(s)"
        return _json(ApplyAccepted(message, command.request_id), status=202)

    async def _run(self, api: FaultToleranceApi, command: FaultToleranceRequest) -> None:
        try:
            results = await api.apply(command)
        except Exception:
            log.exception("fault-tolerance command %s failed", command.request_id)
            return
        log.info("fault-tolerance command %s: %s", command.request_id, _summary(results))

    async def _cleanup(self, app: web.Application) -> None:
        if self.api is not None and self.metrics.observe_engine_status in self.api.listeners:
            self.api.listeners.remove(self.metrics.observe_engine_status)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _summary(results: dict[str, FaultToleranceResult]) -> str:
    return ", ".join(
        f"{engine_id} {'ok' if r.success else f'rejected ({r.reason})'}"
        for engine_id, r in results.items()
    )


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )
