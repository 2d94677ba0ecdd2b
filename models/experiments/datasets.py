"""The dataset kinds the training and evaluation commands run on, each with its data discipline.

A kind draws the images of each role of the protocol -- ``train`` / ``val`` / ``val_exemplars`` (stages
1-2 and model selection), ``exemplars`` / ``unlabeled`` / ``test`` (a target: its exemplar crops, the
unlabeled images adaptation sees, the held-out test images) -- and names its networks and training
defaults. The draws are the ones the protocols of ``models.experiments.cmnist`` / ``.photos`` make, so a
command and a benchmark table see the same images for the same seed. ``GlyphKind`` (letters and symbols
on cMNIST canvases, ``models.data.glyphs``) follows ``CMnistKind``'s draws with the cMNIST networks, so
a cMNIST bundle can be evaluated and adapted on objects that are not digits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from models.bundle import Bundle
from models.config import ModelConfig
from models.data.glyphs import glyphs
from models.data.photos import generate
from models.data.types import LabeledImages
from models.evaluate import rect_candidates
from models.experiments.cmnist import TrainSetup, cmnist
from models.experiments.photos import PhotoTrainSetup, photo_model_config, photo_set
from models.presets import mnist_config
from models.train.agent import AgentTrainConfig
from models.train.embedding import EmbeddingTrainConfig

ROLES = ("train", "val", "val_exemplars", "exemplars", "unlabeled", "test")


class _CanvasKind:
    """What cMNIST and glyphs share: the cMNIST networks, training defaults and data discipline
    (``exemplars`` and ``unlabeled`` are disjoint slices of one train draw at seed + 1000, ``val_exemplars``
    follows ``val`` in one draw, ``test`` is its own draw). A kind supplies ``_images``."""

    background: str

    def sizes(self) -> dict[str, int]:
        s = TrainSetup()
        return {"n_train": s.n_train, "n_val": s.n_val, "exemplars": s.exemplars}

    def model_config(self) -> ModelConfig:
        return mnist_config()

    def embedding_config(self) -> EmbeddingTrainConfig:
        return TrainSetup().embedding

    def agent_config(self) -> AgentTrainConfig:
        return TrainSetup().agent

    def candidates(self, bundle: Bundle) -> Tensor | None:
        return None  # stage 1's default squares

    def select_with_exemplars(self) -> bool:
        return False  # stage 1 keeps the best OrdAcc with group prototypes

    def _images(self, split: str, n: int, seed: int, offset: int) -> LabeledImages:
        raise NotImplementedError

    def draw(self, bundle: Bundle, role: str, n: int, seed: int, after: int = 0) -> LabeledImages:
        """``n`` images of ``role``; ``after``: how many images of the same draw an earlier role took
        (``val_exemplars`` after ``val``, ``unlabeled`` after ``exemplars``), so the two never overlap."""
        split, s = {"train": ("train", seed), "val": ("val", seed), "val_exemplars": ("val", seed),
                    "exemplars": ("train", seed + 1000), "unlabeled": ("train", seed + 1000),
                    "test": ("test", seed)}[_role(role)]
        return self._images(split, n, s, after if role in ("val_exemplars", "unlabeled") else 0)


@dataclass
class CMnistKind(_CanvasKind):
    """Corrupted MNIST: ``digit`` on the ``background``; test images from MNIST's test file."""

    digit: int = 4
    background: str = "patch"
    name: str = "cmnist"

    def describe(self) -> str:
        return f"cMNIST digit {self.digit} {self.background}"

    def meta(self) -> dict[str, Any]:
        return {"digit": self.digit, "background": self.background}

    def _images(self, split: str, n: int, seed: int, offset: int) -> LabeledImages:
        return cmnist(self.digit, split, n, self.background, seed, offset=offset)


@dataclass
class CMnistDigitsKind(_CanvasKind):
    """Several digits at once, for a general bundle (issue 11): each role draws ``n`` images *of every digit*
    (``CMnistKind``'s draws, digit by digit), labeled by kind (``LabeledImages.classes``), so stage 1 batches one
    digit at a time and stage 2 trains one digit per iteration. Stage 1 keeps the epoch whose validation exemplars'
    prototypes (one per digit) order the validation boxes best: group prototypes of mixed digits would not."""

    digits: tuple[int, ...] = tuple(range(10))
    background: str = "patch"
    name: str = "cmnist"

    def __post_init__(self) -> None:
        if len(self.digits) < 2 or len(set(self.digits)) != len(self.digits) or not set(self.digits) <= set(range(10)):
            raise ValueError(f"digits must be two or more distinct digits 0-9, got {list(self.digits)}")

    def describe(self) -> str:
        return f"cMNIST digits {''.join(map(str, self.digits))} {self.background}"

    def meta(self) -> dict[str, Any]:
        return {"digits": list(self.digits), "background": self.background}

    def sizes(self) -> dict[str, int]:
        return {**super().sizes(), "n_val": 20}  # per digit: the one-digit sizes, a tenth of its validation images

    def embedding_config(self) -> EmbeddingTrainConfig:
        # Ten times the images of one digit per epoch: 30 epochs are 300 steps (one digit: 100 epochs, 100 steps).
        return replace(TrainSetup().embedding, epochs=30, eval_every=5)

    def select_with_exemplars(self) -> bool:
        return True

    def _images(self, split: str, n: int, seed: int, offset: int) -> LabeledImages:
        return LabeledImages.concat([cmnist(d, split, n, self.background, seed, offset=offset) for d in self.digits])


@dataclass
class GlyphKind(_CanvasKind):
    """Glyphs (``models.data.glyphs``): the character ``char`` on the ``background``, on cMNIST canvases with
    the cMNIST networks, training defaults and seeds; test images from the held-out test fonts."""

    char: str = "A"
    background: str = "patch"
    name: str = "glyphs"

    def describe(self) -> str:
        return f"glyph {self.char!r} {self.background}"

    def meta(self) -> dict[str, Any]:
        return {"glyph": self.char, "background": self.background}

    def _images(self, split: str, n: int, seed: int, offset: int) -> LabeledImages:
        return glyphs(self.char, split, n, self.background, seed, offset=offset)


@dataclass
class PhotoKind:
    """The offline photos (``models.data.photos``): one class; every role from its own split of source files."""

    class_name: str = "mammals"
    manifest: dict[str, Any] = field(default_factory=dict)
    setup: PhotoTrainSetup = field(default_factory=PhotoTrainSetup)
    name: str = "photos"

    def describe(self) -> str:
        return f"offline photos, class {self.class_name}"

    def meta(self) -> dict[str, Any]:
        return {"class": self.class_name}

    def sizes(self) -> dict[str, int]:
        s = self.setup
        return {"n_train": s.n_train, "n_val": s.n_val, "exemplars": s.exemplars}

    def model_config(self) -> ModelConfig:
        return photo_model_config(self.setup)

    def embedding_config(self) -> EmbeddingTrainConfig:
        return replace(self.setup.embedding, anchor=self.setup.anchor)

    def agent_config(self) -> AgentTrainConfig:
        return self.setup.agent

    def candidates(self, bundle: Bundle) -> Tensor | None:
        return rect_candidates(bundle)

    def select_with_exemplars(self) -> bool:
        return True  # stage 1 keeps the best OrdAcc with the validation exemplars' prototype

    def draw(self, bundle: Bundle, role: str, n: int, seed: int, after: int = 0) -> LabeledImages:
        """``n`` generated photos of ``role`` carrying their backbone features (a frozen backbone); separate
        draws never share an image (their seeds differ), so ``after`` is not needed."""
        split, s = {"train": ("train", seed), "val": ("val", seed), "val_exemplars": ("val", seed + 500),
                    "exemplars": ("train", seed + 1000), "unlabeled": ("train", seed + 2000),
                    "test": ("test", seed)}[_role(role)]
        if role == "unlabeled":  # adaptation computes the features it needs itself
            b = generate(self.manifest, self.class_name, split, n, seed=s, size=bundle.config.input.size)
            return LabeledImages(b.images, b.boxes)
        crops = role in ("train", "val_exemplars", "exemplars")
        return photo_set(bundle, self.manifest, self.class_name, split, n, s, crops=crops)


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role
