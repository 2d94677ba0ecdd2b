"""Blob storage: atomic writes (temporary name + rename), checked keys, verified reads."""

import hashlib
import os

import pytest

from app.storage import (
    BlobStore,
    checkpoint_key,
    exemplar_key,
    exemplar_set_prefix,
    head_key,
    heads_prefix,
    job_image_key,
    job_prefix,
    pool_image_key,
)


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


def test_every_key_by_value_each_under_its_sets_prefix():
    """Where each blob lives: a key function mixing up a set or a job would put one job's checkpoint over another's,
    or leave a blob behind when its set is deleted (``delete_tree`` of the set's prefix)."""
    assert exemplar_set_prefix("S") == "exemplar-sets/S"
    assert exemplar_key("S", 3, ".png") == "exemplar-sets/S/exemplars/003.png"
    assert job_prefix("S", "J") == "exemplar-sets/S/jobs/J"
    assert job_image_key("S", "J", 12, ".jpg") == "exemplar-sets/S/jobs/J/images/012.jpg"
    assert checkpoint_key("S", "J", 25) == "exemplar-sets/S/jobs/J/checkpoints/0000025.pt"
    assert heads_prefix("S") == "exemplar-sets/S/heads"
    assert head_key("S", "ab12") == "exemplar-sets/S/heads/ab12.pt"
    assert pool_image_key("S", "I", ".webp") == "exemplar-sets/S/pool/I.webp"
    keys = [exemplar_key("S", 0, ".png"), job_image_key("S", "J", 0, ".png"), checkpoint_key("S", "J", 1),
            head_key("S", "h"), pool_image_key("S", "I", ".png")]
    assert all(k.startswith(exemplar_set_prefix("S") + "/") for k in keys)
    assert checkpoint_key("S", "J", 1) != checkpoint_key("S", "K", 1) != checkpoint_key("T", "K", 1)
    assert job_image_key("S", "J", 0, ".png") != job_image_key("S", "K", 0, ".png")


def test_deleting_what_is_not_there_is_no_error_and_a_set_goes_whole(tmp_path):
    store = BlobStore(tmp_path)
    store.delete("exemplar-sets/S/none.png")
    store.delete_tree("exemplar-sets/none")
    keys = [exemplar_key("S", 0, ".png"), checkpoint_key("S", "J", 1), head_key("S", "h"),
            pool_image_key("S", "I", ".png")]
    for k in keys:
        store.put(k, b"x")
    other = store.put(exemplar_key("T", 0, ".png"), b"y")
    store.delete(keys[0])
    assert not store.exists(keys[0]) and store.exists(keys[1])
    store.delete_tree(exemplar_set_prefix("S"))
    assert not any(store.exists(k) for k in keys) and not store.path(exemplar_set_prefix("S")).exists()
    assert store.read_verified(exemplar_key("T", 0, ".png"), other) == b"y"


def test_a_refused_key_is_named():
    with pytest.raises(ValueError, match=r"^invalid blob key '\.\./x'$"):
        BlobStore("/tmp").path("../x")
