"""The real server (`pagedserve.server.app.serve.Server`: apps, middlewares, connection limits, lifecycle,
registry, engine-core worker processes) running inside the test process, on its own event loop
in a thread, on free loopback ports. Tests talk to it over real HTTP with the same helpers as a
spawned server (`HttpApi`), or reach into its state (`pagedserve.server.serving.state`, `server.call`).

    srv = InProcessServer(ServerConfig(model_store=..., load_models=["tiny=tiny.mar"])).start()
    assert srv.predict("tiny").status == 200
    srv.stop()

Starting one costs what its workers cost (seconds with a tiny random-weight model); modules
share one (module-scoped fixtures).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any

from pagedserve.server.app.serve import Server
from pagedserve.server.common.config import ServerConfig
from tests.server.server_process import HttpApi

START_TIMEOUT_S = 300.0


class InProcessServer(HttpApi):
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.lines: list[str] = []  # what the server printed
        self.server = Server(config, out=self.lines.append)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inprocess-server", daemon=True)
        self.ports: dict[str, int] = {}
        self.keys: dict[str, str] | None = None

    @property
    def state(self):
        return self.server.state

    def call(self, coro: Coroutine, timeout: float = 120.0) -> Any:
        """Run `coro` on the server's loop and return its result."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Start `coro` on the server's loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start(self, ready: bool = True, timeout: float = START_TIMEOUT_S) -> InProcessServer:
        self.thread.start()
        self.call(self.server.start(), timeout)
        self.ports = dict(self.server.ports)
        state = self.server.state
        if state.inference_key is not None:
            self.keys = {"inference": state.inference_key, "management": state.management_key}
        if ready:
            self.wait_for(lambda: state.serving(), timeout, what="every model ready")
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            try:
                self.call(self.server.stop(), 120)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(30)
        self.loop.close()

    def log_text(self) -> str:
        return "\n".join(self.lines)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached after {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.05)
