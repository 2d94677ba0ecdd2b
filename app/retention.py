"""Checkpoints deleted with their files: one by ``DELETE /v1/checkpoints/{id}``, and a finished job's own
intermediate ones under ``QLOC_JOB_CHECKPOINTS=chosen`` (``worker.jobs``), by the same code.

A checkpoint's row goes first (its children re-parented, ``app.crud.delete_checkpoint``), its file after the
commit; a repaired head stored apart (checkpoint format 6) goes once no checkpoint of the set refers to it, except
one written since a job of the set still unfinished began (that job's checkpoint may not name it yet).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import crud
from app.storage import BlobStore, head_key, heads_prefix
from app.tables import FINISHED_STATES, AdaptationJob, Checkpoint
from models.bundle import head_refs

log = logging.getLogger(__name__)

HEAD_CLOCK_MARGIN_S = 60.0
"""Seconds a head file written before an unfinished job was created is still kept (the worker that wrote it and
the API may not share a clock)."""


def remove_checkpoints(session: Session, store: BlobStore, set_id: uuid.UUID, checkpoints: Iterable[Checkpoint]) -> int:
    """Delete ``checkpoints`` of the set (their rows, committed here, then their files and the head files no
    checkpoint uses any more) -> how many. The caller holds the set's lock (``app.pool.lock``) in ``session``'s
    transaction and has refused those in use (``app.crud.checkpoint_in_use``)."""
    blobs = [crud.delete_checkpoint(session, checkpoint=c) for c in checkpoints]
    since = session.scalar(select(func.min(AdaptationJob.created_at)).where(
        AdaptationJob.exemplar_set_id == set_id, AdaptationJob.status.not_in(FINISHED_STATES)))
    remaining = list(session.scalars(select(Checkpoint.blob).where(Checkpoint.exemplar_set_id == set_id,
                                                                   Checkpoint.kind == "adapted")))
    session.commit()
    for blob in blobs:
        if blob:
            store.delete(blob)
    drop_unused_heads(store, set_id, [b for b in remaining if b],
                      before=None if since is None else since.timestamp() - HEAD_CLOCK_MARGIN_S)
    return len(blobs)


def drop_unused_heads(store: BlobStore, set_id: uuid.UUID, blobs: list[str], *, before: float | None = None) -> None:
    """Delete the set's head files (checkpoint format 6) that none of the checkpoint files ``blobs`` refers to (with
    ``before``, a POSIX time: only those written before it)."""
    folder = store.path(heads_prefix(set_id))
    if not folder.is_dir():
        return
    used = set()
    for blob in blobs:
        try:
            used |= {ref["key"] for ref in head_refs(store.path(blob))}
        except (OSError, ValueError, RuntimeError):
            log.warning("checkpoint file %s unreadable: the set's head files are kept", blob)
            return
    for f in folder.glob("*.pt"):
        key = head_key(set_id, f.stem)
        if key not in used and (before is None or f.stat().st_mtime < before):
            store.delete(key)
