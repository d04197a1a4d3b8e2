"""Errors the API answers: always OpenAI-shaped, never a bare 500 for bad input.

`APIError` is what the routes raise; `add_error_handlers(app)` turns it, FastAPI's
validation errors and Starlette's HTTP errors (404 for an unknown path, 405, ...) into
`error_body` responses.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server.protocol import error_body

_JSON_MEDIA_TYPE = re.compile(r"^application/([\w.+-]+\+)?json$", re.IGNORECASE)

# Pydantic's names for union members and validators in an error location, not field names.
_TYPE_TAG = re.compile(
    r"^(int|float|str|bool|none|bytes|[a-z]+\[.*\]|[A-Z]\w*|function-.*|.*-union.*)$"
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers
        )


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI reads a body of another type as bytes, which then "is not an object".
    media_type = request.headers.get("content-type", "application/json").split(";")[0]
    if not _JSON_MEDIA_TYPE.match(media_type.strip()):
        message = f"Content-Type must be application/json, got {media_type!r}"
        return JSONResponse(error_body(message, code="unsupported_media_type"), 415)
    errors = list(exc.errors())
    # A union reports one error per member; the one about the value (too long, out of
    # range) says more than "not a string" from the member the input was never meant for.
    errors.sort(key=lambda e: str(e.get("type", "")).endswith("_type"))
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    if first.get("type") == "json_invalid":
        message, param = "request body is not valid JSON", None
    elif first.get("type") == "model_attributes_type" and not loc:
        message, param = "request body must be a JSON object", None
    else:
        param = ".".join(loc) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        others = {
            ".".join(
                str(p) for p in e.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))
            )
            for e in errors[1:]
        } - {".".join(loc)}
        if others:
            message += f" (also invalid: {', '.join(sorted(others))})"
    return JSONResponse(error_body(message, param=param, code="invalid_value"), 400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type_), exc.status_code)
