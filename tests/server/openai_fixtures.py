"""Fixtures of the OpenAI SDK test modules: the session's shared real server with the default
model (tests/server/conftest.py: `server`, `shared_server`) and an `openai.OpenAI` client pointed
at it. Import both names into a test module."""

from __future__ import annotations

import pytest

from tests.server.conftest import server  # noqa: F401 -- re-exported fixture


@pytest.fixture(scope="module")
def client(server):  # noqa: F811 -- the fixture imported above
    openai = pytest.importorskip("openai")
    return openai.OpenAI(
        base_url=server.url("inference", "/v1"), api_key=server.keys["inference"], max_retries=0, timeout=120
    )
