"""Blob storage: atomic writes (temporary name + rename), checked keys, verified reads."""

import hashlib
import os

import pytest

from app.storage import BlobStore, checkpoint_key, exemplar_set_prefix


def test_put_read_verify_delete(tmp_path):
    store = BlobStore(tmp_path)
    key = checkpoint_key("set", "job", 25)
    sha = store.put(key, b"weights")
    assert sha == hashlib.sha256(b"weights").hexdigest()
    assert store.read_verified(key, sha) == b"weights"
    assert [p.name for p in store.path(key).parent.iterdir()] == ["0000025.pt"]  # no temporary left behind
    with pytest.raises(ValueError, match="corrupt"):
        store.read_verified(key, "0" * 64)
    store.delete_tree(exemplar_set_prefix("set"))
    assert not store.exists(key)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    store = BlobStore(tmp_path)
    store.put("a/b.bin", b"old")

    def crash(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.put("a/b.bin", b"new")
    assert store.read("a/b.bin") == b"old"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.bin"]


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../x", "a//b", "", "a/./b", "a\\b"])
def test_keys_stay_under_the_root(tmp_path, key):
    with pytest.raises(ValueError):
        BlobStore(tmp_path).path(key)
