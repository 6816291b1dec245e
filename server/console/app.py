"""The operator's console: a static page on the management port (`GET /console`).

The page is plain files shipped in the package (`server/console/console_static/`, no build step, no
network beyond this server). It signs in with the management key, held in the page's memory
only, and every action it takes is an ordinary management call with `Authorization: Bearer`:
the console adds no privilege. Two small views it needs that a browser cannot reach otherwise,
both behind the management key:

    GET /console/api/metrics   the metrics port's own Prometheus text (same registry; the
                               metrics port is another origin, which a page cannot read)
    GET /console/api/info      where the inference port is, whether the model API is on, the
                               archives in the model store (what "register" can name)
    GET /console/api/history   the chart families' text of the last 15 minutes, sampled every
                               2 s (pagedserve.server.console.history), so charts start full

The playground calls the inference port directly with the inference key; that port answers
CORS requests from the console's origin only (`allow_console`). Every management response
carries a Content-Security-Policy (`security_headers`): the console's HTML a strict one naming
only this origin and the inference origin (no inline script, no eval), the rest `default-src
'none'`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.server.common.auth import Handler
from pagedserve.server.common.config import ServerConfig, parse_address
from pagedserve.server.console import history as console_history
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.workers.archives import store_archives

STATIC_DIR = Path(__file__).parent / "console_static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
UNSPECIFIED = frozenset({"", "0.0.0.0", "::", "[::]"})
API_CSP = "default-src 'none'; frame-ancestors 'none'"
HOST_RE = re.compile(r"[A-Za-z0-9.\-:\[\]]{1,255}")


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    content_type: str


def load_static(root: Path = STATIC_DIR) -> dict[str, StaticFile]:
    """Every shipped file by its URL path (`/console/static/<relative path>`), read once: only
    these paths are served, so no request path ever reaches the file system."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in CONTENT_TYPES and path != root / "index.html":
            rel = path.relative_to(root).as_posix()
            files[f"/console/static/{rel}"] = StaticFile(path.read_bytes(), CONTENT_TYPES[path.suffix])
    return files


def _is_local(host: str) -> bool:
    host = host.strip("[]")
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def inference_origin(config: ServerConfig, ports: dict[str, int], page_host: str) -> str:
    """The inference port's origin as the console's page (reached as `page_host`) must name it:
    the page's own host name when the inference port listens on every address or both are
    local, else the configured host."""
    host, _ = parse_address(config.inference_address)
    port = ports.get("inference", 0)
    if host in UNSPECIFIED or (_is_local(host) and _is_local(page_host)):
        host = page_host
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def console_origin_allowed(config: ServerConfig, ports: dict[str, int], origin: str) -> bool:
    """Whether `origin` is the console's: http, the management port, a host that reaches it."""
    scheme, _, rest = origin.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "http" or not port.isdigit() or int(port) != ports.get("management"):
        return False
    mhost, _ = parse_address(config.management_address)
    return mhost in UNSPECIFIED or host.strip("[]") == mhost.strip("[]") or (_is_local(mhost) and _is_local(host))


def page_csp(config: ServerConfig, ports: dict[str, int], page_host: str) -> str:
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src 'self' {inference_origin(config, ports, page_host)}; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    )


# -- routes -------------------------------------------------------------------------------
STATIC_KEY = web.AppKey("pagedserve_console_static", dict)
INDEX_KEY = web.AppKey("pagedserve_console_index", bytes)


async def index(request: web.Request) -> web.Response:
    """The console's page (no token needed: it holds no data; sign-in happens in the page)."""
    state = request.app[STATE_KEY]
    return web.Response(
        body=request.app[INDEX_KEY],
        content_type="text/html",
        charset="utf-8",
        headers={
            "Content-Security-Policy": page_csp(state.config, state.ports, _page_host(request)),
            "Cache-Control": "no-cache",
        },
    )


async def static(request: web.Request) -> web.Response:
    """One of the console's shipped files (scripts, styles, the charting library, its licence)."""
    found = request.app[STATIC_KEY].get(request.path)
    if found is None:
        raise web.HTTPNotFound(text="no such console file")
    return web.Response(body=found.body, headers={"Content-Type": found.content_type, "Cache-Control": "no-cache"})


async def metrics(request: web.Request) -> web.Response:
    """The metrics port's Prometheus text (`name[]` filters), for the console's overview."""
    body = request.app[STATE_KEY].metrics.render(request.query.getall("name[]", ()))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def info(request: web.Request) -> web.Response:
    """Where the playground sends requests and what the register form can name."""
    state = request.app[STATE_KEY]
    archives = [p.name for p in store_archives(state.config.model_store_path)]
    return web.json_response(
        {
            "inferenceUrl": inference_origin(state.config, state.ports, _page_host(request)),
            "modelApi": state.config.enable_model_api,
            "storeArchives": archives,
            "allowedUrls": list(state.config.allowed_urls),
        }
    )


def _page_host(request: web.Request) -> str:
    """The host name the page was reached by (it names the inference origin in the CSP): only
    the characters of a host name or an address; anything else is not put in a header."""
    host = request.url.host or ""
    if not HOST_RE.fullmatch(host):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def routes() -> list[web.RouteDef]:
    return [
        web.get("/console", index),
        web.get("/console/", index),
        web.get("/console/static/{path:.+}", static),
        web.get("/console/api/metrics", metrics),
        web.get("/console/api/info", info),
    ]


def setup(app: web.Application) -> frozenset[str]:
    """Add the console's routes and headers to the management app; returns the paths that need
    no token (the page and its static files, which hold no data)."""
    files = load_static()
    app[STATIC_KEY] = files
    app[INDEX_KEY] = (STATIC_DIR / "index.html").read_bytes()
    app.add_routes(routes())
    console_history.setup(app)
    app.on_response_prepare.append(security_headers)
    return frozenset({"/console", "/console/", *files})


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """A CSP on every management response (the page's own is set by `index`), no sniffing, no
    framing, no referrer (the sign-in link's fragment never leaves the browser anyway)."""
    response.headers.setdefault("Content-Security-Policy", API_CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "no-referrer")


def allow_console(app: web.Application, state: ServerState) -> None:
    """For the inference app: let the console's page (another port, so another origin) call the
    inference API with the inference key. Only the console's origin is answered; the key is
    still checked by the auth middleware (a preflight, which carries no key, is answered before
    it and grants nothing). The header is added as a response is prepared, so streamed replies
    carry it too."""

    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (
            request.method == "OPTIONS"
            and "Access-Control-Request-Method" in request.headers
            and origin is not None
            and console_origin_allowed(state.config, state.ports, origin)
        ):
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600",
                },
            )
        return await handler(request)

    async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and console_origin_allowed(state.config, state.ports, origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(allow_origin)


def sign_in_line(state: ServerState, with_keys: bool) -> str:
    """The line `pagedserve serve` prints: `<management>/console#token=...`, the keys in the
    fragment (which browsers never send), or, `with_keys` off, the link and where the key is."""
    host, _ = parse_address(state.config.management_address)
    if host in UNSPECIFIED:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    management_url = f"http://{host}:{state.ports.get('management', 0)}"
    if state.keys is None:
        return f"pagedserve: console: {management_url}/console"
    if not with_keys:
        return (
            f"pagedserve: console: {management_url}/console (sign in with the management key "
            f"from {state.keys.path}; console_link_keys: true prints a link that carries it)"
        )
    return (
        f"pagedserve: console (sign-in link): {management_url}/console#token="
        f"{state.management_key}&inference_token={state.inference_key}"
    )
