"""``app.inference`` by value: the bundle registry's names, loads and reloads (what each ``get`` reads of the file,
what a load hands its ``on_load`` and its localizer), its policy cache, ``bundle_for_set``'s refusals, and the
checkpoint and head blobs read back with the names their errors give. Real bundle files in the real format, a real
``BlobStore`` on disk; the API's side of the same (409s, sets recorded with their bundle) is
``test_app_bundle_identity.py``."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re

import numpy as np
import pytest
import torch
from service_fixtures import SWAPPED, bundle_versions, install_bundle

from app.inference import (
    BundleMismatch,
    BundleRegistry,
    BundleReplaced,
    UnknownBundle,
    bundle_for_set,
    prototype_from_bytes,
    prototype_to_bytes,
    read_checkpoint,
    read_head,
    read_served_checkpoint,
    short_sha,
    store_head,
)
from app.storage import BlobStore
from app.tables import ExemplarSet
from models.bundle import PolicyMismatch, Reward, head_to_bytes, policy_to_bytes
from models.inference import resolve_device

NAME = SWAPPED


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """The three bundle files, made once for the module (the tests copy them; none writes them)."""
    return bundle_versions(tmp_path_factory.mktemp("versions"), NAME)


@pytest.fixture
def installed(tmp_path, versions):
    d = tmp_path / "installed"
    install_bundle(d, versions["v1"][0], NAME)
    return d


class Opens:
    """Counts the bundle files opened (``Path.open`` on a ``.pt``), calling through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[pathlib.Path] = []
        real = pathlib.Path.open

        def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if path.suffix == ".pt":
                self.paths.append(path)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", counted)


def test_short_sha_is_the_first_twelve_hex_digits():
    assert short_sha("0123456789abcdef" * 4) == "0123456789ab"


def test_the_registry_defaults(tmp_path):
    reg = BundleRegistry(tmp_path)
    assert reg.device == resolve_device("auto") and reg.fast_episode is True and reg.on_load is None
    assert reg.names() == [] and reg.loaded() == []


def test_names_are_the_directorys_bundle_files_sorted_and_a_missing_directory_has_none(tmp_path, versions):
    d = tmp_path / "b"
    for name in ("zeta", "alpha", "m_1.v-2"):
        install_bundle(d, versions["v1"][0], name)
    (d / "notes.txt").write_text("not a bundle")
    (d / "upper.PT").write_bytes(b"x")
    (d / "-dash.pt").write_bytes(b"x")  # not a bundle name (a leading dash)
    assert BundleRegistry(d, "cpu").names() == ["alpha", "m_1.v-2", "zeta"]
    assert BundleRegistry(tmp_path / "missing", "cpu").names() == []
    assert BundleRegistry(d / "notes.txt", "cpu").names() == []  # not a directory


def test_an_unknown_or_invalid_name_is_refused_by_name(installed, versions):
    reg = BundleRegistry(installed, "cpu")
    with pytest.raises(UnknownBundle, match=re.escape(f"unknown bundle 'other'; available: ['{NAME}']")):
        reg.get("other")
    with pytest.raises(UnknownBundle, match=re.escape("invalid bundle name '../swapped'")):
        reg.get(f"../{NAME}")
    assert reg.path(NAME) == installed / f"{NAME}.pt"
    assert not reg.is_loaded(NAME) and not reg.is_loaded("other")


def test_a_load_hands_its_bundle_to_on_load_once_and_an_unchanged_file_is_not_opened_again(installed, versions,
                                                                                            monkeypatch):
    loads = []
    reg = BundleRegistry(installed, "cpu", on_load=loads.append, fast_episode=False)
    opens = Opens(monkeypatch)
    first = reg.get(NAME)
    path = installed / f"{NAME}.pt"
    assert (first.name, first.path, first.sha256) == (NAME, path, versions["v1"][1])
    st = path.stat()
    assert first.stat == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert first.localizer.bundle is first.bundle and first.localizer.fast_episode is False
    assert first.localizer.device == torch.device("cpu")
    assert loads == [first] and opens.paths == [path]
    assert reg.is_loaded(NAME) and reg.loaded() == [first]
    for _ in range(3):
        assert reg.get(NAME) is first
    assert loads == [first] and opens.paths == [path]  # one stat per get, no read

    fast = BundleRegistry(installed, "cpu").get(NAME)
    assert fast.localizer.fast_episode is True


def test_the_same_bytes_under_another_inode_are_kept_and_the_new_file_is_known_after(installed, versions, monkeypatch):
    loads = []
    reg = BundleRegistry(installed, "cpu", on_load=loads.append)
    first = reg.get(NAME)
    install_bundle(installed, versions["v1"][0], NAME)  # copied over: another inode, the same bytes
    opens = Opens(monkeypatch)
    path = installed / f"{NAME}.pt"
    again = reg.get(NAME)
    st = path.stat()
    assert again.bundle is first.bundle and again.localizer is first.localizer and again.sha256 == first.sha256
    assert again.path == path and again.stat == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    assert again.stat != first.stat and reg.loaded() == [again]
    assert loads == [first]  # not a new load
    assert reg.get(NAME) is again and opens.paths == [path]  # known now: not opened again


def test_a_replaced_file_is_loaded_again_and_handed_to_on_load(installed, versions):
    loads = []
    reg = BundleRegistry(installed, "cpu", on_load=loads.append)
    first = reg.get(NAME)
    install_bundle(installed, versions["v2"][0], NAME)
    second = reg.get(NAME, expect_sha256=versions["v2"][1])
    assert second.sha256 == versions["v2"][1] and second.bundle is not first.bundle
    assert second.localizer is not first.localizer and second.localizer.bundle is second.bundle
    assert loads == [first, second] and reg.loaded() == [second]
    with pytest.raises(BundleReplaced) as refused:
        reg.get(NAME, expect_sha256=versions["v1"][1])
    assert str(refused.value) == (
        f"bundle {NAME!r} was replaced since this exemplar set was made (set made with sha256 "
        f"{versions['v1'][1][:12]}, installed now: sha256 {versions['v2'][1][:12]}); the set's prototype belongs to "
        "the old bundle. Re-create the exemplar set from its crops to use the new bundle (or reinstall the old "
        "bundle file to use this set).")


def test_an_unreadable_file_names_its_path_and_keeps_the_copy_loaded_before_unserved(installed, versions):
    reg = BundleRegistry(installed, "cpu")
    first = reg.get(NAME)
    path = installed / f"{NAME}.pt"
    path.write_bytes(b"half a file")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        reg.get(NAME)
    assert reg.loaded() == [first]
    install_bundle(installed, versions["v1"][0], NAME)
    assert reg.get(NAME).bundle is first.bundle


def test_each_policy_key_is_cached_apart_and_the_oldest_of_32_dropped(tmp_path):
    reg = BundleRegistry(tmp_path, "cpu")
    loads = []

    def loader(i):  # type: ignore[no-untyped-def]
        return lambda: loads.append(i) or {"w": torch.full((1,), float(i))}

    a = reg.cached_policy(("b", 0), loader(0))
    assert reg.cached_policy(("b", 0), loader(99)) is a and loads == [0]
    assert float(reg.cached_policy(("b", 1), loader(1))["w"]) == 1.0  # another key: its own policy
    for i in range(2, 33):
        reg.cached_policy(("b", i), loader(i))
    assert loads == list(range(33))
    reg.cached_policy(("b", 1), loader(-1))  # 33 keys past: still kept (0 was the oldest, 1 used since)
    assert loads == list(range(33))
    reg.cached_policy(("b", 0), loader(100))
    assert loads[-1] == 100


def exemplar_set(bundle: str, sha256: str | None, dim: int) -> ExemplarSet:
    return ExemplarSet(bundle=bundle, bundle_sha256=sha256, prototype_dim=dim)


def test_a_set_is_served_by_the_file_that_made_it_and_refused_by_another(installed, versions):
    reg = BundleRegistry(installed, "cpu")
    v1 = versions["v1"][1]
    assert bundle_for_set(reg, exemplar_set(NAME, v1, 512)).sha256 == v1
    assert bundle_for_set(reg, exemplar_set(NAME, None, 512)).sha256 == v1  # made before sets recorded it
    with pytest.raises(BundleReplaced):
        bundle_for_set(reg, exemplar_set(NAME, versions["v2"][1], 512))
    with pytest.raises(UnknownBundle):
        bundle_for_set(reg, exemplar_set("other", None, 512))
    install_bundle(installed, versions["narrow"][0], NAME)
    with pytest.raises(BundleMismatch) as refused:
        bundle_for_set(reg, exemplar_set(NAME, None, 512))
    assert not isinstance(refused.value, BundleReplaced)
    assert str(refused.value) == (
        f"bundle {NAME!r} (sha256 {versions['narrow'][1][:12]}) makes prototypes of dimension 256, but this exemplar "
        "set's prototype has dimension 512: it was made by another bundle file of that name. Re-create the exemplar "
        "set from its crops.")


def test_prototypes_travel_as_float32_little_endian():
    p = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float64, requires_grad=True)
    data = prototype_to_bytes(p)
    assert data == np.array([1.5, -2.25, 3.0], dtype="<f4").tobytes()
    back = prototype_from_bytes(data)
    assert back.dtype == torch.float32 and back.tolist() == [1.5, -2.25, 3.0]
    back += 1  # a copy of its own: writable
    assert prototype_from_bytes(data).tolist() == [1.5, -2.25, 3.0]


def test_checkpoints_are_read_checked_and_their_errors_name_the_blob_or_the_given_source(tmp_path, installed,
                                                                                          versions):
    reg = BundleRegistry(installed, "cpu")
    v1 = reg.get(NAME).bundle
    store = BlobStore(tmp_path / "blobs")
    mine = policy_to_bytes(v1.agent_state, bundle_name=NAME, meta={"iteration": 3}, bundle_sha256=v1.sha256)
    store.put("sets/x/ck-3.pt", mine)
    sha = hashlib.sha256(mine).hexdigest()
    agent, meta = read_checkpoint(store, blob="sets/x/ck-3.pt", sha256=sha, bundle=v1)
    assert meta == {"iteration": 3} and agent.keys() == v1.agent_state.keys()
    served, reward = read_served_checkpoint(store, blob="sets/x/ck-3.pt", sha256=sha, bundle=v1)
    assert reward is None and all(torch.equal(served[k], v1.agent_state[k]) for k in served)

    theirs = policy_to_bytes(v1.agent_state, bundle_name="digits")
    store.put("sets/x/other.pt", theirs)
    other = hashlib.sha256(theirs).hexdigest()
    for read in (read_checkpoint, read_served_checkpoint):
        with pytest.raises(PolicyMismatch, match="^checkpoint sets/x/other.pt is a policy for bundle 'digits'"):
            read(store, blob="sets/x/other.pt", sha256=other, bundle=v1)
        with pytest.raises(PolicyMismatch, match="^job 7's checkpoint is a policy for bundle 'digits'"):
            read(store, blob="sets/x/other.pt", sha256=other, bundle=v1, source="job 7's checkpoint")
        with pytest.raises(ValueError, match="^blob sets/x/other.pt is corrupt"):  # the digest of the bytes read
            read(store, blob="sets/x/other.pt", sha256=sha, bundle=v1)


def test_heads_are_stored_once_under_their_digest_and_read_back_checked(tmp_path, installed):
    v1 = BundleRegistry(installed, "cpu").get(NAME).bundle
    store = BlobStore(tmp_path / "blobs")
    head = {k: v.clone() for k, v in v1.embedder.head.state_dict().items()}
    digests = []

    def key_of(sha256: str) -> str:
        digests.append(sha256)
        return f"sets/x/heads/{sha256}.pt"

    ref = store_head(store, key_of, head)
    sha = hashlib.sha256(head_to_bytes(head)).hexdigest()
    assert ref == {"key": f"sets/x/heads/{sha}.pt", "sha256": sha} and digests == [sha]
    written = os.stat(store.path(ref["key"])).st_mtime_ns
    os.utime(store.path(ref["key"]), ns=(1, 1))
    assert store_head(store, key_of, head) == ref and os.stat(store.path(ref["key"])).st_mtime_ns == 1  # not again
    assert written != 1
    back = read_head(store, ref)
    assert back.keys() == head.keys() and all(torch.equal(back[k], head[k]) for k in head)

    # a checkpoint keeping its reward's head apart is served with it
    proto = torch.randn(v1.prototype_dim)
    data = policy_to_bytes(v1.agent_state, bundle_name=NAME, bundle_sha256=v1.sha256,
                           reward=Reward(head, proto), store_head=lambda h: store_head(store, key_of, h))
    store.put("sets/x/ck.pt", data)
    _, reward = read_served_checkpoint(store, blob="sets/x/ck.pt", sha256=hashlib.sha256(data).hexdigest(), bundle=v1)
    assert reward is not None and torch.equal(reward.prototype, proto)
    assert all(torch.equal(reward.head[k], head[k]) for k in head)

    store.put("sets/x/heads/broken.pt", b"not a head")
    broken = {"key": "sets/x/heads/broken.pt", "sha256": hashlib.sha256(b"not a head").hexdigest()}
    with pytest.raises(ValueError, match="^head sets/x/heads/broken.pt"):
        read_head(store, broken)
