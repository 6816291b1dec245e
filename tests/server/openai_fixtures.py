"""Fixtures of the OpenAI SDK test modules: a real server with the default model (one per
module) and an `openai.OpenAI` client pointed at it. Import both names into a test module."""

from __future__ import annotations

import pytest

from tests.server.conftest import ARCHIVE, MODEL


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(models=[f"{MODEL}={ARCHIVE}"])


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url("inference", "/v1"), api_key=server.keys["inference"],
                         max_retries=0, timeout=120)
