"""The console's shipped files and its origin rules, without a browser or a server: the
vendored charting library is the pinned one, every file is package data, the page has no inline
script or style, the page weight is in bounds, and only the console's origin is let through to
the inference port. (tests/server/console/test_console.py drives the page in Chromium.)"""

from __future__ import annotations

import hashlib
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import tomllib

from pagedserve.server.common.config import ServerConfig
from pagedserve.server.console.app import STATIC_DIR, console_origin_allowed, inference_origin, load_static, page_csp

REPO = Path(__file__).resolve().parents[3]
PORTS = {"inference": 8080, "management": 8081, "metrics": 8082}


def test_vendored_files_are_the_pinned_ones():
    table = (STATIC_DIR / "vendor" / "VERSIONS.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| .+ \| ([\d.]+) \| `([0-9a-f]{64})` \|$", table, re.MULTILINE)
    assert {name for name, _, _ in rows} == {"uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE.txt"}
    for name, version, digest in rows:
        assert version == "1.6.32"
        assert hashlib.sha256((STATIC_DIR / "vendor" / name).read_bytes()).hexdigest() == digest, name
    assert "MIT License" in (STATIC_DIR / "vendor" / "uPlot.LICENSE.txt").read_text()


def test_every_console_file_is_package_data():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "pagedserve.server.console"
    ]
    server_dir = STATIC_DIR.parent
    files = [p.relative_to(server_dir).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()]
    assert files
    missing = [f for f in files if not any(fnmatch(f, g) for g in globs)]
    assert missing == []


def test_page_has_no_inline_script_or_style_and_weighs_little():
    html = (STATIC_DIR / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html)
    assert not re.search(r"\son[a-z]+\s*=", html) and not re.search(r"\sstyle\s*=", html)
    assert "<style" not in html
    for src in re.findall(r'(?:src|href)="(/console/static/[^"]+)"', html):
        assert src in load_static(), src  # every file the page names is served
    scripts = [p for p in STATIC_DIR.rglob("*.js")]
    for script in scripts:
        text = script.read_text()
        assert not re.search(r"\.innerHTML\s*=|\beval\(|new Function", text), script
    weight = sum(len(f.body) for name, f in load_static().items() if name.endswith((".js", ".css")))
    assert weight + len(html.encode()) <= 300 * 1024


def test_static_paths_are_a_fixed_set():
    files = load_static()
    assert "/console/static/js/app.js" in files and "/console/static/vendor/uPlot.iife.min.js" in files
    assert all(name.startswith("/console/static/") and ".." not in name for name in files)
    assert "/console/static/vendor/VERSIONS.md" not in files  # only the page's kinds of files
    assert files["/console/static/js/app.js"].content_type.startswith("text/javascript")


@pytest.mark.parametrize(
    ("management", "origin", "allowed"),
    [
        ("127.0.0.1:8081", "http://127.0.0.1:8081", True),
        ("127.0.0.1:8081", "http://localhost:8081", True),
        ("127.0.0.1:8081", "http://127.0.0.1:9999", False),  # another port: another page
        ("127.0.0.1:8081", "https://127.0.0.1:8081", False),
        ("127.0.0.1:8081", "http://evil.example:8081", False),
        ("127.0.0.1:8081", "null", False),
        ("10.0.0.5:8081", "http://10.0.0.5:8081", True),
        ("10.0.0.5:8081", "http://127.0.0.1:8081", False),
        ("0.0.0.0:8081", "http://console.lan:8081", True),
    ],
)
def test_only_the_console_origin_may_call_the_inference_port(management, origin, allowed):
    config = ServerConfig(management_address=management)
    assert console_origin_allowed(config, PORTS, origin) is allowed


def test_inference_origin_and_csp():
    config = ServerConfig()
    assert inference_origin(config, PORTS, "localhost") == "http://localhost:8080"
    config = ServerConfig(inference_address="10.0.0.5:8080", management_address="10.0.0.5:8081")
    assert inference_origin(config, PORTS, "10.0.0.5") == "http://10.0.0.5:8080"
    config = ServerConfig(inference_address="0.0.0.0:8080")
    csp = page_csp(config, PORTS, "server.lan")
    assert "connect-src 'self' http://server.lan:8080;" in csp
    assert "script-src 'self';" in csp and "style-src 'self';" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp


def test_history_keeps_fifteen_minutes_and_answers_since():
    from pagedserve.server.console.history import CHART_FAMILIES, MetricsHistory
    from pagedserve.server.metrics.families import ServerMetrics

    metrics = ServerMetrics()
    metrics.generation_tokens.labels("m").inc(5)
    text = metrics.render(CHART_FAMILIES)
    assert b'pagedserve_generation_tokens_total{model="m"} 5.0' in text
    assert b"pagedserve_request_latency" not in text  # only what the charts read
    history = MetricsHistory(window_s=60)
    for t in range(0, 121, 2):
        history.add(1000.0 + t, text)
    times = [s["t"] for s in history.since(0)]
    assert times[0] == 1060.0 and times[-1] == 1120.0 and len(times) == 31
    assert [s["t"] for s in history.since(1116.0)] == [1118.0, 1120.0]
    assert history.since(0)[0]["metrics"] == text.decode()
    assert history.nbytes() < len(text) * len(times)  # compressed


def test_the_printed_link_carries_the_keys_only_when_asked(tmp_path):
    from pagedserve.server.app.serve import build_state
    from pagedserve.server.common.auth import ApiKeys, KeyStore
    from pagedserve.server.console.app import sign_in_line

    keys = KeyStore(ApiKeys.generate(), tmp_path / "key_file.json")
    state = build_state(ServerConfig(management_address="0.0.0.0:8081"), make_engine=None, keys=keys)
    state.ports["management"] = 8081
    try:
        line = sign_in_line(state, with_keys=True)
        assert line.endswith(
            f" http://127.0.0.1:8081/console#token={keys.keys.management}&inference_token={keys.keys.inference}"
        )
        line = sign_in_line(state, with_keys=False)
        assert keys.keys.management not in line and keys.keys.inference not in line
        assert "http://127.0.0.1:8081/console " in line and str(keys.path) in line
    finally:
        state.executor.shutdown()
