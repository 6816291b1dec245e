"""A real `pagedserve serve` in a subprocess on free 127.0.0.1 ports, for tests.

    server = ServerProcess(workdir, model_store, models=["smollm2=smollm2.mar"]).start()
    r = server.post("inference", "/predictions/smollm2", json={"prompt": "1, 2,", "max_tokens": 4})
    assert r.status == 200 and r.json()["choices"][0]["text"]
    server.stop()   # SIGTERM, then SIGKILL after a timeout; returns the exit code

Requests go through `urllib` (no extra dependency); the right key is sent by default
(`token=None` sends none, any string sends that). The server's stdout and stderr go to
`workdir/server.log` (`server.log_text()`), shown by `check_alive` when it died.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT = object()  # "send the right key"
START_TIMEOUT_S = 300.0
BIND_ATTEMPTS = 3  # starts tried when a chosen port was taken before the server bound it


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class HttpApi:
    """HTTP helpers over a server's three ports (`ports`, `keys`); `check_alive` and
    `log_tail` are the subclass's."""

    ports: dict[str, int]
    keys: dict[str, str] | None

    def check_alive(self) -> None:
        pass

    def log_tail(self, n: int = 60) -> str:
        return ""

    def url(self, api: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[api]}{path}"

    def auth_headers(self, api: str, token: Any = DEFAULT) -> dict[str, str]:
        if token is DEFAULT:
            if api == "metrics" or self.keys is None:
                return {}
            token = self.keys[api]
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    def request(
        self,
        method: str,
        api: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        token: Any = DEFAULT,
        timeout: float = 120.0,
    ) -> Response:
        hdrs = {**self.auth_headers(api, token), **(headers or {})}
        if json_body is not None:
            data = json.dumps(json_body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.url(api, path), data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return Response(resp.status, dict(resp.headers), resp.read())
        except urllib.error.HTTPError as err:
            return Response(err.code, dict(err.headers), err.read())

    def get(self, api: str, path: str, **kw: Any) -> Response:
        return self.request("GET", api, path, **kw)

    def post(self, api: str, path: str, json: Any = None, **kw: Any) -> Response:
        return self.request("POST", api, path, json_body=json, **kw)

    def put(self, api: str, path: str, **kw: Any) -> Response:
        return self.request("PUT", api, path, **kw)

    def delete(self, api: str, path: str, **kw: Any) -> Response:
        return self.request("DELETE", api, path, **kw)

    def predict(
        self, model: str, version: str | None = None, prompt: str = "1, 2, 3, 4,", max_tokens: int = 4, **kw: Any
    ) -> Response:
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        return self.post("inference", path, json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, **kw)

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.25)


@dataclass(eq=False)
class ServerProcess(HttpApi):
    """One server. `models` are `--models` values; `args` are further CLI flags; `env` adds to
    (or, with a None value, removes from) the environment; `config` is written as the
    `--config` YAML file when given."""

    workdir: Path
    model_store: Path
    models: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    proc: subprocess.Popen | None = None
    ports: dict[str, int] = field(default_factory=dict)
    keys: dict[str, str] | None = None
    key_file: str = "key_file.json"  # where the server writes its keys, relative to workdir

    # -- lifecycle ---------------------------------------------------------------------
    def command(self) -> list[str]:
        if not self.ports:
            self.ports = {api: free_port() for api in ("inference", "management", "metrics")}
        cmd = [
            sys.executable,
            "-m",
            "pagedserve.server.cli",
            "serve",
            "--model-store",
            str(self.model_store),
            "--inference-address",
            f"127.0.0.1:{self.ports['inference']}",
            "--management-address",
            f"127.0.0.1:{self.ports['management']}",
            "--metrics-address",
            f"127.0.0.1:{self.ports['metrics']}",
        ]
        if self.config is not None:
            import yaml

            path = self.workdir / "server-config.yaml"
            path.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(path)]
        if self.models:
            cmd += ["--models", *self.models]
        return cmd + list(self.args)

    def environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PAGEDSERVE_")
            or k in ("PAGEDSERVE_CACHE_DIR", "PAGEDSERVE_ARCHIVE_DIR", "PAGEDSERVE_DISABLE_CPU_KERNELS")
        }
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("PAGEDSERVE_WORKER_THREADS", "1")  # tests share a small machine
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def spawn(self) -> ServerProcess:
        """Start the process without waiting (see `wait_ready`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        key_file = self.workdir / self.key_file
        key_file.unlink(missing_ok=True)  # a fresh start writes fresh keys
        self.keys = None
        with open(self.workdir / "server.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def start(self, timeout: float = START_TIMEOUT_S, ready: bool = True) -> ServerProcess:
        """Spawn and wait until every port answers (and, with `ready`, /ready is 200).

        A port from `free_port` is free when chosen, not when the server binds it seconds later:
        another process (a parallel test worker) may take it in between. A start that fails on
        that alone is retried on fresh ports."""
        attempts = BIND_ATTEMPTS
        while True:
            logged = len(self.log_text())
            self.spawn()
            try:
                self.wait_ready(timeout, ready=ready)
                return self
            except RuntimeError:
                attempts -= 1
                if not attempts or "address already in use" not in self.log_text()[logged:]:
                    raise
                self.ports = {}

    def wait_ready(self, timeout: float = START_TIMEOUT_S, ready: bool = True) -> None:
        deadline = time.monotonic() + timeout
        path = "/ready" if ready else "/ping"
        while True:
            self.check_alive()
            self.read_keys()
            if "--disable-token-auth" in self.args or self.keys is not None:
                try:
                    r = self.get("inference", path, timeout=5)
                    m = self.get("management", "/models", timeout=5)
                    if r.status == 200 and m.status == 200:
                        return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.25)

    def read_keys(self) -> dict[str, str] | None:
        path = self.workdir / self.key_file
        if self.keys is None and path.is_file():
            try:
                data = json.loads(path.read_text())
                self.keys = {api: data[api]["key"] for api in ("inference", "management")}
            except (ValueError, KeyError):
                return None
        return self.keys

    def check_alive(self) -> None:
        if self.proc is None:
            raise RuntimeError("server not started")
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int | None:
        """Send `sig` (SIGTERM: drain), wait, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode

    def log_text(self) -> str:
        path = self.workdir / "server.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])
