"""The model bundle (one file, plain types, ``torch.load(weights_only=True)``) and agent checkpoints.

Bundle: ``{"format": "qloc-bundle", "format_version", "name", "config", "embedder", "agent",
"training"? (stage 1's decoder), "provenance"}``. Policy checkpoint: ``{"format": "qloc-policy",
"format_version",
"bundle", "bundle_sha256"?, "prototype_dim"?, "agent", "reward"?, "meta"}`` -- the agent, plus the name of
the bundle it belongs to and, when the writer knew them, the sha256 of that bundle's file and the
dimension of its prototypes (files written before these two existed lack them, and still load).
Format 2 adds ``"reward"``: ``{"head": state dict, "prototype": [D]}`` when the policy was adapted on a
repaired reward (``models.repair``): the projection head it learned and the exemplars' prototype under
that head, which serve the checkpoint in place of the bundle's head and the set's prototype. Format-1
files (the agent only) load as before, with no reward of their own. Format 3 adds ``"refine": true`` to the
reward: the checkpoint's answers are refined on its head (``models.refine``), as its job's guard scored them;
a format-2 reward is served without refinement, as it was written. Format 4 adds ``"start"`` to the reward:
``{"prototype": [D], "agent"?, "head"?, "refine"?}``, the policy its job started from as that policy was served
(no ``agent``: the bundle's own; no ``head``: the bundle's head): the checkpoint is served *paired* with it, each
image keeping the checkpoint's answer only where both heads prefer it (``models.companion.Companion.agree``).
Format 5 adds ``"consensus"`` to the start: the agents of the job's checkpoints before this one (oldest first), and
the checkpoint is served by the *consensus* of its own answer, the start's and theirs instead: each image's answer
is the one that overlaps the others most (``models.companion.Companion.members``).
Format 6 keeps the heads apart: where the writer stores them (``store_head``), the reward's and the start's
``"head"`` become ``"head_ref"`` (what ``store_head`` returned: a head file, ``head_to_bytes``, written once and
shared by the checkpoints of a job, where it was 84-86 % of each file), resolved on reading by ``load_head``.
Both are written to a temporary name and renamed, so a crash never leaves half a file.

A bundle is known by its content: ``load_bundle`` / ``bundle_from_bytes`` hash the very bytes they
decode (``Bundle.sha256``), and reading a policy with its bundle refuses one written for another
bundle of the same name (another file) or for prototypes of another dimension (``PolicyMismatch``).
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.config import ModelConfig
from models.core.seeding import seeded
from models.nets.agent import Agent
from models.nets.embedding import ProjectionHead, RoIEmbedder

FORMAT_VERSION = 1
POLICY_FORMAT_VERSION = 6
"""Policy checkpoints: 6 holds references to its heads, stored apart (any of 2-5 otherwise); 5 carries a repaired
reward, its start and the job's earlier checkpoints, served by their consensus; 4 a repaired reward and the start it
is served paired with; 3 a repaired reward whose answers are refined; 2 a repaired reward (head + prototype); 1 is
the agent only. Each file is written with the lowest version that holds it."""
HEAD_FORMAT_VERSION = 1
"""A projection head's state stored apart (``head_to_bytes``), for format-6 checkpoints."""

HeadRef = dict[str, str]
"""Where a head stored apart is (what ``store_head`` returns and ``load_head`` reads: opaque to this module)."""


@dataclass
class Bundle:
    """A loaded bundle: the frozen embedder, the base policy and where they came from."""

    name: str
    config: ModelConfig
    embedder: RoIEmbedder
    agent_state: dict[str, Tensor]
    provenance: dict[str, Any] = field(default_factory=dict)
    training: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    """State dicts of modules only training uses (stage 1's ``decoder``), kept so training can go on;
    serving never reads them."""
    sha256: str | None = None
    """Of the file it was loaded from (``None``: made in memory). It names that file's content, not
    what the object holds after a caller changes its weights."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the embedder's weights are; ``to`` is the one way to move them, and it updates this."""

    refine: bool = False
    """Whether answers are refined by a local search on this bundle's embedding (``models.refine``): set on a copy
    whose head was repaired on the client's images and kept because it orders their boxes well (``models.repair``),
    never by a bundle file."""

    def to(self, device: str | torch.device) -> Bundle:
        """Move the embedder to ``device`` (in place) -> this bundle."""
        self.device = torch.device(device)
        self.embedder.to(self.device)
        return self

    @property
    def prototype_dim(self) -> int:
        """Dimension of the embeddings the bundle makes, hence of an exemplar set's prototype."""
        return int(self.config.head.out_features)

    def with_head(self, head: dict[str, Tensor], refine: bool = False) -> Bundle:
        """This bundle with another projection head (a checkpoint's repaired reward), its answers refined on it
        when ``refine``: the encoder is shared, not copied, so serving a repaired checkpoint costs one head. The
        copy keeps no file identity of its own beyond this bundle's (``sha256``: checkpoints of this bundle still
        check against it)."""
        emb = copy.copy(self.embedder)
        emb._modules = dict(self.embedder._modules)  # its own module table: the new head is not the original's
        new_head = ProjectionHead(self.config.head)
        new_head.load_state_dict(head)
        emb.head = new_head.to(self.device).eval().requires_grad_(False)
        return replace(self, embedder=emb, refine=refine)

    def new_agent(self, state: dict[str, Tensor] | None = None) -> Agent:
        """An ``Agent`` on the embedder's device, loaded with ``state`` (default: the base policy)."""
        agent = Agent(self.config.agent).to(self.device)
        agent.load_state_dict(state if state is not None else self.agent_state)
        return agent


def new_bundle(name: str, config: ModelConfig, seed: int = 0) -> Bundle:
    """A freshly initialized bundle (random weights unless the backbone loads pretrained ones)."""
    with seeded(seed):
        embedder = RoIEmbedder(config)
        agent = Agent(config.agent)
    return Bundle(name, config, embedder.eval(), _cpu(agent.state_dict()), {"seed": seed})


def atomic_write(path: str | os.PathLike, payload: bytes) -> str:
    """Write ``payload`` to ``path`` via a temporary file + rename; -> sha256 hex of the bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)  # mkstemp makes 0600; a bundle is meant to be read by others
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return hashlib.sha256(payload).hexdigest()


def _to_bytes(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _cpu(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def save_bundle(path: str | os.PathLike, bundle: Bundle, half: bool = False) -> str:
    """Save ``bundle`` to ``path`` atomically -> sha256 hex of the file.

    ``half`` stores the embedder's floating-point weights as float16 (half the file; they are cast
    back to float32 on load) -- for large photo heads.
    """
    embedder = _cpu(bundle.embedder.state_dict())
    if half:
        embedder = {k: v.half() if v.is_floating_point() else v for k, v in embedder.items()}
    obj = {
        "format": "qloc-bundle", "format_version": FORMAT_VERSION, "name": bundle.name,
        "config": bundle.config.to_dict(), "embedder": embedder,
        "agent": _cpu(bundle.agent_state), "provenance": bundle.provenance,
    }
    if bundle.training:
        obj["training"] = {k: _cpu(v) for k, v in bundle.training.items()}
    return atomic_write(path, _to_bytes(obj))


def _decode(data: bytes, kind: str, source: str) -> dict:
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or foreign file
        raise ValueError(f"{source} is not a readable {kind} file: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != kind:
        raise ValueError(f"{source} is not a {kind} file")
    newest = {"qloc-policy": POLICY_FORMAT_VERSION, "qloc-head": HEAD_FORMAT_VERSION}.get(kind, FORMAT_VERSION)
    if obj.get("format_version", 0) > newest:
        raise ValueError(f"{source} has {kind} format {obj['format_version']}; this qloc reads <= {newest}")
    return obj


def load_bundle(path: str | os.PathLike, device: str | torch.device = "cpu") -> Bundle:
    """Load a bundle saved by ``save_bundle``; the embedder comes back in eval mode on ``device``."""
    return bundle_from_bytes(Path(path).read_bytes(), device, source=str(path))


def bundle_from_bytes(data: bytes, device: str | torch.device = "cpu", *, source: str = "bundle") -> Bundle:
    """A bundle from the bytes of its file, its ``sha256`` theirs: one read is both what is loaded and
    what is hashed, so no file replaced in between can give a hash of other weights."""
    obj = _decode(data, "qloc-bundle", source)
    config = ModelConfig.from_dict(obj["config"])
    embedder = RoIEmbedder(config, pretrained=False)  # the state dict holds every weight: read no weights file
    embedder.load_state_dict(obj["embedder"])
    embedder.to(device).eval().requires_grad_(False)
    training = dict(obj.get("training", {}))
    if "decoder" in obj:  # bundles written before ``training`` held the stage-1 decoder at the top level
        training["decoder"] = obj["decoder"]
    return Bundle(obj["name"], config, embedder, obj["agent"], obj.get("provenance", {}), training,
                  sha256=hashlib.sha256(data).hexdigest(), device=torch.device(device))


class PolicyMismatch(ValueError):  # noqa: N818 -- a refusal, like ValueError
    """A policy file written for another bundle: another name, another file of that name (sha256), or
    prototypes of another dimension."""


def save_policy(path: str | os.PathLike, agent_state: dict[str, Tensor], *, bundle_name: str,
                meta: dict[str, Any] | None = None, bundle_sha256: str | None = None,
                prototype_dim: int | None = None) -> str:
    """Save an adapted agent (only) atomically -> sha256 hex of the file. ``bundle_sha256`` (the sha256 of
    the bundle's file) and ``prototype_dim`` are recorded when given, and checked when the policy is read."""
    return atomic_write(path, policy_to_bytes(agent_state, bundle_name=bundle_name, meta=meta,
                                              bundle_sha256=bundle_sha256, prototype_dim=prototype_dim))


def load_policy(path: str | os.PathLike, bundle: Bundle | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """-> (agent state dict, meta). With ``bundle``, refuses a policy made for another bundle."""
    return policy_from_bytes(Path(path).read_bytes(), bundle, source=str(path))


def head_to_bytes(head: dict[str, Tensor]) -> bytes:
    """A projection head's state as a file of its own (``{"format": "qloc-head", "format_version", "head"}``)."""
    return _to_bytes({"format": "qloc-head", "format_version": HEAD_FORMAT_VERSION, "head": _cpu(head)})


def head_from_bytes(data: bytes, *, source: str = "head") -> dict[str, Tensor]:
    return _decode(data, "qloc-head", source)["head"]


def policy_to_bytes(agent_state: dict[str, Tensor], *, bundle_name: str, meta: dict[str, Any] | None = None,
                    bundle_sha256: str | None = None, prototype_dim: int | None = None,
                    reward: Reward | None = None,
                    store_head: Callable[[dict[str, Tensor]], HeadRef] | None = None) -> bytes:
    """The exact bytes ``save_policy`` writes (for callers with their own blob storage). ``reward``: the
    repaired head and prototype the policy was adapted with (format 2; 3 when its answers are refined; 4 when it
    carries its ``start``; 5 when that start votes in a consensus); without it the file is format 1, byte for byte
    what earlier versions wrote. ``store_head``: the reward's heads are stored apart by it, the file holding what it
    returns (format 6; read back with ``load_head``)."""
    version = (1 if reward is None else 6 if store_head is not None
               else 5 if reward.start is not None and reward.start.consensus is not None
               else 4 if reward.start is not None else 3 if reward.refine else 2)
    obj: dict[str, Any] = {"format": "qloc-policy", "format_version": version, "bundle": bundle_name}
    if bundle_sha256 is not None:
        obj["bundle_sha256"] = str(bundle_sha256)
    if prototype_dim is not None:
        obj["prototype_dim"] = int(prototype_dim)
    obj["agent"] = _cpu(agent_state)

    def put_head(into: dict[str, Any], head: dict[str, Tensor]) -> None:
        if store_head is None:
            into["head"] = _cpu(head)
        else:
            into["head_ref"] = {str(k): str(v) for k, v in store_head(head).items()}

    if reward is not None:
        obj["reward"] = {"prototype": reward.prototype.detach().cpu().float().clone()}
        put_head(obj["reward"], reward.head)
        if reward.refine:
            obj["reward"]["refine"] = True
        if reward.start is not None:
            st = reward.start
            start: dict[str, Any] = {"prototype": st.prototype.detach().cpu().float().clone()}
            if st.agent is not None:
                start["agent"] = _cpu(st.agent)
            if st.head is not None:
                put_head(start, st.head)
            if st.refine:
                start["refine"] = True
            if st.consensus is not None:
                start["consensus"] = [_cpu(a) for a in st.consensus]
            obj["reward"]["start"] = start
    obj["meta"] = meta or {}
    return _to_bytes(obj)


@dataclass(frozen=True)
class Start:
    """The policy an adaptation job started from, as it was served, carried by a paired checkpoint (format 4)."""

    prototype: Tensor
    """``[D]``: the exemplars' prototype under ``head``."""
    agent: dict[str, Tensor] | None = None
    """``None``: the bundle's own agent."""
    head: dict[str, Tensor] | None = None
    """``None``: the bundle's projection head."""
    refine: bool = False
    """Its answers were refined on ``head`` (``models.refine``)."""
    consensus: tuple[dict[str, Tensor], ...] | None = None
    """Format 5: the agents of the job's checkpoints written before the one that carries this (oldest first). Given
    (even empty), the checkpoint answers each image with the consensus of the start's answer, these agents' and its
    own (``models.companion.Companion.members``); ``None``: the two heads' agreement (format 4)."""


@dataclass(frozen=True)
class Reward:
    """A repaired reward carried by a checkpoint: the projection head's state and the prototype ``[D]``."""

    head: dict[str, Tensor]
    prototype: Tensor
    refine: bool = False
    """Answers are refined on this head (``models.refine``; format 3)."""
    start: Start | None = None
    """Serve the checkpoint paired with the policy its job started from (format 4; ``None``: alone)."""


def _short(sha256: str) -> str:
    return sha256[:12]


def head_refs(path: str | os.PathLike) -> list[HeadRef]:
    """The references to heads stored apart that a checkpoint file holds (format 6: its reward's, its start's; none
    before), read with the file mapped, not loaded."""
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    reward = obj.get("reward") or {}
    return [x["head_ref"] for x in (reward, reward.get("start") or {}) if "head_ref" in x]


def policy_from_bytes(data: bytes, bundle: Bundle | None = None, *, source: str = "policy"
                      ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """-> (agent state dict, meta) of a policy file's bytes. With ``bundle``, raises ``PolicyMismatch``
    for a policy of another bundle name, of another file under that name (when the policy and the
    bundle both know their bundle's sha256), or of another prototype dimension (when recorded). The heads a
    format-6 file keeps apart are not read."""
    obj = _checked(data, bundle, source)
    return obj["agent"], obj.get("meta", {})


def checkpoint_from_bytes(data: bytes, bundle: Bundle | None = None, *, source: str = "policy",
                          load_head: Callable[[HeadRef], dict[str, Tensor]] | None = None
                          ) -> tuple[dict[str, Tensor], dict[str, Any], Reward | None]:
    """``policy_from_bytes`` plus the repaired reward the file carries (format 2; with the start it is paired with,
    format 4), or ``None``: then the bundle's head and the set's prototype serve it. ``load_head`` reads the heads a
    format-6 file keeps apart (``ValueError`` without it)."""
    obj = _checked(data, bundle, source)

    def head(r: dict[str, Any]) -> dict[str, Tensor] | None:
        if "head_ref" not in r:
            return r.get("head")
        if load_head is None:
            raise ValueError(f"{source} keeps its reward's head apart ({r['head_ref']}): it needs a head reader")
        return load_head(r["head_ref"])

    r = obj.get("reward")
    reward = None
    if r is not None:
        st = r.get("start")
        voters = None if st is None or st.get("consensus") is None else tuple(st["consensus"])
        start = None if st is None else Start(st["prototype"], st.get("agent"), head(st),
                                              bool(st.get("refine", False)), voters)
        reward = Reward(head(r), r["prototype"], bool(r.get("refine", False)), start)  # type: ignore[arg-type]
    if reward is not None and bundle is not None:
        for proto in (reward.prototype, *(() if reward.start is None else (reward.start.prototype,))):
            if proto.numel() != bundle.prototype_dim:
                raise PolicyMismatch(f"{source} carries a prototype of dimension {proto.numel()}, but bundle "
                                     f"{bundle.name!r} makes prototypes of dimension {bundle.prototype_dim}")
    return obj["agent"], obj.get("meta", {}), reward


def _checked(data: bytes, bundle: Bundle | None, source: str) -> dict[str, Any]:
    """A policy file's object, refused (``PolicyMismatch``) where it belongs to another bundle than ``bundle``."""
    obj = _decode(data, "qloc-policy", source)
    if bundle is not None:
        if obj["bundle"] != bundle.name:
            raise PolicyMismatch(f"{source} is a policy for bundle {obj['bundle']!r}, not {bundle.name!r}")
        want = obj.get("bundle_sha256")
        if want is not None and bundle.sha256 is not None and want != bundle.sha256:
            raise PolicyMismatch(
                f"{source} is a policy for bundle {bundle.name!r} sha256 {_short(want)}, but the bundle "
                f"{bundle.name!r} loaded is sha256 {_short(bundle.sha256)}: the bundle file was replaced since "
                "the policy was written")
        dim = obj.get("prototype_dim")
        if dim is not None and int(dim) != bundle.prototype_dim:
            raise PolicyMismatch(
                f"{source} is a policy for prototypes of dimension {int(dim)}, but bundle {bundle.name!r} "
                f"makes prototypes of dimension {bundle.prototype_dim}")
    return obj
