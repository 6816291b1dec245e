"""The operator's console (server/console/app.py, server/console/console_static/) in a real headless
Chromium (Debian's, installed by .ci/install-test-system; nothing downloaded) driven by
Playwright, against one real `pagedserve serve` for the whole module: the default model at
start, the model API on, a tiny second archive in the store to register and unload.

Each test leaves the server as it found it (one default-model worker). Screenshots of every page
go to the module's temporary output folder (printed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.server.conftest import ARCHIVE, MODEL, TINY, TINY_ARCHIVE
from tests.server.server_process import ServerProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_WEIGHT_LIMIT = 300 * 1024
FIRST_PAINT_LIMIT_MS = 1000
ADAPTER = "tiny-lora"
WORKER_TIMEOUT_MS = 300_000  # a worker of the default model starting on a busy 2-core machine

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        f"no Chromium at {CHROMIUM}: run .ci/install-test-system (apt-get install chromium)", allow_module_level=True
    )
expect = sync_api.expect


def _link(path: Path, dest: Path) -> None:
    try:
        os.link(path, dest)
    except OSError:
        shutil.copy(path, dest)


def _write_adapter(store: Path, tiny_model: Path, work: Path) -> None:
    """`tiny-lora.mar`: a LoRA adapter (random, rank 4) on "tiny" 1.0, made with the CLI."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from pagedserve.server.cli import main

    torch.manual_seed(3)
    with pytest.MonkeyPatch.context() as mp:
        # transformers 5.x asks for its hub `kernels` package by default; this checkout's own
        # `kernels` folder shadows that name: turn the hub kernels off, they are not wanted here
        mp.setenv("USE_HUB_KERNELS", "0")
        base = LlamaForCausalLM.from_pretrained(tiny_model)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(work / "adapter")
    assert (
        main(
            [
                "archive",
                "--lora-dir",
                str(work / "adapter"),
                "--base-model",
                f"{TINY}:1.0",
                "--model-name",
                ADAPTER,
                "--version",
                "1.0",
                "--export-path",
                str(store),
            ]
        )
        == 0
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory, model_store, tiny_store, tiny_model, archive_cache):
    store = tmp_path_factory.mktemp("console_store")
    _link(model_store / ARCHIVE, store / ARCHIVE)
    _link(tiny_store / TINY_ARCHIVE, store / TINY_ARCHIVE)
    _write_adapter(store, tiny_model, tmp_path_factory.mktemp("console_lora"))
    server = ServerProcess(
        workdir=tmp_path_factory.mktemp("console_server"),
        model_store=store,
        models=[f"{MODEL}={ARCHIVE}"],
        args=["--enable-model-api"],
        # the torch path: the C++ kernels are not what these tests are about
        env={
            "PAGEDSERVE_ARCHIVE_DIR": str(archive_cache),
            "PAGEDSERVE_DISABLE_CPU_KERNELS": "1",
            # stdout is a file here: ask for the link with the keys
            "PAGEDSERVE_CONSOLE_LINK_KEYS": "true",
        },
    )
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("console_screenshots")
    yield out
    print(f"\nconsole screenshots: {out}")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    """Every request the console's pages sent in this module: method, URL, headers."""
    return []


@pytest.fixture
def page(browser, seen):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.on("request", lambda r: seen.append({"method": r.method, "url": r.url, "headers": r.headers}))
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield pg
    context.close()
    # A CSP violation or a script error shows up here; refused API calls (4xx the test asked
    # for) are reported by Chromium as failed resource loads, which are expected.
    assert not [e for e in errors if "Failed to load resource" not in e], errors


def sign_in_link(srv) -> str:
    found = re.search(r"console \(sign-in link\): (\S+)", srv.log_text())
    assert found, srv.log_tail()
    return found.group(1)


def card(page, model: str, version: str = "1.0"):
    return page.locator(f'article.card[data-model="{model}"][data-version="{version}"]')


def signed_in(page, srv):
    page.goto(sign_in_link(srv))
    expect(card(page, MODEL)).to_be_visible(timeout=30_000)
    return page


# -- sign-in --------------------------------------------------------------------------------
def test_wrong_token_is_refused(page, srv, shots):
    page.goto(srv.url("management", "/console"))
    page.get_by_label("Management key").fill("not-the-key-0123456789")
    page.get_by_role("button", name="Sign in").click()
    error = page.locator("#signin-error")
    expect(error).to_contain_text("401", timeout=10_000)
    expect(error).to_contain_text("Token authorization failed")
    assert page.locator("#tabs").is_hidden() and page.locator("#overview").is_hidden()
    page.screenshot(path=shots / "signin-refused.png")


def test_sign_in_link_shows_the_default_model_with_memory_and_workers(page, srv, shots):
    link = sign_in_link(srv)
    assert "/console#token=" in link and srv.keys["management"] in link
    signed_in(page, srv)
    assert "#" not in page.url, "the keys stay in the address bar"
    entry = card(page, MODEL)
    expect(entry.locator(".badge").first).to_have_text("loaded")
    expect(entry.locator(".workers-count")).to_have_attribute("data-count", "1")
    expect(entry.locator(".memory")).to_contain_text("MiB of the")
    expect(entry.locator("table.workers tbody tr")).to_have_count(1)
    expect(entry.locator("table.workers tbody")).to_contain_text("READY")
    expect(entry.locator("table.workers tbody")).to_contain_text("cpu")
    expect(page.locator("#budget")).to_contain_text("used of")
    page.screenshot(path=shots / "overview.png", full_page=True)


def test_sign_in_by_typing_the_key(page, srv):
    page.goto(srv.url("management", "/console"))
    page.get_by_label("Management key").fill(srv.keys["management"])
    page.keyboard.press("Enter")
    expect(card(page, MODEL)).to_be_visible(timeout=30_000)


# -- actions --------------------------------------------------------------------------------
def test_scale_to_two_workers_shows_two(page, srv, shots):
    signed_in(page, srv)
    entry = card(page, MODEL)
    entry.get_by_label("Workers").fill("2")
    entry.get_by_role("button", name="Scale").click()
    expect(page.locator("#action-result")).to_contain_text("Workers scaled to 2", timeout=WORKER_TIMEOUT_MS)
    expect(entry.locator(".workers-count")).to_have_attribute("data-count", "2", timeout=30_000)
    expect(entry.locator("table.workers tbody tr")).to_have_count(2)
    page.screenshot(path=shots / "overview-2-workers.png", full_page=True)
    entry.get_by_label("Workers").fill("1")
    entry.get_by_role("button", name="Scale").click()
    expect(entry.locator(".workers-count")).to_have_attribute("data-count", "1", timeout=120_000)


def test_register_and_unload_a_second_model(page, srv, shots):
    signed_in(page, srv)
    page.get_by_role("tab", name="Register").click()
    page.get_by_label("Archive in the model store").select_option(TINY_ARCHIVE)
    expect(page.get_by_label("URL or allowed path")).to_have_value(TINY_ARCHIVE)
    page.get_by_role("button", name="Register").click()
    expect(page.locator("#register-result")).to_contain_text(
        f'Model "{TINY}" Version: 1.0 registered', timeout=WORKER_TIMEOUT_MS
    )
    page.screenshot(path=shots / "register.png", full_page=True)
    page.get_by_role("tab", name="Overview").click()
    tiny = card(page, TINY)
    expect(tiny).to_be_visible(timeout=10_000)
    expect(tiny.locator(".workers-count")).to_have_attribute("data-count", "1")
    # a LoRA adapter on it: registered the same way, listed on its base, removed from there
    page.get_by_role("tab", name="Register").click()
    page.get_by_label("Archive in the model store").select_option(f"{ADAPTER}.mar")
    page.get_by_role("button", name="Register").click()
    expect(page.locator("#register-result")).to_contain_text(
        f'Adapter "{ADAPTER}" Version: 1.0 registered', timeout=60_000
    )
    page.get_by_role("tab", name="Overview").click()
    expect(tiny.locator(".adapters")).to_contain_text(ADAPTER, timeout=10_000)
    page.locator("#play-model").wait_for(state="attached")
    assert ADAPTER in page.locator("#play-model option").all_inner_texts()
    page.screenshot(path=shots / "overview-adapter.png", full_page=True)
    tiny.get_by_role("button", name=f"Remove adapter {ADAPTER}").click()
    tiny.get_by_role("button", name=f"Confirm remove: Remove adapter {ADAPTER}").click()
    expect(page.locator("#action-result")).to_contain_text(
        f'Adapter "{ADAPTER}" version: 1.0 unregistered', timeout=60_000
    )
    expect(tiny.locator(".adapters")).to_have_count(0, timeout=10_000)
    unload = tiny.get_by_role("button", name="Unload")
    unload.click()
    tiny.get_by_role("button", name="Confirm unload").click()
    expect(page.locator("#action-result")).to_contain_text(f'Model "{TINY}" version: 1.0 unregistered', timeout=60_000)
    expect(tiny).to_have_count(0, timeout=10_000)
    assert srv.get("management", f"/models/{TINY}").status == 404


def test_refused_actions_show_the_api_error(page, srv):
    signed_in(page, srv)
    page.get_by_role("tab", name="Register").click()
    page.get_by_label("URL or allowed path").fill("no-such-archive.mar")
    page.get_by_role("button", name="Register").click()
    result = page.locator("#register-result")
    expect(result).to_contain_text("Refused: 404", timeout=10_000)
    expect(result).to_contain_text("no-such-archive.mar")
    page.get_by_role("tab", name="Overview").click()
    entry = card(page, MODEL)
    entry.get_by_label("Workers").fill("99")
    entry.get_by_role("button", name="Scale").click()
    expect(page.locator("#action-result")).to_contain_text("refused: 400", timeout=10_000)


def test_set_default_sleep_and_wake(page, srv):
    signed_in(page, srv)
    entry = card(page, MODEL)
    entry.get_by_role("button", name="Set default").click()
    expect(page.locator("#action-result")).to_contain_text("Default version successfully updated", timeout=10_000)
    entry.get_by_role("button", name="Sleep").click()
    expect(entry.locator(".badge").first).to_have_text("sleeping", timeout=60_000)
    entry.get_by_role("button", name="Wake").click()
    expect(page.locator("#action-result")).to_contain_text("is awake", timeout=WORKER_TIMEOUT_MS)
    expect(entry.locator(".badge").first).to_have_text("loaded", timeout=30_000)


# -- playground and charts ------------------------------------------------------------------
def test_playground_chat_streams_tokens_and_shows_timings(page, srv, shots):
    signed_in(page, srv)
    page.get_by_role("tab", name="Playground").click()
    page.locator("#play-model").select_option(MODEL)
    page.get_by_label("Max tokens").fill("24")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Prompt", exact=True).fill("Count from one to ten: one, two,")
    # Count the output's changes as they happen: streamed text arrives in many pieces.
    page.evaluate("""() => { window.__pieces = 0; new MutationObserver(() => window.__pieces++)
        .observe(document.getElementById('play-output'), {childList: true, characterData: true, subtree: true}); }""")
    page.get_by_role("button", name="Send").click()
    timings = page.locator("#play-timings")
    expect(timings).to_contain_text("Time to first token", timeout=120_000)
    assert page.locator("#play-error").inner_text() == ""
    assert page.locator("#play-output").inner_text().strip()
    assert page.evaluate("window.__pieces") > 3, "the reply came whole, not streamed"
    assert re.search(r"Time to first token\s*\d+(\.\d)? ms", timings.inner_text()), timings.inner_text()
    expect(timings).to_contain_text("Output tokens")
    curl = page.get_by_label("curl").input_value()
    assert "/v1/chat/completions" in curl and '"stream": true' in curl
    assert srv.keys["inference"] not in curl, "the snippet names the key as a variable"
    sdk = page.get_by_label("OpenAI Python SDK").input_value()
    assert "client.chat.completions.create(" in sdk and f'model="{MODEL}"' in sdk
    page.screenshot(path=shots / "playground.png", full_page=True)


def test_playground_without_the_inference_key_shows_the_refusal(page, srv):
    signed_in(page, srv)
    page.get_by_role("tab", name="Playground").click()
    page.locator("#play-key").fill("wrong-inference-key-0123")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#play-error")).to_contain_text("401", timeout=30_000)


def _load(srv, n: int) -> None:
    for i in range(n):
        r = srv.post(
            "inference",
            "/v1/completions",
            json={"model": MODEL, "prompt": f"Request {i}: the alphabet is", "max_tokens": 12, "temperature": 0},
        )
        assert r.status == 200, r.text


def test_charts_draw_non_empty_data_after_a_short_load(page, srv, shots):
    """A short load, then the page opened: its charts already hold the last minutes (the
    server's samples), not only what came after it was opened."""
    _load(srv, 4)
    time.sleep(2.5)  # a sample after the load
    opened = time.time()
    signed_in(page, srv)
    page.get_by_role("tab", name="Charts").click()
    for chart in ("tokens", "requests", "ttft", "itl"):
        fig = page.locator(f"#chart-{chart}")
        expect(fig).not_to_have_attribute("data-max", re.compile(r"^(0)?$"), timeout=10_000)
        assert int(fig.get_attribute("data-points")) > 0
        assert float(fig.get_attribute("data-first")) < opened - 10, "history from before the page"
    assert page.locator("#chart-tokens canvas").count() == 1
    # the canvas is painted: some pixel of the tokens/s chart is not the background
    painted = page.evaluate("""() => { const c = document.querySelector('#chart-tokens canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
    assert painted > 100
    page.locator("#chart-model").select_option(MODEL)
    expect(page.locator("#chart-tokens")).not_to_have_attribute("data-max", re.compile(r"^(0)?$"))
    page.screenshot(path=shots / "charts.png", full_page=True)


# -- layout, keyboard, labels ---------------------------------------------------------------
def test_phone_width_and_keyboard(browser, srv, shots):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    try:
        page.goto(srv.url("management", "/console"))
        page.wait_for_function("document.activeElement.id === 'signin-token'")  # focused at load
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == "signin-inference"
        page.keyboard.press("Shift+Tab")
        page.keyboard.type(srv.keys["management"])
        page.keyboard.press("Enter")
        expect(card(page, MODEL)).to_be_visible(timeout=30_000)
        page.screenshot(path=shots / "overview-phone.png", full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, "no sideways scrolling"
        page.get_by_role("tab", name="Overview").focus()
        for name in ("charts", "register", "playground"):
            page.keyboard.press("ArrowRight")
            assert page.evaluate("document.activeElement.id") == f"tab-{name}"
            expect(page.locator(f"#{name}")).to_be_visible()
        page.screenshot(path=shots / "playground-phone.png", full_page=True)
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
            .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                         && !e.textContent.trim()).map(e => e.id || e.outerHTML)""")
        assert unlabelled == []
    finally:
        context.close()


# -- what the console may do, and what it weighs --------------------------------------------
def test_inference_port_answers_the_console_origin_only(srv):
    console = f"http://127.0.0.1:{srv.ports['management']}"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    ok = srv.request(
        "OPTIONS", "inference", "/v1/chat/completions", token=None, headers={"Origin": console, **preflight}
    )
    assert ok.status == 204 and "Authorization" in ok.headers["Access-Control-Allow-Headers"]
    assert ok.headers["Access-Control-Allow-Origin"] == console
    other = srv.request(
        "OPTIONS",
        "inference",
        "/v1/chat/completions",
        token=None,
        headers={"Origin": "http://evil.example:8081", **preflight},
    )
    assert "Access-Control-Allow-Origin" not in other.headers
    # the preflight grants nothing: the key is still checked
    refused = srv.post(
        "inference", "/v1/completions", json={"model": MODEL, "prompt": "a"}, token=None, headers={"Origin": console}
    )
    assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == console
    answered = srv.post(
        "inference",
        "/v1/completions",
        headers={"Origin": "http://evil.example:1"},
        json={"model": MODEL, "prompt": "a", "max_tokens": 1},
    )
    assert answered.status == 200 and "Access-Control-Allow-Origin" not in answered.headers


def test_console_adds_no_privileges(srv, seen):
    """Every call the console's pages made in this module is a management call that carried
    the key and is refused without it; the page's responses carry the CSP."""
    base = srv.url("management")
    static = re.compile(r"^/console(/|/static/.*)?$")
    calls = {
        (s["method"], s["url"])
        for s in seen
        if s["url"].startswith(base) and not static.match(urllib.parse.urlsplit(s["url"]).path)
    }
    kinds = {(m, re.sub(r"/models/[^/?]+(/[^/?]+)?", "/models/M", urllib.parse.urlsplit(u).path)) for m, u in calls}
    for expected in [
        ("GET", "/models"),
        ("POST", "/models"),
        ("PUT", "/models/M"),
        ("DELETE", "/models/M"),
        ("GET", "/console/api/metrics"),
        ("GET", "/console/api/info"),
        ("GET", "/console/api/history"),
    ]:
        assert expected in kinds, (expected, sorted(kinds))
    assert any(
        p.endswith(("/sleep", "/wake", "/set-default"))
        for _, p in ((m, urllib.parse.urlsplit(u).path) for m, u in calls)
    )
    for s in seen:
        if s["url"].startswith(base) and not static.match(urllib.parse.urlsplit(s["url"]).path):
            assert s["headers"].get("authorization", "").startswith("Bearer "), s["url"]
    key = srv.keys["management"]
    assert not any(key in s["url"] for s in seen), "the key never travels in a URL"
    for method, url in sorted(calls):
        path = url.removeprefix(base)
        for token in (None, "wrong-key-0123456789abcdef"):
            r = srv.request(method, "management", path, token=token)
            assert r.status == 401, (method, path, r.status, r.text)
            assert "Content-Security-Policy" in r.headers
    page = srv.get("management", "/console", token=None)
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    html = page.text
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "no inline script"
    assert not re.search(r"\son[a-z]+=", html) and " style=" not in html


def test_page_weight_and_first_paint(browser, srv):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    sizes: dict[str, int] = {}
    page.on(
        "response",
        lambda r: (
            sizes.__setitem__(r.url, len(r.body()))
            if r.request.resource_type in ("document", "script", "stylesheet")
            else None
        ),
    )
    try:
        page.goto(srv.url("management", "/console"), wait_until="load")
        expect(page.get_by_label("Management key")).to_be_visible()
        paint = page.evaluate("""() => new Promise(done => {
            const read = () => performance.getEntriesByType('paint');
            const e = read(); if (e.length) return done(e.map(x => [x.name, x.startTime]));
            new PerformanceObserver(() => done(read().map(x => [x.name, x.startTime])))
                .observe({type: 'paint', buffered: true}); })""")
        page.goto(sign_in_link(srv))
        expect(card(page, MODEL)).to_be_visible(timeout=30_000)
        page.get_by_role("tab", name="Charts").click()
        expect(page.locator("#chart-tokens canvas")).to_have_count(1)
    finally:
        context.close()
    total = sum(sizes.values())
    first_paint = dict(paint).get("first-paint", dict(paint).get("first-contentful-paint"))
    print(
        f"\nconsole page weight: {total} bytes over {len(sizes)} files (HTML + JS + CSS); "
        f"first paint {first_paint:.0f} ms; paint entries {json.dumps(paint)}"
    )
    assert any(u.endswith("/console") for u in sizes) and any("uPlot" in u for u in sizes)
    assert total <= PAGE_WEIGHT_LIMIT
    assert first_paint <= FIRST_PAINT_LIMIT_MS
