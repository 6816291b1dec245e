"""The test helper ServerProcess under parallel test workers: a port chosen by `free_port` and
taken by another process before the server bound it costs a retry on fresh ports, not a failure."""

from __future__ import annotations

import socket

from tests.server.server_process import ServerProcess, free_port


def test_a_port_taken_before_the_bind_is_retried_on_fresh_ports(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(workdir=tmp_path / "server", model_store=store, args=["--disable-token-auth"])
        server.ports = {"inference": port, "management": free_port(), "metrics": free_port()}
        try:
            server.start(ready=False)
            assert "address already in use" in server.log_text()  # the first start failed on it
            assert port not in server.ports.values()
            assert server.get("inference", "/ping").status == 200
        finally:
            assert server.stop() == 0
