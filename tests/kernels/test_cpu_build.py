"""The CPU extensions' build folders: one per source content, flags and checkout."""

from __future__ import annotations

from kernels.cpu_build import build_tag

FLAGS = ("-O3", "-fopenmp")


def test_the_tag_follows_content_flags_and_the_source_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "k.cpp").write_text("int f() { return 1; }\n")
    assert build_tag(a / "k.cpp", FLAGS) == build_tag(a / "k.cpp", FLAGS)
    # Another checkout of the same source: build.ninja would name other paths, so another folder.
    assert build_tag(a / "k.cpp", FLAGS) != build_tag(b / "k.cpp", FLAGS)
    assert build_tag(a / "k.cpp", FLAGS) != build_tag(a / "k.cpp", ("-O2", "-fopenmp"))
    before = build_tag(a / "k.cpp", FLAGS)
    (a / "k.cpp").write_text("int f() { return 2; }\n")
    assert build_tag(a / "k.cpp", FLAGS) != before
