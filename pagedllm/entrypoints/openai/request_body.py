"""Request bodies into their models, the large ones off the event loop.

FastAPI decodes and validates a route's body parameter on the event loop. Validation
costs ~6 us a chat message, so a 1.5 MB body of 45,000 short messages held the loop
for ~270 ms, and eight such requests at once kept /health waiting 2 s. The routes
therefore take their body from `read_body`, which does what FastAPI does (the same JSON
media types, the same errors for invalid JSON, a non-JSON body and a missing one, and
the same validation, reported through FastAPI's RequestValidationError): inline for a
body under INLINE_BYTES, in the front end's worker threads above. There the loop gets
the GIL back every switch interval (at worst ~20 ms, the JSON decoder's one C call for
2 MB). The body's size is already bounded by BodyLimitMiddleware.

`BodyRoutes.post` registers such a route and puts its model back into the schema at
/openapi.json (FastAPI no longer sees it).
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, RootModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from pagedllm.entrypoints.openai.offload import INLINE_BYTES, Offloader

M = TypeVar("M", bound=BaseModel)

_REF = "#/components/schemas/{model}"
# FastAPI's message for a body it could not read (the error handler rewords it).
_UNPARSED = "There was an error parsing the body"

# A route handler: (the body as its model, the raw request) -> the answer.
Handler = Callable[[M, Request], Awaitable[Any]]


async def read_body(request: Request, model: type[M], offloader: Offloader) -> M:
    """The request's body validated as `model` (RequestValidationError or a 400
    HTTPException as FastAPI raises them)."""
    try:
        body = await request.body()
    except HTTPException:  # the body limit's 413 / 408
        raise
    except Exception:  # the client went away (no one reads this): FastAPI's answer
        raise HTTPException(400, _UNPARSED) from None
    content_type = request.headers.get("content-type")
    if len(body) < INLINE_BYTES:
        return parse_body(body, content_type, model)
    return await offloader.run_in_thread(parse_body, body, content_type, model)


def parse_body(body: bytes, content_type: str | None, model: type[M]) -> M:
    """FastAPI's reading of a JSON body parameter: an empty body is missing, one whose
    Content-Type is not JSON stays bytes (which the model refuses); errors carry
    FastAPI's ("body", ...) locations."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    value: Any = body
    if _is_json(content_type):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                  "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
        except (ValueError, RecursionError):
            # Not UTF-8, or an integer past Python's digit limit, or nested past the
            # interpreter's recursion limit: FastAPI's answer for any such body.
            raise HTTPException(400, _UNPARSED) from None
    return validate_body(value, model)


def validate_body(value: Any, model: type[M]) -> M:
    """`value` (a decoded body) validated as `model`, errors as FastAPI reports them."""
    try:
        # from_attributes as FastAPI validates a body: a non-JSON body (bytes) is then
        # a model_attributes_type error, which the error handler names.
        return model.model_validate(value, from_attributes=True)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])}
                  for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None


class JSONObject(RootModel[dict[str, Any]]):
    """Any JSON object: the body of a route that picks its model by the body's keys."""


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (strictly: a body
    without one is not)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


class BodyRoutes:
    """Registers POST routes whose JSON body `read_body` reads into a model, and keeps
    those models in the schema at /openapi.json (FastAPI no longer sees them)."""

    def __init__(self, app: FastAPI, offloader: Offloader) -> None:
        self.app, self.offloader = app, offloader
        self.models: list[type[BaseModel]] = []
        generate = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = generate()
                _, defs = models_json_schema([(m, "validation") for m in self.models],
                                             ref_template=_REF)
                known = schema.setdefault("components", {}).setdefault("schemas", {})
                for name, definition in defs.get("$defs", {}).items():
                    known.setdefault(name, definition)
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]

    def post(self, *paths: str, body: type[M], response_model: Any = None) -> Callable[
            [Handler[M]], Handler[M]]:
        """Decorator: `handler(request, raw_request)` answers POST `paths`, `request`
        being the body read as `body`."""
        self.models.append(body)
        request_body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=body.__name__)}}}}

        def register(handler: Handler[M]) -> Handler[M]:
            async def endpoint(raw_request: Request) -> Any:
                request = await read_body(raw_request, body, self.offloader)
                return await handler(request, raw_request)

            for path in paths:
                self.app.post(path, name=handler.__name__, response_model=response_model,
                              openapi_extra={"requestBody": request_body})(endpoint)
            return handler
        return register
