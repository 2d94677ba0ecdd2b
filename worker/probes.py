"""The probes of an adaptation job, built from what the client gave (``models.guard`` scores on them):

- the set's labeled examples (exemplars uploaded as whole images with boxes), at the bundle's input size;
- synthetic probes: the set's exemplar crops pasted into the job's own images (``models.guard.synthetic_probes``).
"""

from __future__ import annotations

import io

import torch
from PIL import Image
from sqlalchemy import select
from sqlalchemy.orm import Session
from torch import Tensor

from app.images import cut_box
from app.storage import BlobStore
from app.tables import Exemplar
from models.bundle import Bundle
from models.data.types import LabeledImages
from models.guard import synthetic_probes
from models.inference import pil_to_tensor, preprocess


def job_probes(session: Session, store: BlobStore, *, set_id, bundle: Bundle, prototype: Tensor,  # noqa: ANN001
               images01: Tensor, agent_state: dict[str, Tensor] | None, synthetic: int,
               generator: torch.Generator) -> tuple[LabeledImages, dict[str, int]]:
    """-> (probes at the input size, counts ``{"labeled", "synthetic"}``)."""
    spec = bundle.config.input
    rows = list(session.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == set_id)
                                .order_by(Exemplar.position)))
    crops, whole, boxes = [], [], []
    for row in rows:
        with Image.open(io.BytesIO(store.read_verified(row.blob, row.sha256))) as im:
            im.load()
            if row.box is None:
                crops.append(pil_to_tensor(im, spec.channels, spec.fill))
            else:
                crops.append(pil_to_tensor(cut_box(im, row.box), spec.channels, spec.fill))
                whole.append(im.copy())
                boxes.append(row.box)
    parts = []
    if whole:
        batch, scales = preprocess(whole, spec)  # scales [L, 2] = (w / S, h / S)
        k = torch.cat([scales, scales], dim=1)
        parts.append(LabeledImages(batch, torch.tensor(boxes, dtype=torch.float32) / k))
    if synthetic > 0:
        parts.append(synthetic_probes(bundle, prototype, crops, images01, agent_state, synthetic, generator))
    probes = LabeledImages(torch.cat([p.images for p in parts]), torch.cat([p.boxes for p in parts]))
    return probes, {"labeled": len(whole), "synthetic": synthetic if synthetic > 0 else 0}
