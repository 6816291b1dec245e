"""The README's and the documentation's examples, run against a live server, so the docs cannot
drift from the code.

The server is started with the README's own first command (`.venv/bin/pagedserve serve --models
default`, in a fresh folder, with the management API on and its addresses moved to free ports by
PAGEDSERVE_* variables). Then every ```bash block of a page runs, in order, in one shell (so a
variable set by one block is there for the next), and every ```python block in its own process,
both in the server's folder (where `key_file.json` is). The examples say `localhost:8080` (8081,
8082), `.venv/bin/` and `<inference key>` (`<management key>`); the test maps those to the
server's ports, this venv and the server's keys. A curl that gets
an HTTP error fails its block (`--fail-with-body`), and so does any command that exits non-zero.

A block preceded by a `<!-- not run: REASON -->` line is not run (a deployment command, a
long-running server); other fences (```console, ```yaml, plain ```) are never run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ARCHIVE
from tests.server.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
README_SERVE = "bash .ci/install && .venv/bin/pagedserve serve --models default"
BLOCK = re.compile(r"(?P<marker><!-- not run: [^>]*-->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```", re.DOTALL)
PREAMBLE = """set -euo pipefail
curl() { command curl -sS --fail-with-body --max-time 300 "$@"; echo; }
IKEY=$(python3 -c 'import json; print(json.load(open("key_file.json"))["inference"]["key"])')
MKEY=$(python3 -c 'import json; print(json.load(open("key_file.json"))["management"]["key"])')
"""
PORTS = {"inference": 8080, "management": 8081, "metrics": 8082}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of the page's runnable blocks, in order."""
    found = []
    for match in BLOCK.finditer(page.read_text()):
        if match["marker"] or README_SERVE in match["code"]:
            continue  # not run; the set-up commands are tested by the readme tests
        found.append((match["lang"], match["code"]))
    return found


class ReadmeServer(ServerProcess):
    """The README's serve command as written, on free ports."""

    def command(self) -> list[str]:
        super().command()  # picks free ports; the server gets them through its environment
        self.env.update({f"PAGEDSERVE_{api.upper()}_ADDRESS": f"127.0.0.1:{self.ports[api]}" for api in PORTS})
        return [str(VENV_BIN / "pagedserve"), *README_SERVE.split(" && ")[1].split()[1:]]


@pytest.fixture(scope="module")
def live(tmp_path_factory, model_store, archive_cache):
    workdir = tmp_path_factory.mktemp("docs-examples")
    store = workdir / "model_store"
    store.mkdir()
    os.link(model_store / ARCHIVE, store / ARCHIVE)  # `--models default` finds its archive there
    server = ReadmeServer(
        workdir=workdir,
        model_store=store,
        env={
            "PAGEDSERVE_ARCHIVE_DIR": str(archive_cache),
            "PAGEDSERVE_ENABLE_MODEL_API": "true",
            "PAGEDSERVE_MAX_CONNECTIONS": "64",
        },
    )
    server.start()
    yield server
    server.stop()


def localize(code: str, server: ServerProcess) -> str:
    """The docs' default ports, `.venv/bin/` and `<inference key>` / `<management key>`
    placeholders, mapped to this server and this venv."""
    for api in ("inference", "management"):
        code = code.replace(f"<{api} key>", (server.keys or {}).get(api, ""))
    for api, port in PORTS.items():
        for host in ("localhost", "127.0.0.1"):
            code = code.replace(f"{host}:{port}", f"127.0.0.1:{server.ports[api]}")
    return code.replace(".venv/bin/", f"{VENV_BIN}/")


def run_block(lang: str, code: str, server: ServerProcess) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PAGEDSERVE_WORKER_THREADS": "1"}
    if lang == "bash":
        argv = ["bash", "-c", PREAMBLE + localize(code, server)]
    else:
        argv = [sys.executable, "-c", localize(code, server)]
    return subprocess.run(argv, cwd=server.workdir, env=env, capture_output=True, text=True, timeout=600, check=False)


def _needs(code: str, server: ServerProcess) -> str | None:
    """Why a block cannot run against this server, or None."""
    if "import ollama" in code and server.post("inference", "/api/chat", json={}).status == 404:
        return "the Ollama surface (/api/chat) is not served by this build"
    return None


PAGES = [p for p in pages() if blocks(p)]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page_examples_run(page: Path, live: ServerProcess):
    bash = [code for lang, code in blocks(page) if lang == "bash"]
    if bash:
        out = run_block("bash", "\n".join(bash), live)
        assert out.returncode == 0, f"{page.name}: bash examples failed\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    not_run = []
    for lang, code in blocks(page):
        if lang != "python":
            continue
        if reason := _needs(code, live):
            not_run.append(reason)
            continue
        out = run_block(lang, code, live)
        assert out.returncode == 0, f"{page.name}: python example failed\n{code}\n{out.stderr[-3000:]}"
    if not_run:
        pytest.skip(f"every other example ran; not run: {'; '.join(not_run)}")


def test_the_readme_tour_is_run():
    """The README's tour blocks are among those run: curl, the OpenAI SDK, the Ollama client and a
    registration."""
    code = "\n".join(c for _, c in blocks(REPO / "README.md"))
    for needle in ("curl", "openai.OpenAI", "ollama.Client", "localhost:8081/models?url="):
        assert needle in code
