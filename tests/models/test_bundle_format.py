"""Bundle and checkpoint files field by field: what each writer puts in the file (read back raw), what each reader
returns, every refusal by its message (a foreign file, a newer format, another bundle), the atomic write's
temporary file and mode, and every checkpoint format (1-6) written, read and refused."""

from __future__ import annotations

import decimal
import hashlib
import io
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models import backbones
from models.bundle import (
    POLICY_FORMAT_VERSION,
    PolicyMismatch,
    Reward,
    Start,
    atomic_write,
    bundle_from_bytes,
    checkpoint_from_bytes,
    head_from_bytes,
    head_refs,
    head_to_bytes,
    load_bundle,
    load_policy,
    new_bundle,
    policy_from_bytes,
    policy_to_bytes,
    save_bundle,
    save_policy,
)
from models.config import AgentConfig, HeadConfig, InputSpec, ModelConfig

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return bundle_from_bytes(BUNDLE.read_bytes(), source=str(BUNDLE))


def tiny(name: str = "tiny", seed: int = 0):
    cfg = ModelConfig(input=InputSpec(channels=1, size=32, exemplar_size=12),
                      head=HeadConfig(in_features=64 * 7 * 7, hidden=16, out_features=8, dropout=0.0),
                      agent=AgentConfig(conv_channels=2, hidden=4, embed_dim=8))
    return new_bundle(name, cfg, seed)


def raw(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- bundles ------------------------------------------------------------------------------------------------------


def test_a_bundle_file_holds_every_part_and_loads_back_as_it_was(tmp_path):
    b = tiny()
    b.provenance = {"seed": 0, "data": "cmnist"}
    b.training = {"decoder": {"w": torch.arange(6.0).view(2, 3)}}
    sha = save_bundle(tmp_path / "deep" / "er" / "b.pt", b)  # parent folders are made
    obj = raw((tmp_path / "deep" / "er" / "b.pt").read_bytes())
    assert set(obj) == {"format", "format_version", "name", "config", "embedder", "agent", "provenance", "training"}
    assert obj["format"] == "qloc-bundle" and obj["format_version"] == 1 and obj["name"] == "tiny"
    assert obj["config"] == b.config.to_dict() and obj["provenance"] == {"seed": 0, "data": "cmnist"}
    assert same(obj["training"]["decoder"], b.training["decoder"]) and same(obj["agent"], b.agent_state)

    loaded = load_bundle(tmp_path / "deep" / "er" / "b.pt")
    assert loaded.name == "tiny" and loaded.sha256 == sha and loaded.config.to_dict() == b.config.to_dict()
    assert same(loaded.embedder.state_dict(), b.embedder.state_dict()) and same(loaded.agent_state, b.agent_state)
    assert loaded.provenance == {"seed": 0, "data": "cmnist"}
    assert same(loaded.training["decoder"], b.training["decoder"])
    assert loaded.device == torch.device("cpu") and not loaded.embedder.training
    assert not any(p.requires_grad for p in loaded.embedder.parameters())
    assert loaded.refine is False

    plain = tiny()  # no training state, no provenance given: none written, an empty one read
    save_bundle(tmp_path / "plain.pt", plain)
    assert "training" not in raw((tmp_path / "plain.pt").read_bytes())
    back = load_bundle(tmp_path / "plain.pt")
    assert back.training == {} and back.provenance == {"seed": 0}


def test_older_bundle_layouts_still_load():
    b = tiny()
    old = {"format": "qloc-bundle", "format_version": 1, "name": "old", "config": b.config.to_dict(),
           "embedder": b.embedder.state_dict(), "agent": b.agent_state,
           "decoder": {"w": torch.ones(2)}}  # stage 1's decoder at the top level, no provenance
    loaded = bundle_from_bytes(saved_bytes(old))
    assert set(loaded.training) == {"decoder"} and torch.equal(loaded.training["decoder"]["w"], torch.ones(2))
    assert loaded.provenance == {}
    del old["format_version"]  # the first files had no version: read as 0
    assert bundle_from_bytes(saved_bytes(old)).name == "old"


def test_a_half_bundle_stores_floats_as_float16_and_loads_them_as_float32(tmp_path):
    b = tiny()
    b.embedder.register_buffer("steps", torch.tensor(5))  # an integer buffer stays as it is
    save_bundle(tmp_path / "half.pt", b, half=True)
    obj = raw((tmp_path / "half.pt").read_bytes())
    assert obj["embedder"]["steps"].dtype == torch.int64
    assert all(v.dtype == torch.float16 for k, v in obj["embedder"].items() if k != "steps")
    assert all(v.dtype == torch.float32 for v in obj["agent"].values())  # the agent is small: kept as it is


def test_loading_a_bundle_reads_no_pretrained_weights(monkeypatch):
    """The file holds every weight: the backbone is built without its pretrained file, which may not be there."""
    build = backbones.BACKBONES["mnist_conv"]
    asked = []

    def spy(cfg, pretrained):
        asked.append(pretrained)
        return build(cfg, pretrained)

    b = tiny()
    monkeypatch.setitem(backbones.BACKBONES, "mnist_conv", spy)
    bundle_from_bytes(saved_bytes({"format": "qloc-bundle", "format_version": 1, "name": "t",
                                   "config": b.config.to_dict(), "embedder": b.embedder.state_dict(),
                                   "agent": b.agent_state}))
    assert asked[-1] is False


def test_new_bundles_are_seeded_and_say_their_seed():
    a, b, c = tiny(seed=0), new_bundle("tiny", tiny().config), tiny(seed=1)
    assert same(a.embedder.state_dict(), b.embedder.state_dict()) and same(a.agent_state, b.agent_state)
    assert not same(a.agent_state, c.agent_state)
    assert b.provenance == {"seed": 0} and c.provenance == {"seed": 1} and not a.embedder.training


def test_a_bundle_moves_with_its_device_and_serves_another_head_frozen():
    b = tiny()
    assert b.to("cpu") is b and b.device == torch.device("cpu")
    head = {k: v + 1 for k, v in b.embedder.head.state_dict().items()}
    other = b.with_head(head, refine=True)
    assert other.refine and not b.refine and other.embedder.encoder is b.embedder.encoder
    assert same(other.embedder.head.state_dict(), head) and not same(b.embedder.head.state_dict(), head)
    assert not other.embedder.head.training and not any(p.requires_grad for p in other.embedder.head.parameters())
    assert same(b.new_agent().state_dict(), b.agent_state)
    mine = {k: v * 2 for k, v in b.agent_state.items()}
    assert same(b.new_agent(mine).state_dict(), mine)


# ---- reading files: refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "read", "newest"), [
    ("qloc-bundle", lambda d, **k: bundle_from_bytes(d, **k), 1),
    ("qloc-policy", lambda d, **k: policy_from_bytes(d, **k), POLICY_FORMAT_VERSION),
    ("qloc-head", lambda d, **k: head_from_bytes(d, **k), 1)])
def test_each_reader_refuses_a_foreign_file_and_a_newer_format_by_name(kind, read, newest):
    with pytest.raises(ValueError, match=f"^x.pt is not a readable {kind} file: "):
        read(b"junk", source="x.pt")
    with pytest.raises(ValueError, match=f"^x.pt is not a {kind} file$"):
        read(saved_bytes({"format": "something-else"}), source="x.pt")
    with pytest.raises(ValueError, match=f"^x.pt is not a {kind} file$"):
        read(saved_bytes([1, 2]), source="x.pt")
    with pytest.raises(ValueError, match=f"^x.pt has {kind} format {newest + 1}; this qloc reads <= {newest}$"):
        read(saved_bytes({"format": kind, "format_version": newest + 1}), source="x.pt")
    # a file that unpickles more than tensors and plain types is not read at all
    with pytest.raises(ValueError, match="not a readable"):
        read(saved_bytes({"format": kind, "format_version": 1, "x": decimal.Decimal(1)}), source="x.pt")


def test_readers_name_what_they_read_by_default_and_by_path(tmp_path, bundle):
    with pytest.raises(ValueError, match="^bundle is not a readable"):
        bundle_from_bytes(b"junk")
    with pytest.raises(ValueError, match="^policy is not a readable"):
        policy_from_bytes(b"junk")
    with pytest.raises(ValueError, match="^head is not a readable"):
        head_from_bytes(b"junk")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'junk.pt'))} is not a readable qloc-bundle"):
        load_bundle(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'junk.pt'))} is not a readable qloc-policy"):
        load_policy(tmp_path / "junk.pt")
    save_policy(tmp_path / "p.pt", bundle.agent_state, bundle_name="letters")
    where = re.escape(str(tmp_path / "p.pt"))
    with pytest.raises(PolicyMismatch, match=f"^{where} is a policy for bundle 'letters', not "):
        load_policy(tmp_path / "p.pt", bundle)
    with pytest.raises(PolicyMismatch, match="^policy is a policy for bundle 'letters'"):
        policy_from_bytes((tmp_path / "p.pt").read_bytes(), bundle)


def test_a_policy_of_a_replaced_bundle_file_is_refused_with_both_short_hashes(bundle):
    other = "f" * 64
    data = policy_to_bytes(bundle.agent_state, bundle_name=bundle.name, bundle_sha256=other)
    with pytest.raises(PolicyMismatch) as refused:
        checkpoint_from_bytes(data, bundle, source="ckpt")
    assert str(refused.value) == (
        f"ckpt is a policy for bundle {bundle.name!r} sha256 {'f' * 12}, but the bundle {bundle.name!r} loaded is "
        f"sha256 {bundle.sha256[:12]}: the bundle file was replaced since the policy was written")


def test_policy_files_record_what_they_were_written_for_and_default_their_meta(tmp_path, bundle):
    save_policy(tmp_path / "p.pt", bundle.agent_state, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                prototype_dim=bundle.prototype_dim, meta={"iteration": 3})
    obj = raw((tmp_path / "p.pt").read_bytes())
    assert obj["prototype_dim"] == bundle.prototype_dim and obj["bundle_sha256"] == bundle.sha256
    assert obj["format_version"] == 1 and obj["meta"] == {"iteration": 3}
    state, meta = load_policy(tmp_path / "p.pt", bundle)
    assert meta == {"iteration": 3} and same(state, bundle.agent_state)
    no_meta = saved_bytes({"format": "qloc-policy", "format_version": 1, "bundle": bundle.name,
                           "agent": bundle.agent_state})
    assert policy_from_bytes(no_meta, bundle)[1] == {} and checkpoint_from_bytes(no_meta, bundle)[1:] == ({}, None)
    assert checkpoint_from_bytes((tmp_path / "p.pt").read_bytes(), bundle)[1] == {"iteration": 3}
    with pytest.raises(ValueError, match="^policy is not a readable qloc-policy file"):
        checkpoint_from_bytes(b"junk")


# ---- atomic writes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_an_atomic_write_renames_a_temporary_file_beside_the_target_readable_as_the_umask_allows(
        tmp_path, monkeypatch, umask):
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((a, b)), real_replace(a, b))[1])
    old = os.umask(umask)
    try:
        sha = atomic_write(tmp_path / "a" / "b" / "file.bin", b"payload")
    finally:
        os.umask(old)
    target = tmp_path / "a" / "b" / "file.bin"
    assert target.read_bytes() == b"payload" and sha == hashlib.sha256(b"payload").hexdigest()
    assert (target.stat().st_mode & 0o777) == 0o644 & ~umask
    (tmp, dest), = renamed
    assert Path(dest) == target and Path(tmp).parent == target.parent
    assert Path(tmp).name.startswith(".file.bin.") and Path(tmp).name.endswith(".tmp")
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]  # nothing left beside it


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")

    def fail(a, b):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


# ---- checkpoints: formats 1-6 -------------------------------------------------------------------------------------


def test_head_refs_lists_the_heads_a_format_6_file_keeps_apart(tmp_path, bundle):
    head = bundle.embedder.head.state_dict()
    proto = torch.zeros(bundle.prototype_dim)
    refs = iter([{"id": "r", "n": 1}, {"id": "s", "n": 2}])

    def write(name, **kw):
        path = tmp_path / name
        path.write_bytes(policy_to_bytes(bundle.agent_state, bundle_name=bundle.name, **kw))
        return path

    both = write("6.pt", reward=Reward(head, proto, start=Start(proto, head=head)), store_head=lambda h: next(refs))
    assert head_refs(both) == [{"id": "r", "n": "1"}, {"id": "s", "n": "2"}]  # stored as text
    only = write("6r.pt", reward=Reward(head, proto, start=Start(proto)), store_head=lambda h: {"id": "t"})
    assert head_refs(only) == [{"id": "t"}]  # the start serves the bundle's head: nothing stored for it
    assert head_refs(write("5.pt", reward=Reward(head, proto, start=Start(proto, consensus=())))) == []
    assert head_refs(write("1.pt")) == []
    (tmp_path / "evil.pt").write_bytes(saved_bytes({"reward": decimal.Decimal(1)}))
    with pytest.raises(pickle.UnpicklingError):  # read as tensors and plain types only
        head_refs(tmp_path / "evil.pt")


def test_a_head_file_round_trips_on_the_cpu():
    head = {"w": torch.arange(4.0), "b": torch.ones(2)}
    data = head_to_bytes(head)
    obj = raw(data)
    assert set(obj) == {"format", "format_version", "head"} and obj["format"] == "qloc-head"
    assert obj["format_version"] == 1 and same(obj["head"], head) and same(head_from_bytes(data), head)


def test_a_checkpoints_reward_is_written_on_the_cpu_as_float32_and_apart_from_its_callers_tensors(bundle):
    head = {k: v.clone() for k, v in bundle.embedder.head.state_dict().items()}
    proto = torch.arange(bundle.prototype_dim, dtype=torch.float64)
    agent = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in bundle.agent_state.items()}
    data = policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto, start=Start(
        proto.flip(0), agent=agent, consensus=(agent,))))
    obj = raw(data)
    assert obj["reward"]["prototype"].dtype == torch.float32 and obj["reward"]["start"]["prototype"].dtype == (
        torch.float32)
    assert set(obj) == {"format", "format_version", "bundle", "agent", "reward", "meta"} and obj["meta"] == {}
    assert set(obj["reward"]) == {"prototype", "head", "start"}
    assert set(obj["reward"]["start"]) == {"prototype", "agent", "consensus"}
    assert not any(v.requires_grad for v in obj["agent"].values())


def test_a_checkpoint_carries_its_repaired_head_and_prototype_and_old_ones_still_load(bundle):
    agent = bundle.agent_state
    old = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                          prototype_dim=bundle.prototype_dim)
    assert torch.load(io.BytesIO(old), weights_only=True)["format_version"] == 1  # unchanged without a reward
    state, meta, reward = checkpoint_from_bytes(old, bundle)
    assert reward is None and meta == {} and all(torch.equal(v, agent[k]) for k, v in state.items())

    head = {k: v + 1 for k, v in bundle.embedder.head.state_dict().items()}
    proto = torch.arange(bundle.prototype_dim, dtype=torch.float32)
    new = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                          prototype_dim=bundle.prototype_dim, reward=Reward(head, proto))
    state, _, reward = checkpoint_from_bytes(new, bundle)
    assert torch.equal(reward.prototype, proto) and all(torch.equal(v, head[k]) for k, v in reward.head.items())
    assert policy_from_bytes(new, bundle)[0].keys() == agent.keys()  # the agent-only reader still works

    served = bundle.with_head(reward.head)
    assert served.embedder.encoder is bundle.embedder.encoder  # shared, not copied
    assert all(torch.equal(v, head[k]) for k, v in served.embedder.head.state_dict().items())
    assert not torch.equal(next(iter(bundle.embedder.head.state_dict().values())), next(iter(head.values())))

    obj = torch.load(io.BytesIO(new), weights_only=True)
    assert obj["format_version"] == 2 and "refine" not in obj["reward"]  # a format-2 reward serves unrefined
    assert reward.refine is False and served.refine is False and bundle.refine is False

    refined = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                              prototype_dim=bundle.prototype_dim, reward=Reward(head, proto, refine=True))
    obj3 = torch.load(io.BytesIO(refined), weights_only=True)
    assert obj3["format_version"] == 3 and obj3["reward"]["refine"] is True
    _, _, reward3 = checkpoint_from_bytes(refined, bundle)
    assert reward3.refine is True and bundle.with_head(reward3.head, reward3.refine).refine is True

    # format 4: the start it is paired with (the bundle's agent and head: only the prototype is written)
    start = Start(proto.flip(0))
    paired = policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                             prototype_dim=bundle.prototype_dim, reward=Reward(head, proto, start=start))
    obj4 = torch.load(io.BytesIO(paired), weights_only=True)
    assert obj4["format_version"] == 4 and set(obj4["reward"]["start"]) == {"prototype"}
    st = checkpoint_from_bytes(paired, bundle)[2].start
    assert torch.equal(st.prototype, start.prototype) and st.agent is None and st.head is None and not st.refine
    own = Start(proto, agent={k: v + 2 for k, v in agent.items()}, head=head, refine=True)
    st = checkpoint_from_bytes(policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto,
                                                                                          start=own)), bundle)[2].start
    assert st.refine and all(torch.equal(v, own.agent[k]) for k, v in st.agent.items())
    assert all(torch.equal(v, head[k]) for k, v in st.head.items())
    short = Reward(head, proto, start=Start(proto[:-1]))  # a start of another prototype dimension is refused
    with pytest.raises(PolicyMismatch, match="dimension"):
        checkpoint_from_bytes(policy_to_bytes(agent, bundle_name=bundle.name, reward=short), bundle)

    # format 5: the start votes with the job's earlier checkpoints (the consensus rule), an empty tuple included
    earlier = ({k: v + 3 for k, v in agent.items()}, {k: v + 4 for k, v in agent.items()})
    for voters in ((), earlier):
        voted = policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto, start=replace(
            start, consensus=voters)))
        obj5 = torch.load(io.BytesIO(voted), weights_only=True)
        assert obj5["format_version"] == 5 and len(obj5["reward"]["start"]["consensus"]) == len(voters)
        st = checkpoint_from_bytes(voted, bundle)[2].start
        assert st.consensus is not None and len(st.consensus) == len(voters)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(st.consensus, voters, strict=True) for k in agent)
    assert checkpoint_from_bytes(paired, bundle)[2].start.consensus is None  # format 4: the two heads' agreement

    # format 6: the heads (the reward's, the start's) stored apart, the file holding what store_head returned
    heads: dict[str, bytes] = {}

    def store(h):
        data = head_to_bytes(h)
        heads[str(len(heads))] = data
        return {"id": str(len(heads) - 1)}

    def load(ref):
        return head_from_bytes(heads[ref["id"]])

    apart = policy_to_bytes(agent, bundle_name=bundle.name, reward=Reward(head, proto, refine=True, start=own),
                            store_head=store)
    obj6 = torch.load(io.BytesIO(apart), weights_only=True)
    assert obj6["format_version"] == 6 and obj6["reward"]["head_ref"] == {"id": "0"} and "head" not in obj6["reward"]
    assert obj6["reward"]["start"]["head_ref"] == {"id": "1"} and len(heads) == 2
    assert len(apart) < len(refined) / 2  # the head was most of the file
    _, _, reward6 = checkpoint_from_bytes(apart, bundle, load_head=load)
    assert reward6.refine and all(torch.equal(v, head[k]) for k, v in reward6.head.items())
    assert all(torch.equal(v, head[k]) for k, v in reward6.start.head.items())
    assert policy_from_bytes(apart, bundle)[0].keys() == agent.keys()  # the agent alone needs no head
    with pytest.raises(ValueError, match="keeps its reward's head apart"):
        checkpoint_from_bytes(apart, bundle)  # no head reader

    obj3["format_version"] = 7
    buf = io.BytesIO()
    torch.save(obj3, buf)
    with pytest.raises(ValueError, match="format 7"):
        checkpoint_from_bytes(buf.getvalue(), bundle)
