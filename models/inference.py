"""Inference: preprocessing to the bundle's input spec, exemplar prototypes, batched localization.

The rollout is greedy (argmax) by default; sampling is optional and seeded. The backbone runs once
per image per call; boxes come back in the pixels of the images as given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from models.bundle import Bundle, Reward
from models.companion import Companion, compete, start_companion
from models.compiled import compiled_steer, fast_steer
from models.config import InputSpec
from models.instances import InstanceConfig, find_instances
from models.nets.agent import Agent
from models.refine import refine
from models.rollout import Rollout, rollout, search

log = logging.getLogger(__name__)


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available; use 'auto' or 'cpu'")
    return dev


SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
"""PIL's modes of 16-bit grayscale (a 16-bit PNG opens as one of them)."""


def to_8bit(img: Image.Image, *, int32_is_16bit: bool = False) -> Image.Image:
    """A 16-bit grayscale image (``SIXTEEN_BIT_MODES``; mode ``I`` too with ``int32_is_16bit``, as older Pillow
    opens a 16-bit PNG) -> mode ``L``, 0..65535 mapped onto 0..255 (``/ 257``, rounded). PIL's own conversion to
    ``L`` clips instead: every value above 255 becomes white, and a full-range 16-bit image a silhouette. Any other
    image is returned as it is."""
    if img.mode in SIXTEEN_BIT_MODES or (int32_is_16bit and img.mode == "I"):
        arr = np.asarray(img).astype(np.float64)
        return Image.fromarray(np.clip(np.round(arr / 257.0), 0, 255).astype(np.uint8), "L")
    return img


def pil_to_tensor(img: Image.Image, channels: int, fill: tuple[float, ...] = (0.0,)) -> Tensor:
    """A PIL image -> ``[C, h, w]`` float in [0, 1], converted to grayscale (C=1) or RGB (C=3).

    Transparent pixels are composited onto ``fill`` (per channel in [0, 1], or one value for all). 16-bit
    grayscale is scaled to the 8-bit range first (``to_8bit``), not clipped.
    """
    mode = {1: "L", 3: "RGB"}[channels]
    img = to_8bit(img)
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:  # alpha, or a palette / colour key
        img = img.convert("RGBA")
        rgb = [fill[min(i, len(fill) - 1)] for i in range(3)]
        bg = Image.new("RGBA", img.size, tuple(round(255 * v) for v in rgb) + (255,))
        img = Image.alpha_composite(bg, img)
    arr = np.asarray(img.convert(mode), dtype=np.float32) / 255.0
    t = torch.from_numpy(arr.copy())
    return t[None] if channels == 1 else t.permute(2, 0, 1)


def normalize(x: Tensor, spec: InputSpec) -> Tensor:
    """``[B, C, H, W]`` in [0, 1] -> normalized by the spec's mean / std."""
    mean = torch.tensor(spec.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - mean) / std


def resize_batch(images: list[Tensor], size: int) -> tuple[Tensor, Tensor]:
    """Images ``[C, h_i, w_i]`` -> (``[B, C, size, size]``, scales ``[B, 2]`` = (w_i / size, h_i / size))."""
    out, scales = [], []
    for im in images:  # preprocessing of uploads of different sizes
        h, w = im.shape[-2:]
        out.append(im if (h, w) == (size, size) else
                   F.interpolate(im[None], size=(size, size), mode="bilinear", antialias=True,
                                 align_corners=False)[0].clamp(0, 1))
        scales.append((w / size, h / size))
    return torch.stack(out), torch.tensor(scales, dtype=torch.float32)


def preprocess(images: list[Image.Image | Tensor], spec: InputSpec) -> tuple[Tensor, Tensor]:
    """Uploads -> the network's input: (batch ``[B, C, S, S]`` in [0, 1], scales ``[B, 2]`` = (w_i / S, h_i / S)).

    The one preprocessing of images to localize or adapt on: a PIL image (any mode, any size) is converted
    to ``spec.channels`` with its transparent pixels on ``spec.fill``, then resized to ``S = spec.size``;
    a tensor ``[C, h, w]`` in [0, 1] is taken as already converted and only resized.
    """
    tensors = [im if isinstance(im, Tensor) else pil_to_tensor(im, spec.channels, spec.fill) for im in images]
    return resize_batch(tensors, spec.size)


def exemplar_canvas(crops: list[Tensor], spec: InputSpec) -> tuple[Tensor, Tensor]:
    """Crops ``[C, h, w]`` in [0, 1] -> (canvases ``[N, C, S, S]``, boxes ``[N, 4]`` of the pasted crops).

    Each crop is resized to fit ``spec.exemplar_size`` (aspect kept) and pasted at the centre of a
    canvas of ``spec.fill``, so its embedding is taken at the scale the agent sees objects.
    """
    s, e = spec.size, spec.exemplar_size
    fill = torch.tensor(spec.fill, dtype=torch.float32).view(-1, 1, 1)
    canvases = fill.expand(len(crops), spec.channels, s, s).clone()
    boxes = []
    for i, c in enumerate(crops):
        h, w = c.shape[-2:]
        k = e / max(h, w)
        nh, nw = max(1, round(h * k)), max(1, round(w * k))
        if (nh, nw) != (h, w):
            c = F.interpolate(c[None], size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)[0]
        y, x = (s - nh) // 2, (s - nw) // 2
        canvases[i, :, y:y + nh, x:x + nw] = c.clamp(0, 1)
        boxes.append((x, y, x + nw, y + nh))
    return canvases, torch.tensor(boxes, dtype=torch.float32)


@dataclass(frozen=True)
class Instance:
    """One object found in an image (``Localization.instances``), in the pixels of the image as given."""

    box: tuple[float, float, float, float]
    score: float
    template: bool = False
    """Template matching's window, added as one more candidate (``localize_batch``'s ``look_again_extra`` or
    ``extra_boxes``), not one the instance search found."""


@dataclass
class Localization:
    """One image's answer, in the pixels of the image as given."""

    box: tuple[float, float, float, float]
    score: float
    trajectory: list[tuple[float, float, float, float]] | None = None
    instances: list[Instance] | None = None
    """With ``max_instances`` (or where ``look_again`` picked the image): up to that many objects, best (lowest score)
    first; the agent's answer (``box``) is one of them unless a closer box overlaps it (``models.instances``)."""


class Localizer:
    """Wraps a bundle for serving: prototypes from crops, batched greedy localization."""

    def __init__(self, bundle: Bundle, device: str | torch.device = "auto", *, fast_episode: bool = True,
                 companion: Companion | None = None):
        """``fast_episode``: greedy episodes run as a replayed CUDA graph on a GPU, and compiled on the CPU once
        ``compile_episode`` (or another Localizer's) has compiled them (``models.compiled``: the same boxes);
        ``False``: always eager. ``companion``: each greedy answer is the companion's instead where the
        companion's answer is nearer this localizer's prototype under this localizer's head (``run_features``)."""
        self.bundle = bundle
        self.fast_episode = fast_episode
        self.companion = companion
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.embedder = bundle.to(self.device).embedder.eval()
        self.spec = bundle.config.input

    def embed_crops(self, crops: list[Tensor]) -> Tensor:
        """Crops ``[C, h, w]`` in [0, 1] -> embeddings ``[N, D]``."""
        with torch.no_grad():
            canvases, boxes = exemplar_canvas(crops, self.spec)
            feats = self.embedder.features(normalize(canvases.to(self.device), self.spec))
            return self.embedder.embed(feats, boxes.to(self.device)[:, None])[:, 0]

    def prototype(self, crops: list[Image.Image] | list[Tensor]) -> Tensor:
        """Mean embedding of the exemplar crops -> ``[D]`` (on the CPU)."""
        if not crops:
            raise ValueError("a prototype needs at least one exemplar crop")
        tensors = [c if isinstance(c, Tensor) else pil_to_tensor(c, self.spec.channels, self.spec.fill) for c in crops]
        return self.embed_crops(tensors).mean(0).cpu()

    def agent(self, agent_state: dict[str, Tensor] | None = None) -> Agent:
        return self.bundle.new_agent(agent_state).to(self.device).eval()

    def compile_episode(self, batches: bool = True) -> float:
        """Compile the one-image greedy episode for this bundle (``models.compiled``; seconds, blocking; raises
        where it cannot compile) -> seconds it took. Every Localizer of the process then runs its one-image
        greedy episodes compiled (the same boxes). ``batches``: then also the episode of batches of 2 to
        ``models.compiled.BATCHED_MAX`` images (one more compile: what a server's engine runs for concurrent
        requests); where that one fails, a warning is logged and batches stay eager (the one image's code is
        kept)."""
        s = self.spec.size
        with torch.inference_mode():
            feats = self.embedder.features(torch.zeros(2 if batches else 1, self.spec.channels, s, s,
                                                       device=self.device))
        agent, env, size = self.agent(), self.bundle.config.env, (float(s), float(s))
        seconds = compiled_steer().warm(self.embedder, agent, feats[:1], env, size)
        if batches:
            try:
                seconds += compiled_steer().warm(self.embedder, agent, feats, env, size)
            except Exception as e:  # noqa: BLE001 -- eager batches are correct, only slower
                log.warning("the batched episode was not compiled (batches run eager): %s: %s", type(e).__name__, e)
        return seconds

    @property
    def default_nearest(self) -> bool:
        """Whether a greedy episode answers with its nearest visited box unless told (the bundle's ``env.answer``)."""
        return self.bundle.config.env.answer == "nearest"

    def run(self, images01: Tensor, prototype: Tensor, agent: Agent, *, deterministic: bool = True,
            generator: torch.Generator | None = None, rewards: bool = False, samples: int = 0,
            nearest: bool | None = None) -> Rollout:
        """Localize ``images01 [B, C, S, S]`` (input size, [0, 1]) -> the time-major ``Rollout``.

        Only the final box is embedded (its distance is the score) unless ``rewards`` asks for every step's.
        A bundle that refines (``Bundle.refine``: a repaired head) refines the answer of greedy runs
        (``models.refine``): the refined box is the trajectory's last.
        ``samples > 0`` (greedy only) adds that many sampled episodes per image and keeps, per image, the
        episode whose final box is nearest the prototype; ``generator`` (default: seed 0) makes it repeatable.
        ``nearest`` (greedy only) answers with the visited box nearest the prototype instead of the last
        one (``models.rollout.search``); ``None``: the bundle's ``env.answer`` decides (greedy runs only).
        """
        with torch.no_grad():
            feats = self.embedder.features(normalize(images01.to(self.device), self.spec))  # the one backbone pass
            return self.run_features(feats, prototype, agent, deterministic=deterministic, generator=generator,
                                     rewards=rewards, samples=samples, nearest=nearest)

    def run_features(self, feats: Tensor, prototype: Tensor, agent: Agent, *, deterministic: bool = True,
                     generator: torch.Generator | None = None, rewards: bool = False, samples: int = 0,
                     nearest: bool | None = None) -> Rollout:
        """``run`` on backbone features ``feats [B, C', h, w]`` already computed (a frozen backbone's, cached)."""
        with torch.no_grad():
            s = float(self.spec.size)
            proto = prototype.to(self.device)
            if nearest is None:
                nearest = self.default_nearest and deterministic and not rewards
            if samples > 0 or nearest:
                if not deterministic or rewards:
                    raise ValueError("samples (best-of-N search) and nearest are for greedy inference without rewards")
                gen = generator if generator is not None else torch.Generator().manual_seed(0)
                ro = search(self.embedder, agent, feats, proto, self.bundle.config.env, (s, s), samples, gen,
                            nearest=nearest)
            else:
                ro = rollout(self.embedder, agent, feats, proto, self.bundle.config.env, (s, s),
                             deterministic=deterministic, generator=generator, rewards=rewards,
                             steerer=fast_steer(feats.device) if self.fast_episode else None)
            if self.bundle.refine and deterministic and not rewards:
                ro = self._refined(ro, feats, proto)
            if self.companion is not None and deterministic and not rewards and samples == 0:
                ro = compete(self, self.companion, ro, feats, proto, nearest)
            return ro

    def box_distances(self, feats: Tensor, boxes: Tensor, prototype: Tensor) -> Tensor:
        """One box per image (``boxes [B, 4]`` input pixels) on the images' feature maps ``feats [B, ...]`` -> its
        distance to ``prototype`` (``[D]`` or ``[B, D]``) under this localizer's head ``[B]``: one head call."""
        return (self.embedder.embed(feats, boxes[:, None])[:, 0] - prototype.to(feats.device)).norm(dim=-1)

    def with_reward(self, reward: Reward) -> Localizer:
        """The localizer a checkpoint carrying ``reward`` (``models.bundle``) is served with, on this localizer's bundle
        (the bundle's own head) and device: the reward's head; where the reward carries its job's ``start`` (format
        4), paired with that policy as it was served (``Companion(agree=True)``)."""
        companion = None if reward.start is None else start_companion(self, reward.start)
        return Localizer(self.bundle.with_head(reward.head, reward.refine), self.device,
                         fast_episode=self.fast_episode, companion=companion)

    def _refined(self, ro: Rollout, feats: Tensor, proto: Tensor) -> Rollout:
        """``ro`` answering with its final box refined on the embedding (``models.refine``): the refined box
        replaces the last one, in the trajectory too."""
        boxes, dists = refine(self.embedder, feats, proto, ro.boxes[-1], ro.distances[-1],
                              (float(self.spec.size), float(self.spec.size)), self.bundle.config.env.min_side)
        return ro._replace(boxes=torch.cat([ro.boxes[:-1], boxes[None]]),
                           distances=torch.cat([ro.distances[:-1], dists[None]]))

    def localize(self, images: list[Image.Image] | list[Tensor], prototype: Tensor,
                 agent_state: dict[str, Tensor] | None = None, *, deterministic: bool = True,
                 trajectory: bool = False, seed: int | None = None, samples: int = 0,
                 nearest: bool | None = None, max_instances: int = 1) -> list[Localization]:
        """Localize each image (any size) -> one ``Localization`` per image, in upload order.

        ``prototype``: ``[D]`` for every image, or ``[B, D]``, one per image (calls of several exemplar sets
        run as one batch). ``samples``: extra sampled episodes per image for the best-of-N search;
        ``nearest``: answer with the visited box nearest the prototype (see ``run``; ``None``: the bundle's
        default). ``max_instances > 1``: also up to that many objects per image (``Localization.instances``,
        ``models.instances``)."""
        batch, scales = preprocess(images, self.spec)
        return self.localize_batch(batch, scales, prototype, self.agent(agent_state), deterministic=deterministic,
                                   trajectory=trajectory, seed=seed, samples=samples, nearest=nearest,
                                   max_instances=max_instances)

    def localize_batch(self, batch01: Tensor, scales: Tensor, prototype: Tensor, agent: Agent, *,
                       deterministic: bool = True, trajectory: bool = False, seed: int | None = None,
                       samples: int = 0, nearest: bool | None = None, max_instances: int = 1,
                       instance_config: InstanceConfig | None = None,
                       look_again: Callable[[Tensor, Tensor], Tensor] | None = None,
                       look_again_instances: int = 4,
                       look_again_extra: Callable[[Tensor], Tensor] | None = None,
                       extra_boxes: Tensor | None = None) -> list[Localization]:
        """``localize`` on images already preprocessed (``preprocess``: ``batch01 [B, C, S, S]``, ``scales [B, 2]``)
        with an agent already built (``agent``): what a server that batches several requests runs.

        ``prototype`` is ``[D]`` (shared) or ``[B, D]`` (one per image). A greedy episode depends on its own
        image and prototype only, so the answers of a batch equal those of its images localized apart (to
        float rounding); sampled episodes (``samples`` or ``deterministic=False``) share one random stream
        across the batch. ``max_instances > 1`` adds ``instances`` to each answer (``models.instances``, on the
        same feature map: the backbone still runs once per image).

        ``look_again`` (with ``max_instances == 1``): a predicate on every image's answer (boxes ``[B, 4]`` in input
        pixels, distances ``[B]``) -> ``[B]`` bool; the images it picks also get up to ``look_again_instances``
        instances, searched on their feature maps (the backbone is not run again; the others pay nothing).
        ``look_again_extra``: the picked images' indices ``[m]`` -> one more box each ``[m, 4]`` (input pixels; NaN:
        none), scored on the same feature maps and added last (``Instance.template``). ``extra_boxes`` (with
        ``max_instances > 1``): the same for every image, given: ``[B, 4]`` input pixels, NaN rows none."""
        b = batch01.shape[0]
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        if prototype.dim() == 2 and prototype.shape[0] != b:
            raise ValueError(f"prototype must be [D] or [{b}, D] (one per image), got {list(prototype.shape)}")
        if prototype.dim() not in (1, 2):
            raise ValueError(f"prototype must be [D] or [B, D], got {list(prototype.shape)}")
        gen = None
        if not deterministic:
            gen = torch.Generator(device=self.device).manual_seed(0 if seed is None else seed)
        elif samples > 0:
            gen = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.inference_mode():  # less per-op bookkeeping than no_grad: batch 1 is mostly that
            feats = self.embedder.features(normalize(batch01.to(self.device), self.spec))  # the one backbone pass
            ro = self.run_features(feats, prototype, agent, deterministic=deterministic, generator=gen,
                                   samples=samples, nearest=nearest)
            found, looked, extra = None, None, None
            if max_instances > 1:
                found = find_instances(self.embedder, agent, feats, prototype, self.bundle.config.env,
                                       self.spec.size, max_instances, ro.boxes[-1], ro.distances[-1],
                                       instance_config)
                if extra_boxes is not None:
                    extra = self._scored(feats, prototype, extra_boxes.to(feats.device, torch.float32),
                                         ro.boxes[-1])
            elif look_again is not None and look_again_instances > 1:
                pick = look_again(ro.boxes[-1], ro.distances[-1]).to(feats.device)
                looked = pick.nonzero().flatten()
                if len(looked):
                    protos = prototype[looked] if prototype.dim() == 2 else prototype
                    found = find_instances(self.embedder, agent, feats[looked], protos, self.bundle.config.env,
                                           self.spec.size, look_again_instances, ro.boxes[-1][looked],
                                           ro.distances[-1][looked], instance_config)
                    if look_again_extra is not None:
                        extra = self._scored(feats[looked], protos,
                                             look_again_extra(looked.cpu()).to(feats.device, torch.float32),
                                             ro.boxes[-1][looked])
        k = torch.cat([scales, scales], dim=1).to(ro.boxes.device)  # [B, 4] (sx, sy, sx, sy)
        boxes = (ro.boxes * k).cpu()  # [T+1, B, 4]
        finals, scores = boxes[-1].tolist(), ro.distances[-1].cpu().tolist()  # one conversion for the batch
        out = [Localization(tuple(f), s) for f, s in zip(finals, scores, strict=True)]
        if trajectory:
            for loc, path in zip(out, boxes.transpose(0, 1).tolist(), strict=True):  # [B][T+1][4]
                loc.trajectory = [tuple(p) for p in path]
        if found is not None:
            picked = out if looked is None else [out[i] for i in looked.tolist()]
            kk = k if looked is None else k[looked]
            inst_boxes = (found.boxes * kk[:, None]).cpu().tolist()  # [B][K][4]
            inst_dist, valid = found.distances.cpu().tolist(), found.valid.cpu().tolist()
            for loc, bs, ds, vs in zip(picked, inst_boxes, inst_dist, valid, strict=True):
                loc.instances = [Instance(tuple(bx), d) for bx, d, v in zip(bs, ds, vs, strict=True) if v]
            if extra is not None:
                safe, extra_dist, ok = extra
                for loc, bx, d, v in zip(picked, (safe * kk).cpu().tolist(), extra_dist.cpu().tolist(),
                                         ok.cpu().tolist(), strict=True):
                    if v:
                        loc.instances.append(Instance(tuple(bx), d, template=True))  # type: ignore[union-attr]
        return out

    def _scored(self, feats: Tensor, prototype: Tensor, boxes: Tensor, fallback: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """One more box per image (``boxes [m, 4]`` input pixels, NaN rows: none) scored on the images' feature maps
        ``feats [m, ...]`` against ``prototype`` (``[D]`` or ``[m, D]``) -> (the boxes, NaN rows replaced by
        ``fallback [m, 4]``; their distances ``[m]``; which rows are real ``[m]`` bool): one head call."""
        ok = ~boxes.isnan().any(-1)
        safe = torch.where(ok[:, None], boxes, fallback)
        return safe, self.box_distances(feats, safe, prototype), ok
