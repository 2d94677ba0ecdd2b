"""Checkpoints deleted with their files: one by ``DELETE /v1/checkpoints/{id}``, and a finished job's own
intermediate ones under ``QLOC_JOB_CHECKPOINTS=chosen`` (``keep_only``, called by ``worker.jobs``), by the same code.

A checkpoint's row goes first (its children re-parented, ``app.crud.delete_checkpoint``), its file after the
commit; a repaired head stored apart (checkpoint format 6) goes once no checkpoint of the set refers to it, except
one written since a job of the set still unfinished began (that job's checkpoint may not name it yet).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app import crud, pool
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


def keep_only(session_factory: sessionmaker[Session], store: BlobStore, *, set_id: uuid.UUID, job_id: uuid.UUID,
              chosen: set[uuid.UUID]) -> None:
    """``QLOC_JOB_CHECKPOINTS=chosen``: delete the finished job's checkpoints (of every run) but ``chosen``, and but
    those the set has made active or a queued job starts from meanwhile. The job has ended: a failure here is
    logged, the checkpoints stay (``DELETE /v1/checkpoints/{id}`` can free them)."""
    try:
        with session_factory() as s:
            pool.lock(s, set_id)  # as the route: no activation of one, no job from one, while this decides
            written = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
            drop = [c for c in written if c.id not in chosen and crud.checkpoint_in_use(s, checkpoint=c) is None]
            n = remove_checkpoints(s, store, set_id, drop)
        log.info("job %s: %d of its checkpoints deleted (QLOC_JOB_CHECKPOINTS=chosen), %d kept", job_id, n,
                 len(written) - n)
    except pool.SetGone:
        pass  # the set was deleted with its checkpoints
    except Exception:
        log.exception("job %s: its unchosen checkpoints were not deleted", job_id)


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
