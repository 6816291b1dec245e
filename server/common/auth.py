"""Token authorization, TorchServe's way: a key file with one key per API, `Bearer` tokens.

Keys come from the settings (`inference_key` / `management_key`: flags or PAGEDSERVE_*
variables), from an existing key file when `keep_key_file` is on, or are generated
(`choose_keys`). `KeyStore` holds them while the server runs: `rotate(api)` (the management
port's `/token?type=...`) replaces one and rewrites the key file. `write_key_file` creates
`key_file.json` (`{"management": {"key": ...}, "inference": {"key": ...}}`) with mode 0600,
atomically (`pagedserve.server.common.safe_write`); the server writes it only once its ports are bound, so a
start that fails (a port in use) never touches a running server's file.

`auth_middleware(key)` refuses (raises `Unauthorized`) a request whose
`Authorization: Bearer <token>` does not match the key the getter returns at that moment,
comparing in constant time; the health probes pass without a token unless configured otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pagedserve.server.common.safe_write import write_atomically

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What a given key may hold: the characters of a bearer token (RFC 6750's b64token), long enough.
KEY_PATTERN = r"^[A-Za-z0-9._~+/=-]{16,512}$"
_KEY_RE = re.compile(KEY_PATTERN)
MAX_KEY_FILE_BYTES = 1 << 16


class Api(str, enum.Enum):
    INFERENCE = "inference"
    MANAGEMENT = "management"


@dataclass(frozen=True, slots=True)
class ApiKeys:
    inference: str
    management: str

    @classmethod
    def generate(cls) -> ApiKeys:
        return cls(inference=new_key(), management=new_key())

    def to_json(self) -> dict:
        return {"management": {"key": self.management}, "inference": {"key": self.inference}}

    def get(self, api: Api) -> str:
        return getattr(self, api.value)

    def replace(self, api: Api, key: str) -> ApiKeys:
        return dataclasses.replace(self, **{api.value: key})


def new_key() -> str:
    return secrets.token_urlsafe(24)


def check_key(key: str, what: str) -> str:
    if not _KEY_RE.match(key):
        raise ValueError(f"{what}: a key must be 16 to 512 characters of A-Z a-z 0-9 . _ ~ + / = -")
    return key


def read_key_file(path: str | Path) -> ApiKeys:
    """The keys of an existing key file (TorchServe's shape); ValueError naming the file."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
        if len(raw) > MAX_KEY_FILE_BYTES:
            raise ValueError("larger than a key file can be")
        data = json.loads(raw)
        keys = {api: data[api.value]["key"] for api in Api}
        for api, key in keys.items():
            if not isinstance(key, str):
                raise ValueError(f"{api.value}.key is not a string")  # noqa: TRY004 (caught below)
            check_key(key, f"{api.value}.key")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"key file {path}: cannot be kept ({reason}); fix or remove it") from None
    return ApiKeys(inference=keys[Api.INFERENCE], management=keys[Api.MANAGEMENT])


def choose_keys(
    key_file: str | Path, *, inference: str | None = None, management: str | None = None, keep_key_file: bool = False
) -> tuple[ApiKeys, bool]:
    """The keys to run with and whether the key file must be (re)written: a given key wins,
    then, with `keep_key_file`, the existing file's key; the rest are generated."""
    kept = read_key_file(key_file) if keep_key_file and Path(key_file).expanduser().exists() else None
    given = {Api.INFERENCE: inference, Api.MANAGEMENT: management}
    chosen = {api: given[api] or (kept.get(api) if kept else new_key()) for api in Api}
    keys = ApiKeys(inference=chosen[Api.INFERENCE], management=chosen[Api.MANAGEMENT])
    return keys, keys != kept


def write_key_file(path: str | Path, keys: ApiKeys) -> Path:
    """Write the keys to `path` with mode 0600 (never readable by others, even briefly), through
    an O_EXCL|O_NOFOLLOW temporary file: a link planted in the folder is never written through."""
    text = json.dumps(keys.to_json(), indent=2) + "\n"
    return write_atomically(path, text.encode())


@dataclass(slots=True, eq=False)
class KeyStore:
    """The keys a running server checks, and the file they are written to."""

    keys: ApiKeys
    path: Path

    def key(self, api: Api) -> str:
        return self.keys.get(api)

    def rotate(self, api: Api) -> str:
        """A new key for `api`, written to the key file first (the old one stops working only
        once the file holds the new one); OSError when it cannot be written (nothing changed)."""
        keys = self.keys.replace(api, new_key())
        write_key_file(self.path, keys)
        self.keys = keys
        return keys.get(api)


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


def auth_middleware(key: Callable[[], str | None], public_paths: frozenset[str] = frozenset()):
    """An aiohttp middleware that raises `Unauthorized` unless the request carries
    `Bearer <key()>` or `x-api-key: <key()>` (read per request: a rotated key takes effect at once).

    `key()` returning None means authorization is off. Paths in `public_paths` pass without a token.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        expected = key()
        if expected is None or request.path in public_paths:
            return await handler(request)
        token = bearer_token(request) or request.headers.get("x-api-key")  # Anthropic's clients
        if token is None:
            raise Unauthorized(
                "Token authorization failed: no 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>') header (keys are in the server's key file)"
            )
        if not token_matches(token, expected):
            raise Unauthorized("Token authorization failed: the token is not valid for this API")
        return await handler(request)

    return middleware
