"""Token authorization, TorchServe's way: a key file with one key per API, `Bearer` tokens.

`write_key_file` creates `key_file.json` (`{"management": {"key": ...}, "inference": {"key": ...}}`)
with mode 0600, atomically (`server.safe_write`); `auth_middleware(key)` refuses (raises
`Unauthorized`) a request whose
`Authorization: Bearer <token>` does not match, comparing in constant time.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from server.safe_write import write_atomically

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    inference: str
    management: str

    @classmethod
    def generate(cls) -> ApiKeys:
        return cls(inference=secrets.token_urlsafe(24), management=secrets.token_urlsafe(24))

    def to_json(self) -> dict:
        return {"management": {"key": self.management}, "inference": {"key": self.inference}}


def write_key_file(path: str | Path, keys: ApiKeys) -> Path:
    """Write the keys to `path` with mode 0600 (never readable by others, even briefly), through
    an O_EXCL|O_NOFOLLOW temporary file: a link planted in the folder is never written through."""
    text = json.dumps(keys.to_json(), indent=2) + "\n"
    return write_atomically(path, text.encode())


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(token: str | None, key: str) -> bool:
    if token is None:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


class Unauthorized(Exception):
    """A request without the right token (401); the app's error middleware shapes the reply."""


def auth_middleware(key: str | None, public_paths: frozenset[str] = frozenset()):
    """An aiohttp middleware that raises `Unauthorized` unless the request carries
    `Bearer <key>`.

    `key=None` turns authorization off. Paths in `public_paths` pass without a token.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if key is None or request.path in public_paths:
            return await handler(request)
        token = bearer_token(request)
        if token is None:
            raise Unauthorized("Token authorization failed: no 'Authorization: Bearer <key>' "
                               "header (keys are in the server's key file)")
        if not token_matches(token, key):
            raise Unauthorized("Token authorization failed: the token is not valid for this API")
        return await handler(request)

    return middleware
