"""The registry refuses what could never be served or removed, and never lets the live state and
the saved one differ (issue 11, findings 7, 8, 9, 10 and the huge timeouts of 5).

In-process: a real `ModelRegistry` over a tiny random-weight archive (versions registered with 0
workers start no process) and a real `Snapshotter`, whose writes fail for real (the snapshot
folder replaced by a file; a file-size limit in a child process). Over HTTP: a real server whose
snapshot lives on a real, full 8 KiB tmpfs, mounted in a private mount namespace
(`unshare -rm`), so that a save fails with ENOSPC (507)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.server.common.auth import ApiKeys, write_key_file
from pagedserve.server.workers.registry import ModelRegistry
from pagedserve.server.workers.rules import MAX_NAME_LENGTH, SaveFailedError, check_model_name, check_version
from pagedserve.server.workers.snapshot import Snapshotter
from tests.server.server_process import REPO, ServerProcess

TINY_CONFIG = "minWorkers: 1\nmaxWorkers: 2\nhandler:\n  max_model_len: 256\n  num_kv_blocks: 32\n"


@pytest.fixture(scope="module")
def tiny_store(tiny_model, tmp_path_factory) -> Path:
    """A model store with tiny.mar (version 1.0, maxWorkers 2) and tiny-v2.mar (version 2.0)."""
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("store")
    config = tmp_path_factory.mktemp("cfg") / "model-config.yaml"
    config.write_text(TINY_CONFIG)
    build = tmp_path_factory.mktemp("build")
    for version, file_name in (("1.0", "tiny.mar"), ("2.0", "tiny-v2.mar")):
        written = write_archive(tiny_model, build / version, model_name="tiny", version=version, config_file=config)
        written.rename(store / file_name)
    return store


def _make_engine(entry, worker_name, on_dead):
    from pagedserve.engine.config.engine import EngineConfig
    from pagedserve.engine.core.async_llm import AsyncLLM

    config = EngineConfig(model=str(entry.model_dir), model_verified=True, num_threads=1)
    return AsyncLLM(config, entry.tokenizer, name=worker_name, on_dead=on_dead)


def run_with_registry(store: Path, snapshot_path: Path, scenario):
    """Run `scenario(registry, snapshot, archives)` with a registry that saves every change."""

    async def main():
        executor = ThreadPoolExecutor(2)
        registry = ModelRegistry(executor, _make_engine)
        snapshot = Snapshotter(snapshot_path)
        registry.persist = lambda: snapshot.save(registry)
        archives = {name: await registry.open(store / name) for name in ("tiny.mar", "tiny-v2.mar")}
        try:
            return await scenario(registry, snapshot, archives)
        finally:
            await registry.shutdown()
            executor.shutdown(wait=False)

    return asyncio.run(main())


def saved(path: Path) -> list[dict]:
    return json.loads(path.read_text())["models"]


# -- finding 7: names ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "Model_1.0-b", "a" * MAX_NAME_LENGTH])
def test_names_in_torchserve_characters_are_accepted(name):
    assert check_model_name(name) == name
    assert check_version("1.0-rc_2") == "1.0-rc_2"


@pytest.mark.parametrize(
    "name", ["a" * 10_000, "a" * (MAX_NAME_LENGTH + 1), "a/b", "a b", "", "1abc", "tiny\n", "ti%2Fny", "é", None, 3]
)
def test_names_outside_the_rule_are_refused_naming_it(name):
    with pytest.raises(ValueError, match=f"at most {MAX_NAME_LENGTH} characters"):
        check_model_name(name)


def test_registration_refuses_a_name_that_could_never_be_unregistered(tiny_store, tmp_path):
    async def scenario(registry, snapshot, archives):
        with pytest.raises(ValueError, match="model name 'aaaa"):
            await registry.register(archives["tiny.mar"], url="tiny.mar", name="a" * 10_000, initial_workers=0)
        assert registry.models == {}
        assert not (tmp_path / "snapshot.json").exists()

    run_with_registry(tiny_store, tmp_path / "snapshot.json", scenario)


# -- finding 8 and 5: worker counts and timeouts ------------------------------------------------
def test_worker_counts_stay_within_the_versions_maximum(tiny_store, tmp_path):
    async def scenario(registry, snapshot, archives):
        with pytest.raises(ValueError, match="min_worker: 3 must not exceed the archive's maxWorkers: 2"):
            await registry.register(archives["tiny.mar"], url="tiny.mar", initial_workers=3)
        entry = await registry.register(archives["tiny.mar"], url="tiny.mar", initial_workers=0)
        assert (entry.min_workers, entry.max_workers) == (0, 2)
        with pytest.raises(ValueError, match="min_worker: 6 must not exceed maxWorkers: 2"):
            await registry.scale(entry, 6, synchronous=True)
        with pytest.raises(ValueError, match="min_worker: 3 must not exceed max_worker: 2"):
            await registry.scale(entry, 3, 2, synchronous=True)
        assert (entry.min_workers, entry.max_workers, entry.pool.size) == (0, 2, 0)
        assert await registry.scale(entry, 0, 5, synchronous=True)  # an explicit new maximum
        assert (entry.min_workers, entry.max_workers) == (0, 5)
        assert saved(tmp_path / "snapshot.json")[0]["max_workers"] == 5

    run_with_registry(tiny_store, tmp_path / "snapshot.json", scenario)


def test_huge_timeouts_are_refused_naming_them(tiny_store, tmp_path):
    async def scenario(registry, snapshot, archives):
        with pytest.raises(ValueError, match="response_timeout: must be <= 86400 seconds, got 1000000000000000000000"):
            await registry.register(archives["tiny.mar"], url="tiny.mar", initial_workers=0, response_timeout=10**21)
        assert registry.models == {}
        entry = await registry.register(
            archives["tiny.mar"], url="tiny.mar", initial_workers=0, response_timeout=86_400
        )
        assert entry.model_config.response_timeout == 86_400
        with pytest.raises(ValueError, match="timeout: must be <= 86400 seconds, got 1000"):
            await registry.scale(entry, 0, synchronous=True, timeout=10**400)
        assert await registry.scale(entry, 0, synchronous=True, timeout=-1)

    run_with_registry(tiny_store, tmp_path / "snapshot.json", scenario)


# -- finding 9: a failed save undoes the change ----------------------------------------------
def test_a_failed_save_undoes_every_kind_of_change(tiny_store, tmp_path):
    folder = tmp_path / "snapshots"
    path = folder / "snapshot.json"

    async def scenario(registry, snapshot, archives):
        v1 = await registry.register(archives["tiny.mar"], url="tiny.mar", initial_workers=0)
        await registry.register(archives["tiny-v2.mar"], url="tiny-v2.mar", initial_workers=0)
        before = path.read_bytes()
        # The folder goes away and a file takes its name: every save now fails for real.
        shutil.move(folder, tmp_path / "moved")
        folder.write_text("not a folder")

        with pytest.raises(SaveFailedError) as failed:
            await registry.unregister("tiny", "2.0")
        assert failed.value.status == 500 and "could not save the snapshot" in str(failed.value)
        assert sorted(registry.models["tiny"].versions) == ["1.0", "2.0"]
        with pytest.raises(SaveFailedError):
            registry.set_default("tiny", "2.0")
        assert registry.models["tiny"].default_version == "1.0"
        with pytest.raises(SaveFailedError):
            await registry.scale(v1, 1, synchronous=True)
        assert (v1.min_workers, v1.pool.size) == (0, 0)  # no worker was started
        # A registration taking itself back has no one to refuse: it goes, and that is logged.
        await registry.unregister("tiny", "2.0", force=True)
        with pytest.raises(SaveFailedError):
            await registry.scale(v1, 0, 3, synchronous=True)
        assert v1.max_workers == 2
        # Registered again, the live state equals the saved one: nothing to write.
        await registry.register(archives["tiny-v2.mar"], url="tiny-v2.mar", initial_workers=0)
        with pytest.raises(SaveFailedError):
            await registry.unregister("tiny", "2.0")
        assert sorted(registry.models["tiny"].versions) == ["1.0", "2.0"]

        folder.unlink()  # the folder is back: saving works again, and says it all
        shutil.move(tmp_path / "moved", folder)
        assert path.read_bytes() == before
        assert sorted(os.listdir(folder)) == ["snapshot.json"]  # no temporary file left
        await registry.unregister("tiny", "2.0")
        assert [(e["version"], e["default"]) for e in saved(path)] == [("1.0", True)]

    run_with_registry(tiny_store, path, scenario)


def test_malformed_snapshot_entries_are_skipped_and_kept(tmp_path, caplog):
    good = {"name": "tiny", "version": "1.0", "url": "tiny.mar", "min_workers": 1, "max_workers": 2, "default": True}
    bad = [
        {**good, "version": "2.0", "min_workers": "1"},  # a wrong type
        {k: v for k, v in good.items() if k != "url"} | {"version": "3.0"},  # a missing key
        {**good, "name": "a" * 10_000},  # a name no URL can hold
        {**good, "version": "4.0", "workers": 1},  # an unknown key
        "not an entry",
    ]
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"format": 1, "models": [bad[0], good, *bad[1:]]}))
    snapshot = Snapshotter(path)
    with caplog.at_level("ERROR", logger="pagedserve.server.workers.snapshot"):
        entries = snapshot.load()
    assert [(e.name, e.version) for e in entries] == [("tiny", "1.0")]
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 5 and all("malformed" in e and "kept" in e for e in errors)
    assert "Expected `int`, got `str` - at `$.min_workers`" in errors[0]
    assert "missing required field `url`" in errors[1]

    class Empty:  # a registry with nothing registered: the save writes what was carried
        def sorted_models(self):
            return []

    snapshot.save(Empty())
    assert saved(path) == bad  # the operator finds them as they were


def test_a_file_that_is_not_a_snapshot_stops_the_start_with_a_message(tmp_path):
    path = tmp_path / "snapshot.json"
    path.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="malformed.*move it away"):
        Snapshotter(path).load()


# -- finding 10: the key file ----------------------------------------------------------------
def test_key_file_is_never_written_through_a_planted_link(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    key_file = tmp_path / "key_file.json"
    planted = tmp_path / f".key_file.json.tmp-{os.getpid()}"
    planted.symlink_to(target)
    keys = ApiKeys.generate()
    write_key_file(key_file, keys)
    assert target.read_text() == "precious\n"
    assert planted.is_symlink() and os.readlink(planted) == str(target)
    assert json.loads(key_file.read_text()) == keys.to_json()
    assert not key_file.is_symlink() and (key_file.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, key_file.name, planted.name])


def test_a_link_planted_at_the_exact_temporary_name_is_not_opened(tmp_path, monkeypatch):
    """Even a guessed temporary name is safe: O_EXCL|O_NOFOLLOW refuses the planted link and
    the next random name is used."""
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr("pagedserve.server.common.safe_write.secrets.token_hex", lambda n: next(names))
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    planted = tmp_path / f".key_file.json.tmp-{os.getpid()}-guessed"
    planted.symlink_to(target)
    keys = ApiKeys.generate()
    write_key_file(tmp_path / "key_file.json", keys)
    assert target.read_text() == "precious\n" and planted.is_symlink()
    assert json.loads((tmp_path / "key_file.json").read_text()) == keys.to_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([planted.name, "key_file.json", "victim.txt"])


def test_key_file_replaces_a_link_at_its_own_name_instead_of_following_it(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    key_file = tmp_path / "key_file.json"
    key_file.symlink_to(target)
    write_key_file(key_file, ApiKeys.generate())
    assert target.read_text() == "precious\n" and not key_file.is_symlink()


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path):
    """A child process limited to 100-byte files (RLIMIT_FSIZE): the write fails with EFBIG."""
    path = tmp_path / "snapshot.json"
    path.write_text("old\n")
    script = textwrap.dedent(f"""
        import resource, signal
        from pagedserve.server.common.safe_write import write_atomically
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
        try:
            write_atomically({str(path)!r}, b"x" * 1000)
        except OSError as exc:
            print(exc.errno)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == str(errno.EFBIG), out.stderr
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["snapshot.json"]


# -- over HTTP: a real server, its snapshot on a full tmpfs ------------------------------------
# The namespace's root mounts a small tmpfs at $1, seeds it with the snapshot $2, fills what is
# left, then becomes the server ("$@"): the pid stays the same, and /proc/<pid>/root shows the
# tmpfs from outside.
NAMESPACE_SCRIPT = (
    'mount -t tmpfs -o size=8k tmpfs "$1" && cp "$2" "$1/snapshot.json" && '
    '{ head -c 8192 /dev/zero > "$1/filler" 2>/dev/null; shift 2; exec "$@"; }'
)
MALFORMED = {
    "name": "tiny",
    "version": "9.0",
    "url": "tiny.mar",
    "min_workers": "1",
    "max_workers": 2,
    "default": False,
}


class FullDiskServer(ServerProcess):
    disk: Path = Path()
    seed: Path = Path()

    def command(self) -> list[str]:
        return [
            "unshare",
            "-rm",
            "sh",
            "-c",
            NAMESPACE_SCRIPT,
            "sh",
            str(self.disk),
            str(self.seed),
            *super().command(),
        ]

    def on_disk(self, name: str = "") -> Path:
        """A path on the server's tmpfs, as seen from outside its mount namespace."""
        return Path(f"/proc/{self.proc.pid}/root") / self.disk.relative_to("/") / name


@pytest.fixture(scope="module")
def full(tiny_store, archive_cache, tmp_path_factory):
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("needs a private mount namespace (unshare -rm) to mount a small tmpfs")
    workdir = tmp_path_factory.mktemp("server")
    (workdir / "disk").mkdir()
    seed = workdir / "seed.json"
    good = {"name": "tiny", "version": "1.0", "url": "tiny.mar", "min_workers": 1, "max_workers": 2, "default": True}
    seed.write_text(json.dumps({"format": 1, "models": [MALFORMED, good]}))
    server = FullDiskServer(
        workdir=workdir,
        model_store=tiny_store,
        args=["--enable-model-api"],
        env={"PAGEDSERVE_ARCHIVE_DIR": str(archive_cache)},
        config={"snapshot_path": str(workdir / "disk" / "snapshot.json"), "worker_heartbeat_timeout": 3},
    )
    server.disk, server.seed = workdir / "disk", seed
    try:
        yield server.start()
    finally:
        server.stop()


def test_the_start_goes_on_past_a_malformed_snapshot_entry(full):
    [desc] = full.get("management", "/models/tiny/all").json()
    assert desc["modelVersion"] == "1.0" and desc["loadedAtStartup"]
    assert "snapshot" in full.log_text() and "entry 0 is malformed" in full.log_text()
    assert json.loads(full.on_disk("snapshot.json").read_text())["models"][0] == MALFORMED


def test_names_worker_counts_and_timeouts_are_400s_naming_the_rule(full):
    r = full.post(
        "management", "/models", json={"url": "tiny-v2.mar", "model_name": "a" * 10_000, "initial_workers": 0}
    )
    assert r.status == 400 and "at most 128 characters" in r.json()["message"], r.text
    r = full.put("management", "/models/tiny/1.0?min_worker=6")
    assert r.status == 400 and "min_worker: 6 must not exceed" in r.text, r.text
    assert "maxWorkers" in r.text and ": 2" in r.text
    r = full.put("management", f"/models/tiny/1.0?min_worker=1&synchronous=true&timeout={10**400}")
    assert r.status == 400 and "timeout" in r.text, r.text
    r = full.post("management", f"/models?url=tiny-v2.mar&initial_workers=0&response_timeout={10**30}")
    assert r.status == 400 and "response_timeout" in r.text, r.text
    [desc] = full.get("management", "/models/tiny/all").json()
    assert (desc["minWorkers"], desc["maxWorkers"], len(desc["workers"])) == (1, 2, 1)


def test_a_full_disk_refuses_changes_with_507_and_keeps_the_saved_state(full):
    saved_before = full.on_disk("snapshot.json").read_bytes()
    r = full.post("management", "/models?url=tiny-v2.mar&initial_workers=0")
    assert r.status == 507, r.text
    assert r.json()["type"] == "InsufficientStorageException"
    assert "No space left on device" in r.json()["message"]
    r = full.put("management", "/models/tiny/1.0?min_worker=0&max_worker=1")
    assert r.status == 507, r.text
    [desc] = full.get("management", "/models/tiny/all").json()  # both changes undone
    assert (desc["modelVersion"], desc["minWorkers"], desc["maxWorkers"]) == ("1.0", 1, 2)
    assert full.on_disk("snapshot.json").read_bytes() == saved_before
    assert sorted(os.listdir(full.on_disk())) == ["filler", "snapshot.json"]  # no temp file

    full.on_disk("filler").unlink()  # room again: the same change goes through and is saved
    r = full.post("management", "/models?url=tiny-v2.mar&initial_workers=0")
    assert r.status == 200, r.text
    models = json.loads(full.on_disk("snapshot.json").read_text())["models"]
    assert [(m["version"], m["min_workers"]) for m in models] == [
        ("1.0", 1),
        ("2.0", 0),
        ("9.0", "1"),
    ]  # the malformed entry is still kept
    assert full.delete("management", "/models/tiny/2.0").status == 200


def test_a_stopped_worker_is_reported_and_restarted(full):
    [worker] = full.get("management", "/models/tiny/1.0").json()[0]["workers"]
    pid = worker["pid"]
    os.kill(pid, signal.SIGSTOP)
    r = full.predict("tiny", "1.0")  # in flight until the heartbeat timeout (3 s) runs out
    assert r.status == 503 and "stalled, killed" in r.json()["message"], r.text
    # The restart waits out its back-off first: the worker is reported down meanwhile.
    assert full.get("inference", "/ping").json() == {"status": "Unhealthy"}
    [worker] = full.get("management", "/models/tiny/1.0").json()[0]["workers"]
    assert worker["status"] in ("RESTARTING", "STARTING") and "stalled" in worker["lastError"]

    def restarted():
        [w] = full.get("management", "/models/tiny/1.0").json()[0]["workers"]
        return w["status"] == "READY" and w["pid"] != pid and w["restarts"] == 1

    full.wait_for(restarted, timeout=120, what="the stalled worker restarted")
    assert full.predict("tiny", "1.0").status == 200
    assert full.get("inference", "/ping").json() == {"status": "Healthy"}
    with pytest.raises(ProcessLookupError):  # killed although stopped, and reaped
        os.kill(pid, 0)
