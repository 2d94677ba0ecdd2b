"""``qloc train-verifier``: the known-kinds verifier of a cMNIST bundle (``models.verifier``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from models.data.cmnist import BACKGROUNDS
from models.experiments.cmnist import cmnist
from models.experiments.provenance import command_line
from models.verifier import WIDTHS, save_verifier, train_verifier, verifier_path


def cmd_train_verifier(a: argparse.Namespace) -> dict:
    """Box contents of ``--digits`` on the four backgrounds (MNIST's train file, the train part) -> the verifier,
    written beside the bundle as ``<bundle>.verifier``."""
    images, boxes = {}, {}
    for d in a.digits:
        parts = [cmnist(d, "train", a.per, bg, a.seed) for bg in BACKGROUNDS]
        images[str(d)] = torch.cat([p.images for p in parts])
        boxes[str(d)] = torch.cat([p.boxes for p in parts])
    t0 = time.perf_counter()
    v = train_verifier(images, boxes, a.iterations, a.seed, tuple(a.widths))
    seconds = round(time.perf_counter() - t0, 1)
    out = Path(a.out) if a.out else verifier_path(a.bundle)
    sha = save_verifier(out, v, {"digits": a.digits, "per": a.per, "iterations": a.iterations, "seed": a.seed,
                                 "widths": a.widths, "command": command_line("train-verifier", a),
                                 "train_seconds": seconds})
    return {"out": str(out), "sha256": sha, "kinds": v.names, "train_seconds": seconds}


def add_verifier_parser(sub: Any) -> None:
    sp = sub.add_parser("train-verifier", help="the known-kinds verifier of a cMNIST bundle (found on known kinds)")
    sp.add_argument("--bundle", required=True, help="the bundle file it serves (written beside it: <bundle>.verifier)")
    sp.add_argument("--digits", type=int, nargs="+", choices=range(10), default=list(range(10)))
    sp.add_argument("--per", type=int, default=150, help="train images per digit and background")
    sp.add_argument("--iterations", type=int, default=2000)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--widths", type=int, nargs=3, default=list(WIDTHS), metavar="C",
                    help="the three convolutions' channels (default and the shipped one: 32 64 64)")
    sp.add_argument("--out", help="another path than <bundle>.verifier")
    sp.set_defaults(func=cmd_train_verifier)
