"""Bundles known by their content: a loaded bundle's sha256 is its file's, and a policy names the bundle file
(sha256) and prototype dimension it was made for; reading it with another is refused, old files still load."""

import hashlib
import io

import pytest
import torch

from models.bundle import (
    FORMAT_VERSION,
    PolicyMismatch,
    bundle_from_bytes,
    load_bundle,
    load_policy,
    new_bundle,
    policy_from_bytes,
    policy_to_bytes,
    save_bundle,
    save_policy,
)
from models.presets import mnist_config


def saved(tmp_path, file, name="digits", seed=0, config=None):
    """(the bundle loaded back from its file, the file's sha256)."""
    path = tmp_path / file
    sha = save_bundle(path, new_bundle(name, config or mnist_config(), seed=seed))
    return load_bundle(path), sha


def test_a_loaded_bundle_is_known_by_its_files_sha256(tmp_path):
    bundle, sha = saved(tmp_path, "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    assert bundle.sha256 == sha == hashlib.sha256(data).hexdigest()
    assert bundle_from_bytes(data).sha256 == sha
    assert bundle.prototype_dim == bundle.config.head.out_features == 512
    other, other_sha = saved(tmp_path, "b.pt", seed=1)  # same name, other weights: another identity
    assert other.name == bundle.name and other_sha != sha
    assert new_bundle("digits", mnist_config()).sha256 is None  # made in memory: no file, no hash
    with pytest.raises(ValueError, match="not a readable qloc-bundle"):
        bundle_from_bytes(b"not a bundle", source="junk.pt")


def test_a_policy_of_another_bundle_file_with_the_same_name_is_refused(tmp_path):
    first, first_sha = saved(tmp_path, "a.pt", seed=0)
    second, second_sha = saved(tmp_path, "b.pt", seed=1)
    state = first.new_agent().state_dict()
    data = policy_to_bytes(state, bundle_name="digits", meta={"iteration": 2}, bundle_sha256=first.sha256,
                           prototype_dim=first.prototype_dim)
    raw = torch.load(io.BytesIO(data), weights_only=True)
    assert raw["bundle_sha256"] == first_sha and raw["prototype_dim"] == 512

    got, meta = policy_from_bytes(data, first)
    assert meta == {"iteration": 2} and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(PolicyMismatch) as refused:
        policy_from_bytes(data, second, source="checkpoint x")
    msg = str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert "checkpoint x" in msg and "replaced" in msg and first_sha[:12] in msg and second_sha[:12] in msg
    # the same through a file
    save_policy(tmp_path / "p.pt", state, bundle_name="digits", bundle_sha256=first_sha, prototype_dim=512)
    assert load_policy(tmp_path / "p.pt", first)[1] == {}
    with pytest.raises(PolicyMismatch, match=second_sha[:12]):
        load_policy(tmp_path / "p.pt", second)
    # another bundle name is refused as before
    with pytest.raises(PolicyMismatch, match="'digits'"):
        policy_from_bytes(data, saved(tmp_path, "c.pt", name="letters")[0])
    # a bundle made in memory has no file to compare: name and dimension still are
    assert policy_from_bytes(data, new_bundle("digits", mnist_config(), seed=5))[1] == {"iteration": 2}


def test_a_policy_for_prototypes_of_another_dimension_is_refused(tmp_path):
    narrow_cfg = mnist_config()
    narrow_cfg.head.out_features = narrow_cfg.agent.embed_dim = 256
    narrow, _ = saved(tmp_path, "narrow.pt", config=narrow_cfg)
    assert narrow.prototype_dim == 256
    state = narrow.new_agent().state_dict()
    data = policy_to_bytes(state, bundle_name="digits", prototype_dim=512)  # no sha256: only the dimension
    with pytest.raises(PolicyMismatch) as refused:
        policy_from_bytes(data, narrow)
    assert "512" in str(refused.value) and "256" in str(refused.value)
    assert policy_from_bytes(policy_to_bytes(state, bundle_name="digits", prototype_dim=256), narrow)[1] == {}


def test_old_policy_files_without_the_new_fields_still_load(tmp_path):
    bundle, _ = saved(tmp_path, "a.pt")
    state = bundle.new_agent().state_dict()
    old = {"format": "qloc-policy", "format_version": FORMAT_VERSION, "bundle": "digits", "agent": state,
           "meta": {"iteration": 7}}  # what policy_to_bytes wrote before bundle_sha256 / prototype_dim
    buf = io.BytesIO()
    torch.save(old, buf)
    (tmp_path / "old.pt").write_bytes(buf.getvalue())
    got, meta = load_policy(tmp_path / "old.pt", bundle)
    assert meta == {"iteration": 7} and all(torch.equal(got[k], state[k]) for k in state)
    assert policy_from_bytes(buf.getvalue(), saved(tmp_path, "b.pt", seed=1)[0])[1] == {"iteration": 7}
    # and a writer that does not know them writes none
    assert set(torch.load(io.BytesIO(policy_to_bytes(state, bundle_name="digits")), weights_only=True)) == {
        "format", "format_version", "bundle", "agent", "meta"}
