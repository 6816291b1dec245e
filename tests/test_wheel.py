"""The wheel installs beside Hugging Face's `kernels` (a transformers dependency) without a
clash: built from this checkout, installed into a fresh venv that also has transformers and
`kernels`, then, from a folder outside the repository, one process imports `pagedserve.kernels`
and Hugging Face's `kernels` and loads a model through transformers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    # Without the caller's PYTHONPATH: a checkout on it would shadow the wheel being tested.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(argv)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_the_wheel_installs_beside_hugging_faces_kernels(tmp_path, default_model_dir):
    pytest.importorskip("kernels")  # Hugging Face's, from the test extra
    # From a copy of the checkout's files (tracked, and untracked ones git does not ignore): a
    # `build/` folder left in the checkout by an earlier build keeps files deleted since.
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO).stdout
    src = tmp_path / "src"
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        cwd=tmp_path,
    )
    wheel = next(dist.glob("pagedserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"pagedserve"}, tops  # nothing at the top level of site-packages but pagedserve
    shipped = {n.removeprefix("pagedserve/") for n in names if n.startswith("pagedserve/kernels/csrc/")}
    tracked = {str(f.relative_to(src)) for f in (src / "kernels" / "csrc").rglob("*") if f.is_file()}
    assert shipped == tracked and shipped  # the kernels' C++ sources ship (built on first use)

    # A fresh venv. It sees this venv's site-packages through a .pth line (torch, transformers,
    # Hugging Face's kernels: no download, no build), which does not run this venv's own .pth
    # files, so the editable install of the checkout is not in it: only the wheel is.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
        ).stdout.strip()
    )
    outer = [p for p in sys.path if p.rstrip("/").endswith("site-packages") and Path(p).is_dir()]
    (site / "outer_site.pth").write_text("".join(f"{p}\n" for p in outer or [sysconfig.get_paths()["purelib"]]))
    run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
        cwd=tmp_path,
    )

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    check = textwrap.dedent(f"""
        import kernels, pagedserve.kernels.cpu_build, pagedserve.server.cli
        import transformers
        assert "site-packages" in kernels.__file__, kernels.__file__  # Hugging Face's package
        assert hasattr(kernels, "get_kernel"), dir(kernels)
        assert "{REPO}" not in pagedserve.kernels.cpu_build.__file__  # the wheel's copy
        model = transformers.AutoModelForCausalLM.from_pretrained({str(default_model_dir)!r})
        print(type(model).__name__, kernels.__file__, pagedserve.kernels.cpu_build.__file__)
        """)
    out = run([str(python), "-c", check], cwd=outside)
    assert "LlamaForCausalLM" in out.stdout
