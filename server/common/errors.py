"""TorchServe-shaped error bodies: `{"code": int, "type": str, "message": str}` (the apps'
error middleware, pagedserve.server.serving.middleware, sends them)."""

from __future__ import annotations

# TorchServe's exception names by status code (the `type` field of an error body).
ERROR_TYPES = {
    400: "BadRequestException",
    401: "TokenAuthorizationException",
    403: "ForbiddenException",
    404: "ModelNotFoundException",
    405: "MethodNotAllowedException",
    408: "RequestTimeoutException",
    409: "ConflictStatusException",
    413: "RequestTooLargeException",
    415: "UnsupportedMediaTypeException",
    429: "TooManyRequestsException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
    504: "RequestTimeoutException",
    507: "InsufficientStorageException",
}


def error_body(code: int, message: str, type: str | None = None) -> dict:
    return {"code": code, "type": type or ERROR_TYPES.get(code, "InternalServerException"), "message": message}
