"""Which registration URLs are allowed (pagedserve.server.workers.archives.resolve_url): the model store by
default, `allowed_urls` patterns on the resolved location otherwise, never a download."""

from __future__ import annotations

import pytest

from pagedserve.server.workers.archives import ArchiveNotFoundError, UrlNotAllowedError, resolve_url


@pytest.fixture
def layout(tmp_path):
    store = tmp_path / "store"
    (store / "sub").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    for path in (store / "a.mar", store / "sub" / "b.tar.gz", other / "c.mar"):
        path.write_bytes(b"PK")
    (store / "link.mar").symlink_to(other / "c.mar")
    return store, other


def test_store_only_by_default(layout):
    store, other = layout
    assert resolve_url("a.mar", store, []) == (store / "a.mar").resolve()
    assert resolve_url("sub/b.tar.gz", store, []) == (store / "sub" / "b.tar.gz").resolve()
    assert resolve_url(f"file://{store}/a.mar", store, []) == (store / "a.mar").resolve()
    for url in (
        str(other / "c.mar"),
        "../other/c.mar",
        f"file://{other}/c.mar",
        "link.mar",
        "sub/../../other/c.mar",
        ".",
        "http://127.0.0.1/a.mar",
        "s3://bucket/a.mar",
    ):
        with pytest.raises(UrlNotAllowedError):
            resolve_url(url, store, [])
    with pytest.raises(ArchiveNotFoundError):
        resolve_url("missing.mar", store, [])
    with pytest.raises(ValueError, match="required"):
        resolve_url(" ", store, [])


def test_allowed_urls_match_the_resolved_location(layout):
    store, other = layout
    allowed = [f"file://{other}/[^/]+\\.mar"]
    assert resolve_url(f"file://{other}/c.mar", store, allowed) == (other / "c.mar").resolve()
    assert resolve_url("link.mar", store, allowed) == (other / "c.mar").resolve()
    # allowed_urls replaces the store rule, and traversal is judged after resolution.
    with pytest.raises(UrlNotAllowedError):
        resolve_url("a.mar", store, allowed)
    with pytest.raises(UrlNotAllowedError):
        resolve_url(f"file://{other}/../store/a.mar", store, [f"file://{other}/.*"])


def test_never_downloads(layout):
    store, _ = layout
    with pytest.raises(ValueError, match="does not download"):
        resolve_url("https://example.com/a.mar", store, ["https://example.com/.*"])
