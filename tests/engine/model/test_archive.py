"""Model archives: round trips in each format, atomic writes, and every refusal of open_archive."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from datetime import datetime
from pathlib import Path

import pytest

from pagedserve.engine.model import archive_write
from pagedserve.engine.model.archive import MANIFEST_PATH, ArchiveError, OpenedArchive, open_archive, write_archive

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}
MODEL_CONFIG_YAML = b"minWorkers: 1\nmaxWorkers: 1\nhandler:\n  max_model_len: 128\n"


def model_files() -> dict[str, bytes]:
    """A small model directory's files (the weights need not be a loadable model here)."""
    import numpy as np
    from safetensors.numpy import save

    weights = save({"model.embed_tokens.weight": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)})
    return {
        "config.json": json.dumps(CONFIG).encode(),
        "model.safetensors": weights,
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
        "tokenizer_config.json": b"{}",
        "chat_template.jinja": b"{{ messages }}",
        "generation_config.json": b'{"eos_token_id": 2}',
    }


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    for name, data in model_files().items():
        (d / name).write_bytes(data)
    return d


@pytest.fixture
def config_yaml(tmp_path: Path) -> Path:
    p = tmp_path / "model-config.yaml"
    p.write_bytes(MODEL_CONFIG_YAML)
    return p


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_empty(folder: Path) -> None:
    assert not folder.exists() or list(folder.iterdir()) == []


# ---- writing and round trips -----------------------------------------------------------------


@pytest.mark.parametrize("fmt,suffix", [("default", ".mar"), ("tgz", ".tar.gz"), ("no-archive", "")])
def test_round_trip(tmp_path, model_dir, config_yaml, fmt, suffix):
    calls = []
    out = write_archive(
        model_dir,
        tmp_path / "store",
        model_name="tiny",
        version="1.0",
        config_file=config_yaml,
        archive_format=fmt,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert out == tmp_path / "store" / f"tiny{suffix}"
    assert sorted(os.listdir(tmp_path / "store")) == [out.name]  # no temporary left
    total = sum(len(b) for b in model_files().values()) + len(MODEL_CONFIG_YAML)
    assert calls[-1] == (total, total)

    opened = open_archive(out, tmp_path / "opened")
    assert isinstance(opened, OpenedArchive)
    expected = {**model_files(), "model-config.yaml": MODEL_CONFIG_YAML}
    got = tree(opened.root)
    manifest_bytes = got.pop(MANIFEST_PATH)
    assert got == expected
    assert opened.root == (out if fmt == "no-archive" else tmp_path / "opened")
    assert opened.model_config == opened.root / "model-config.yaml"
    assert opened.custom_handler is None
    manifest = json.loads(manifest_bytes)
    assert manifest == opened.manifest
    datetime.strptime(manifest["createdOn"], "%d/%m/%Y %H:%M:%S")
    assert manifest["runtime"] == "python" and manifest["archiverVersion"]
    assert manifest["model"] == {
        "modelName": "tiny",
        "modelVersion": "1.0",
        "handler": "llm",
        "serializedFile": "model.safetensors",
        "configFile": "model-config.yaml",
    }
    assert manifest["files"] == {name: sha(data) for name, data in expected.items()}


def test_write_extra_files_and_custom_handler(tmp_path, model_dir):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    handler = tmp_path / "my_handler.py"
    handler.write_text("def handle(data, context):\n    return data\n")
    out = write_archive(
        model_dir, tmp_path / "store", model_name="tiny", version="2", handler=str(handler), extra_files=[notes]
    )
    assert json.loads(zipfile.ZipFile(out).read(MANIFEST_PATH))["model"]["handler"] == "my_handler.py"
    with pytest.raises(ArchiveError, match="allow_custom_handlers=True"):
        open_archive(out, tmp_path / "refused")
    assert_empty(tmp_path / "refused")
    opened = open_archive(out, tmp_path / "opened", allow_custom_handlers=True)
    assert opened.custom_handler == tmp_path / "opened" / "my_handler.py"
    assert (opened.root / "notes.txt").read_text() == "hello"


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_refuses_overwrite_unless_forced(tmp_path, model_dir, fmt):
    out = write_archive(model_dir, tmp_path, model_name="tiny", version="1", archive_format=fmt)
    with pytest.raises(FileExistsError, match="force=True"):
        write_archive(model_dir, tmp_path, model_name="tiny", version="2", archive_format=fmt)
    write_archive(model_dir, tmp_path, model_name="tiny", version="2", archive_format=fmt, force=True)
    opened = open_archive(out, tmp_path / "opened")
    assert opened.manifest["model"]["modelVersion"] == "2"
    left = {out.name, "src"} | ({"opened"} if fmt != "no-archive" else set())  # folders open in place
    assert {p.name for p in tmp_path.iterdir()} == left


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_nothing(tmp_path, model_dir, monkeypatch, fmt, existing):
    store = tmp_path / "store"
    if existing:
        old = write_archive(model_dir, store, model_name="tiny", version="old", archive_format=fmt)
        before = tree(old) if old.is_dir() else {old.name: old.read_bytes()}

    def interrupt(self, n):
        raise KeyboardInterrupt

    monkeypatch.setattr(archive_write._Progress, "advance", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_archive(model_dir, store, model_name="tiny", version="new", archive_format=fmt, force=True)
    if existing:  # the old archive is untouched and nothing else is there
        assert [p.name for p in store.iterdir()] == [old.name]
        assert (tree(old) if old.is_dir() else {old.name: old.read_bytes()}) == before
    else:
        assert_empty(store)


def test_write_refuses_pickle_and_unsupported_models(tmp_path, model_dir):
    (model_dir / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="convert_model"):
        write_archive(model_dir, tmp_path / "store", model_name="tiny", version="1")
    (model_dir / "pytorch_model.bin").unlink()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        write_archive(model_dir, tmp_path / "store", model_name="tiny", version="1")
    with pytest.raises(ValueError, match="invalid model name"):
        write_archive(model_dir, tmp_path / "store", model_name="../evil", version="1")
    assert_empty(tmp_path / "store")


# ---- crafted archives ------------------------------------------------------------------------


def manifest(files: dict[str, bytes] | None, **model) -> bytes:
    fields = {"modelName": "tiny", "modelVersion": "1.0", "handler": "llm", **model}
    body = {"createdOn": "01/01/2025 00:00:00", "runtime": "python", "model": fields, "archiverVersion": "test"}
    if files is not None:
        body["files"] = {name: sha(data) for name, data in files.items()}
    return json.dumps(body).encode()


def valid_entries(**model) -> dict[str, bytes]:
    files = model_files()
    return {**files, MANIFEST_PATH: manifest(files, **model)}


def make_zip(path: Path, entries: dict[str, bytes] | list[tuple[str, bytes]]) -> Path:
    items = entries.items() if isinstance(entries, dict) else entries
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in items:
            zf.writestr(name, data)
    return path


def tar_member(name: str, data: bytes = b"", type_: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = type_, len(data), link
    return info, data


def make_tar(path: Path, entries: dict[str, bytes], extra: list[tuple] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in entries.items():
            tf.addfile(*_with_stream(tar_member(name, data)))
        for member in extra:
            tf.addfile(*_with_stream(member))
    return path


def _with_stream(member: tuple) -> tuple:
    info, data = member
    return info, (io.BytesIO(data) if info.isreg() else None)


def refuse(path: Path, dest: Path, match: str, **kwargs) -> None:
    with pytest.raises(ArchiveError, match=match):
        open_archive(path, dest, **kwargs)
    assert_empty(dest.parent)


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "out" / "model"


@pytest.mark.parametrize("name", ["/etc/evil", "C:/evil"])
def test_refuses_absolute_paths(tmp_path, dest, name):
    refuse(make_zip(tmp_path / "a.mar", {**valid_entries(), name: b"x"}), dest, "absolute path")
    refuse(make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member(name, b"x")]), dest, "absolute path")


@pytest.mark.parametrize("name", ["../evil", "sub/../../evil"])
def test_refuses_dotdot(tmp_path, dest, name):
    refuse(make_zip(tmp_path / "a.mar", {**valid_entries(), name: b"x"}), dest, r"contains '\.\.'")
    refuse(make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member(name, b"x")]), dest, r"contains '\.\.'")


@pytest.mark.parametrize(
    "type_,target",
    [
        (tarfile.SYMTYPE, "/etc/passwd"),
        (tarfile.SYMTYPE, "../x"),
        (tarfile.SYMTYPE, "a/../../x"),
        (tarfile.LNKTYPE, "../x"),
    ],
)
def test_refuses_tar_links_leaving_the_archive(tmp_path, dest, type_, target):
    path = make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member("link", type_=type_, link=target)])
    refuse(path, dest, "points outside the archive")


@pytest.mark.parametrize("target", ["../../etc/passwd", "/etc/passwd"])
def test_refuses_zip_symlink_leaving_the_archive(tmp_path, dest, target):
    path = make_zip(tmp_path / "a.mar", valid_entries())
    with zipfile.ZipFile(path, "a") as zf:
        info = zipfile.ZipInfo("sub/link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, target)
    refuse(path, dest, "points outside the archive")


def test_refuses_entries_under_a_file_or_link(tmp_path, dest):
    refuse(
        make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member("config.json/x", b"x")]),
        dest,
        "lies under 'config.json', which is a file",
    )
    link = tar_member("sub", type_=tarfile.SYMTYPE, link="tokenizer.json")
    refuse(
        make_tar(tmp_path / "b.tgz", valid_entries(), [link, tar_member("sub/x", b"x")]),
        dest,
        "lies under 'sub', which is a link",
    )


def test_tar_link_inside_is_materialised_as_a_copy(tmp_path, dest):
    files = {**model_files(), "tokenizer_copy.json": model_files()["tokenizer.json"]}
    entries = {n: d for n, d in files.items() if n != "tokenizer_copy.json"}
    entries[MANIFEST_PATH] = manifest(files)
    path = make_tar(
        tmp_path / "a.tgz", entries, [tar_member("tokenizer_copy.json", type_=tarfile.SYMTYPE, link="tokenizer.json")]
    )
    opened = open_archive(path, dest)
    copy = opened.root / "tokenizer_copy.json"
    assert not copy.is_symlink() and copy.read_bytes() == files["tokenizer.json"]
    refuse(
        make_tar(
            tmp_path / "b.tgz", entries, [tar_member("sub", type_=tarfile.SYMTYPE, link="."), tar_member("sub/x", b"x")]
        ),
        tmp_path / "out2" / "model",
        "names a folder",
    )


@pytest.mark.parametrize("type_", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_refuses_device_files_and_fifos(tmp_path, dest, type_):
    path = make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member("dev", type_=type_)])
    refuse(path, dest, "device file, fifo")


def test_refuses_declared_size_over_limit(tmp_path, dest):
    entries = {**valid_entries(), "zeros": bytes(200_000)}  # deflates to a few hundred bytes
    path = make_zip(tmp_path / "a.mar", entries)
    assert path.stat().st_size < 10_000
    refuse(path, dest, "over the limit", max_total_bytes=100_000)
    refuse(make_tar(tmp_path / "a.tgz", entries), dest, "over the limit", max_total_bytes=100_000)


def test_refuses_zip_entry_lying_about_its_size(tmp_path, dest):
    entries = valid_entries()
    path = make_zip(tmp_path / "a.mar", {**entries, "zeros": bytes(300_000)})
    raw = bytearray(path.read_bytes())
    size_field = (300_000).to_bytes(4, "little")
    assert raw.count(size_field) == 2  # local header and central directory
    path.write_bytes(bytes(raw).replace(size_field, (100).to_bytes(4, "little")))
    refuse(path, dest, "corrupt|more bytes")


def test_refuses_duplicate_entries(tmp_path, dest):
    entries = list(valid_entries().items()) + [("config.json", b"{}")]
    with pytest.warns(UserWarning, match="Duplicate name"):
        path = make_zip(tmp_path / "a.mar", entries)
    refuse(path, dest, "duplicate entry 'config.json'")
    refuse(
        make_tar(tmp_path / "a.tgz", valid_entries(), [tar_member("./config.json", b"{}")]),
        dest,
        "duplicate entry 'config.json'",
    )


@pytest.mark.parametrize(
    "manifest_bytes,match",
    [
        (None, "missing MAR-INF/MANIFEST.json"),
        (b"not json", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (json.dumps({"runtime": "python"}).encode(), "missing the 'model' object"),
        (json.dumps({"model": {"handler": "llm"}}).encode(), "invalid model name None"),
        (json.dumps({"model": {"modelName": "tiny"}}).encode(), "missing model.handler"),
        (json.dumps({"model": {"modelName": "tiny", "handler": "llm"}, "files": []}).encode(), "'files' must map"),
    ],
)
def test_refuses_missing_or_malformed_manifest(tmp_path, dest, manifest_bytes, match):
    entries = model_files()
    if manifest_bytes is not None:
        entries[MANIFEST_PATH] = manifest_bytes
    refuse(make_zip(tmp_path / "a.mar", entries), dest, match)


def test_refuses_hash_mismatch_missing_and_unlisted_files(tmp_path, dest):
    files = model_files()
    tampered = {
        **files,
        "config.json": json.dumps({**CONFIG, "vocab_size": 65}).encode(),
        MANIFEST_PATH: manifest(files),
    }
    refuse(make_zip(tmp_path / "a.mar", tampered), dest, "sha256 mismatch for config.json")
    missing = {**valid_entries()}
    del missing["chat_template.jinja"]
    refuse(make_zip(tmp_path / "b.mar", missing), dest, "missing: chat_template.jinja")
    refuse(
        make_zip(tmp_path / "c.mar", {**valid_entries(), "extra.txt": b"x"}),
        dest,
        "not listed in the manifest: extra.txt",
    )


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "model.ckpt", "x.pkl"])
def test_refuses_pickle_weights(tmp_path, dest, name):
    files = {**model_files(), name: b"\x80\x04pickle"}
    refuse(
        make_zip(tmp_path / "a.mar", {**files, MANIFEST_PATH: manifest(files)}),
        dest,
        f"pickle format \\({name}\\).*convert_model",
    )


def test_refuses_unsupported_architecture(tmp_path, dest):
    files = {**model_files(), "config.json": json.dumps({"architectures": ["GPT2LMHeadModel"]}).encode()}
    refuse(
        make_zip(tmp_path / "a.mar", {**files, MANIFEST_PATH: manifest(files)}),
        dest,
        "not supported: unsupported architecture GPT2LMHeadModel",
    )


@pytest.mark.parametrize(
    "handler,code_file",
    [
        ("my_handler.py", "my_handler.py"),
        ("my_handler", "my_handler.py"),
        ("my_handler:handle", "my_handler.py"),
        ("llm", "llm.py"),
    ],
)
def test_refuses_custom_handler_code_unless_allowed(tmp_path, dest, handler, code_file):
    files = {**model_files(), code_file: b"import os\nos.system('echo pwned')\n"}
    path = make_zip(tmp_path / "a.mar", {**files, MANIFEST_PATH: manifest(files, handler=handler)})
    refuse(path, dest, "Python code shipped inside the archive.*allow_custom_handlers=True")
    opened = open_archive(path, dest, allow_custom_handlers=True)
    assert opened.custom_handler == dest / code_file


def test_refuses_unknown_or_missing_handler(tmp_path, dest):
    refuse(make_zip(tmp_path / "a.mar", valid_entries(handler="text_classifier")), dest, "unknown handler")
    refuse(make_zip(tmp_path / "b.mar", valid_entries(handler="mine.py")), dest, "not in the archive")


def test_torchserve_vllm_handler_is_the_built_in_handler(tmp_path, dest):
    opened = open_archive(make_zip(tmp_path / "v.mar", valid_entries(handler="vllm_handler")), dest)
    assert opened.custom_handler is None


def test_folder_is_verified_in_place(tmp_path, model_dir):
    folder = write_archive(model_dir, tmp_path / "store", model_name="tiny", version="1", archive_format="no-archive")
    unused = tmp_path / "unused"
    assert open_archive(folder, unused).root == folder
    assert not unused.exists()
    (folder / "leak").symlink_to(tmp_path / "src" / "config.json")
    with pytest.raises(ArchiveError, match="points outside"):
        open_archive(folder, unused)
    (folder / "leak").unlink()
    os.mkfifo(folder / "fifo")
    with pytest.raises(ArchiveError, match="device file, fifo"):
        open_archive(folder, unused)
    (folder / "fifo").unlink()
    (folder / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 65}))
    with pytest.raises(ArchiveError, match="sha256 mismatch"):
        open_archive(folder, unused)
    assert not unused.exists()


@pytest.mark.parametrize("fmt", ["default", "tgz"])
def test_interrupted_open_leaves_nothing(tmp_path, model_dir, monkeypatch, fmt):
    from pagedserve.engine.model import archive_read

    out = write_archive(model_dir, tmp_path / "store", model_name="tiny", version="1", archive_format=fmt)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(archive_read, "_verify", interrupt)
    with pytest.raises(KeyboardInterrupt):
        open_archive(out, tmp_path / "out" / "model")
    assert_empty(tmp_path / "out")


def test_refuses_non_empty_destination(tmp_path, model_dir):
    out = write_archive(model_dir, tmp_path / "store", model_name="tiny", version="1")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep")
    with pytest.raises(FileExistsError):
        open_archive(out, tmp_path / "busy")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["file"]


# ---- archives made by TorchServe's torch-model-archiver -------------------------------------


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with a real tokenizer next to it."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny_hf")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(d, safe_serialization=True)
    try:
        from pagedserve.engine.model.default_model import default_model_dir

        source = default_model_dir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(source / name, d / name)
    except FileNotFoundError:  # no bundled model here: a minimal tokenizer is enough to archive
        (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    return d


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_opens_torch_model_archiver_archive(tmp_path, tiny_hf_model, fmt):
    pytest.importorskip("model_archiver")
    work = tmp_path / "work"
    work.mkdir()
    # torch-model-archiver copies a file for any handler it does not know: an empty llm.py
    # stands for pagedserve's built-in handler.
    (work / "llm.py").write_text("# pagedserve built-in llm handler\n")
    config = work / "model-config.yaml"
    config.write_bytes(MODEL_CONFIG_YAML)
    files = sorted(tiny_hf_model.iterdir())
    export = tmp_path / "export"
    export.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "model_archiver.model_packaging",
        "--model-name",
        "tiny",
        "--version",
        "1.0",
        "--handler",
        "llm",
        "--extra-files",
        ",".join(map(str, files)),
        "--config-file",
        str(config),
        "--export-path",
        str(export),
        "--archive-format",
        fmt,
    ]
    subprocess.run(
        cmd, cwd=work, check=True, capture_output=True, env={**os.environ, "TMPDIR": str(work)}
    )  # it stages files in $TMPDIR/<name>
    (produced,) = export.iterdir()

    opened = open_archive(produced, tmp_path / "opened")
    assert "files" not in opened.manifest
    assert opened.manifest["model"]["modelName"] == "tiny"
    assert opened.manifest["model"]["handler"] == "llm" and opened.custom_handler is None
    assert opened.model_config is not None and opened.model_config.read_bytes() == MODEL_CONFIG_YAML
    for f in files:
        assert (opened.root / f.name).read_bytes() == f.read_bytes()


def test_torch_model_archiver_archive_generates_like_transformers(tmp_path, tiny_hf_model, monkeypatch):
    pytest.importorskip("model_archiver")
    import torch
    import transformers

    from pagedserve.engine import LLM, SamplingParams

    work = tmp_path / "work"
    work.mkdir()
    (work / "llm.py").write_text("# pagedserve built-in llm handler\n")
    cmd = [
        sys.executable,
        "-m",
        "model_archiver.model_packaging",
        "--model-name",
        "tiny",
        "--version",
        "1.0",
        "--handler",
        "llm",
        "--extra-files",
        ",".join(map(str, sorted(tiny_hf_model.iterdir()))),
        "--export-path",
        str(work),
    ]
    subprocess.run(cmd, cwd=work, check=True, capture_output=True, env={**os.environ, "TMPDIR": str(work)})
    monkeypatch.setenv("PAGEDSERVE_ARCHIVE_DIR", str(tmp_path / "extracted"))
    llm = LLM(work / "tiny.mar", dtype="float32", num_kv_blocks=32)
    prompt = [5, 17, 33, 8, 41]
    ours = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_model).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert ours == ref.tolist() and ours
