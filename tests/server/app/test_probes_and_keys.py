"""Health probes without a token, keys given or kept instead of generated, key rotation through
`/token`, and the key file written only once the ports are bound. In-process servers with no
model (they start in well under a second), one with the tiny model for the probes."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest

from pagedserve.server.commands.serve import add_serve_parser
from pagedserve.server.common.config import ServerConfig, ServerConfigError, load_server_config
from tests.server.conftest import TINY, TINY_ARCHIVE
from tests.server.inprocess import InProcessServer

PROBES = ["/ping", "/live", "/ready", "/v2/health/live", "/v2/health/ready"]
KEY_A, KEY_B = "inference-key-0123456789", "management-key-0123456789"


@pytest.fixture(scope="module")
def server(inprocess_factory):
    return inprocess_factory(load_models=[f"{TINY}={TINY_ARCHIVE}"])


def _keys(path: str | Path) -> dict[str, str]:
    data = json.loads(Path(path).read_text())
    return {api: data[api]["key"] for api in ("inference", "management")}


@pytest.mark.parametrize("path", PROBES)
def test_probes_answer_without_a_token_and_say_only_health(server, path):
    for token in (None, "a-wrong-token"):
        r = server.get("inference", path, token=token)
        assert r.status == 200, r.text
        assert set(r.json()) <= {"status", "live", "ready"}, r.json()  # health, nothing else
    # The rest of the port still needs the key.
    assert server.get("inference", "/v1/models", token=None).status == 401
    assert server.get("inference", f"/v2/models/{TINY}/ready", token=None).status == 401


def test_health_needs_token_makes_probes_need_the_inference_key(inprocess_factory):
    srv = inprocess_factory(health_needs_token=True)
    for path in PROBES:
        assert srv.get("inference", path, token=None).status == 401, path
        assert srv.get("inference", path, token=srv.keys["management"]).status == 401, path
        assert srv.get("inference", path).status == 200, path


def test_given_keys_are_used_and_written(inprocess_factory):
    srv = inprocess_factory(inference_key=KEY_A, management_key=KEY_B)
    assert _keys(srv.config.key_file) == {"inference": KEY_A, "management": KEY_B}
    assert stat.S_IMODE(os.stat(srv.config.key_file).st_mode) == 0o600
    assert srv.get("inference", "/v1/models", token=KEY_A).status == 200
    assert srv.get("management", "/models", token=KEY_B).status == 200
    assert srv.get("management", "/models", token=KEY_A).status == 401


def test_keys_come_from_flags_and_the_environment(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--inference-key", KEY_A, "--keep-key-file", "--health-needs-token"])
    assert (args.inference_key, args.keep_key_file, args.health_needs_token) == (KEY_A, True, True)
    config = load_server_config(
        env={"PAGEDSERVE_INFERENCE_KEY": KEY_A, "PAGEDSERVE_MANAGEMENT_KEY": KEY_B, "PAGEDSERVE_KEEP_KEY_FILE": "true"}
    )
    assert (config.inference_key, config.management_key, config.keep_key_file) == (KEY_A, KEY_B, True)
    for bad in ("short", "has a space in it......", "x" * 513):
        with pytest.raises(ServerConfigError, match="inference_key") as info:
            load_server_config(env={"PAGEDSERVE_INFERENCE_KEY": bad})
        assert bad not in str(info.value)  # a refused key is not echoed


def test_a_kept_key_file_survives_a_restart(inprocess_factory, tmp_path):
    key_file = str(tmp_path / "keys.json")
    first = inprocess_factory(key_file=key_file, keep_key_file=True)  # no file yet: generated
    keys = _keys(key_file)
    assert first.keys == keys and "written" in first.log_text()
    first.stop()
    mtime = os.stat(key_file).st_mtime_ns
    second = inprocess_factory(key_file=key_file, keep_key_file=True)
    assert second.keys == keys and "kept" in second.log_text()
    assert os.stat(key_file).st_mtime_ns == mtime  # not rewritten
    assert second.get("inference", "/v1/models", token=keys["inference"]).status == 200
    # A given key wins over the kept one; the other is kept.
    third = inprocess_factory(key_file=key_file, keep_key_file=True, management_key=KEY_B)
    assert third.keys == {"inference": keys["inference"], "management": KEY_B} == _keys(key_file)
    # Without keep_key_file, a restart generates new keys.
    fourth = inprocess_factory(key_file=key_file)
    assert fourth.keys["inference"] != keys["inference"] and fourth.keys == _keys(key_file)


def test_a_broken_key_file_is_not_kept(tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text('{"inference": {"key": "x"}}')
    srv = InProcessServer(
        ServerConfig(
            key_file=str(key_file),
            keep_key_file=True,
            snapshot_path=None,
            **{f"{a}_address": "127.0.0.1:0" for a in ("inference", "management", "metrics")},
        )
    )
    try:
        with pytest.raises(ServerConfigError, match="cannot be kept"):
            srv.start()
        assert key_file.read_text() == '{"inference": {"key": "x"}}'
    finally:
        srv.stop()


def test_a_failed_second_start_leaves_the_key_file_untouched(inprocess_factory):
    running = inprocess_factory()
    key_file = running.config.key_file
    before, mtime = Path(key_file).read_bytes(), os.stat(key_file).st_mtime_ns
    port = running.ports["inference"]
    second = InProcessServer(
        ServerConfig(
            key_file=key_file,
            snapshot_path=None,
            inference_address=f"127.0.0.1:{port}",
            management_address="127.0.0.1:0",
            metrics_address="127.0.0.1:0",
        )
    )
    try:
        with pytest.raises(OSError):
            second.start()
    finally:
        second.stop()
    assert Path(key_file).read_bytes() == before and os.stat(key_file).st_mtime_ns == mtime
    assert running.get("inference", "/v1/models").status == 200  # its keys still work


def test_token_api_rotates_one_key(inprocess_factory):
    srv = inprocess_factory()
    old = dict(srv.keys)
    r = srv.get("management", "/token?type=inference")
    assert r.status == 200, r.text
    new = r.json()["inference"]["key"]
    assert new != old["inference"] and _keys(srv.config.key_file) == {"inference": new, "management": old["management"]}
    assert srv.get("inference", "/v1/models", token=old["inference"]).status == 401
    assert srv.get("inference", "/v1/models", token=new).status == 200
    r = srv.get("management", "/token?type=management")
    new_management = r.json()["management"]["key"]
    assert srv.get("management", "/models", token=old["management"]).status == 401
    assert srv.get("management", "/models", token=new_management).status == 200
    for query, named in (("", "type"), ("?type=admin", "type"), ("?type=inference&extra=1", "extra")):
        r = srv.get("management", f"/token{query}", token=new_management)
        assert r.status == 400 and named in r.json()["message"], r.text
    assert srv.get("management", "/token?type=inference", token=None).status == 401
    assert srv.get("management", "/token?type=inference", token=new).status == 401  # not the inference key


def test_token_api_without_authorization_says_why(inprocess_factory):
    srv = inprocess_factory(disable_token_auth=True)
    r = srv.get("management", "/token?type=inference", token=None)
    assert r.status == 400 and "--disable-token-auth" in r.json()["message"]
