"""TorchServe-shaped error replies: `{"code": int, "type": str, "message": str}`."""

from __future__ import annotations

from aiohttp import web

# TorchServe's exception names by status code (the `type` field of an error body).
ERROR_TYPES = {
    400: "BadRequestException",
    401: "TokenAuthorizationException",
    403: "ForbiddenException",
    404: "ModelNotFoundException",
    405: "MethodNotAllowedException",
    409: "ConflictStatusException",
    413: "RequestTooLargeException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
    504: "RequestTimeoutException",
    507: "InsufficientStorageException",
}


def error_body(code: int, message: str, type: str | None = None) -> dict:
    return {"code": code, "type": type or ERROR_TYPES.get(code, "InternalServerException"),
            "message": message}


def error_response(code: int, message: str, type: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """A JSON error reply with TorchServe's shape."""
    return web.json_response(error_body(code, message, type), status=code, headers=headers)
