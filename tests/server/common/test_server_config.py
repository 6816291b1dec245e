"""Server configuration: defaults < file < environment < flags, and errors naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.server.common.config import ServerConfig, ServerConfigError, load_server_config
from tests.server.conftest import ARCHIVE, MODEL
from tests.server.server_process import REPO


def write(tmp_path, text):
    path = tmp_path / "server-config.yaml"
    path.write_text(text)
    return path


def test_defaults_are_safe():
    c = load_server_config(env={})
    assert c == ServerConfig()
    for addr in (c.inference_address, c.management_address, c.metrics_address):
        assert addr.startswith("127.0.0.1:")
    assert not c.enable_model_api and not c.disable_token_auth and not c.allow_custom_handlers
    assert c.allowed_urls == [] and c.key_file == "key_file.json"


def test_the_shipped_config_file_holds_the_defaults():
    assert load_server_config(REPO / "config" / "server-config.yaml", env={}) == ServerConfig()


def test_precedence_defaults_file_env_flags(tmp_path):
    path = write(
        tmp_path,
        "inference_address: 127.0.0.1:9001\nmanagement_address: 127.0.0.1:9002\n"
        "metrics_address: 127.0.0.1:9003\njob_queue_size: 7\n",
    )
    env = {
        "PAGEDSERVE_MANAGEMENT_ADDRESS": "127.0.0.1:9102",
        "PAGEDSERVE_METRICS_ADDRESS": "127.0.0.1:9103",
        "PAGEDSERVE_LOAD_MODELS": "a=a.mar, b.mar",
        "PAGEDSERVE_ENABLE_MODEL_API": "true",
        "PAGEDSERVE_CACHE_DIR": "/elsewhere",
    }  # an engine variable, not a server key
    c = load_server_config(path, env=env, overrides={"metrics_address": "127.0.0.1:9203"})
    assert c.inference_address == "127.0.0.1:9001"  # file
    assert c.management_address == "127.0.0.1:9102"  # env beats file
    assert c.metrics_address == "127.0.0.1:9203"  # flag beats env
    assert c.job_queue_size == 7 and c.enable_model_api is True
    assert c.load_models == ["a=a.mar", "b.mar"]
    assert c.drain_grace == 30.0  # default


@pytest.mark.parametrize(
    "text, words",
    [
        ("inference_adress: 127.0.0.1:1\n", "unknown key 'inference_adress'"),
        ("job_queue_size: 0\n", "job_queue_size: must be >= 1, got 0"),
        ("enable_model_api: 'yes'\n", "enable_model_api"),
        ("metrics_address: nowhere\n", "metrics_address"),
        ("load_models: a.mar\n", "load_models"),
        ("drain_grace: -1\n", "drain_grace"),
        ("- a\n- b\n", "mapping"),
    ],
)
def test_file_errors_name_the_key(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ServerConfigError, match="server-config.yaml") as err:
        load_server_config(path, env={})
    assert words in str(err.value)


@pytest.mark.parametrize(
    "name, value",
    [
        ("PAGEDSERVE_ENABLE_MODEL_API", "maybe"),
        ("PAGEDSERVE_JOB_QUEUE_SIZE", "many"),
        ("PAGEDSERVE_DRAIN_GRACE", "soon"),
    ],
)
def test_environment_errors_name_the_variable(name, value):
    with pytest.raises(ServerConfigError, match=name):
        load_server_config(env={name: value})


def test_cli_refuses_a_bad_config_with_exit_2(tmp_path):
    path = write(tmp_path, "enable_model_apis: true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.server.cli", "serve", "--config", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "unknown key 'enable_model_apis'" in proc.stderr


@pytest.mark.slow
def test_precedence_on_a_real_server(server_factory):
    """File turns the model API off, the environment turns it on; the key file path comes from
    the file, the environment and a flag: the flag wins. Addresses are flags over the env."""
    s = server_factory(
        config={"enable_model_api": False, "key_file": "file-keys.json", "inference_address": "127.0.0.1:1"},
        env={
            "PAGEDSERVE_ENABLE_MODEL_API": "true",
            "PAGEDSERVE_KEY_FILE": "env-keys.json",
            "PAGEDSERVE_INFERENCE_ADDRESS": "127.0.0.1:2",
        },
        args=["--key-file", "flag-keys.json"],
        key_file="flag-keys.json",
    )
    assert (s.workdir / "flag-keys.json").is_file()
    assert not (s.workdir / "env-keys.json").exists() and not (s.workdir / "file-keys.json").exists()
    r = s.post("management", f"/models?url={ARCHIVE}&initial_workers=0")
    assert r.status == 200, r.text  # enabled by the environment
    assert s.get("inference", "/ping").status in (200, 500)  # listening on the flag's port
    assert s.get("management", f"/models/{MODEL}").status == 200
