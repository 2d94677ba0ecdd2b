"""What an adaptation job's probes are made of, read from the exemplar set (``models.repair.guarded_setup``
makes the probes and the guard):

- the set's exemplar crops (pasted into the job's own images as synthetic probes);
- the set's labeled examples (exemplars uploaded as whole images with boxes), at the bundle's input size;
  decoded as the API decodes them (upright: EXIF orientation applied; the boxes are in that frame).
"""

from __future__ import annotations

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session
from torch import Tensor

from app.images import open_stored
from app.storage import BlobStore
from app.tables import Exemplar
from models.config import InputSpec
from models.data.types import LabeledImages
from models.inference import pil_to_tensor, preprocess


def set_examples(session: Session, store: BlobStore, *, set_id, spec: InputSpec,  # noqa: ANN001
                 max_side: int | None = None) -> tuple[list[Tensor], LabeledImages | None]:
    """-> (the set's exemplar crops ``[C, h, w]`` in [0, 1], its labeled examples at the input size or ``None``).
    Images are decoded upright, downscaled to ``max_side`` (``QLOC_DECODE_MAX_SIDE``), crops cut from a decode
    fine enough for them, one at a time."""
    rows = list(session.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == set_id)
                                .order_by(Exemplar.position)))
    crops, whole, boxes = [], [], []
    for row in rows:
        im = open_stored(store.read_verified(row.blob, row.sha256), max_side=max_side)
        if row.box is None:
            crops.append(pil_to_tensor(im.image, spec.channels, spec.fill))
        else:
            crops.append(pil_to_tensor(im.crop(row.box, max_side=max_side), spec.channels, spec.fill))
            whole.append(im.image)
            boxes.append(im.box_to_decoded(row.box))  # in the decoded image's pixels, as preprocess's scales
    if not whole:
        return crops, None
    batch, scales = preprocess(whole, spec)  # scales [L, 2] = (w / S, h / S) of the decoded images
    k = torch.cat([scales, scales], dim=1)
    return crops, LabeledImages(batch, torch.tensor(boxes, dtype=torch.float32) / k)
