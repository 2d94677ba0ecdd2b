"""Database functions: keyword-only arguments, no HTTP. ``owner=None`` means auth is off (no scoping)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, bindparam, cast, delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, defer
from sqlalchemy.orm.attributes import set_committed_value

from app.jobstates import FINISHED_STATES
from app.lru import LoadingLRU
from app.tables import (
    AdaptationJob,
    Checkpoint,
    Exemplar,
    ExemplarSet,
    JobImage,
    LabelStudioSetup,
    PoolImage,
    utcnow,
)


def _scoped(stmt, column, owner: str | None):  # type: ignore[no-untyped-def]
    return stmt if owner is None else stmt.where(column == owner)


# --- exemplar sets


@dataclass
class NewBlob:
    """An uploaded image already written to the blob store, to be recorded in a row."""

    position: int
    filename: str | None
    content_type: str
    width: int
    height: int
    sha256: str
    blob: str
    box: tuple[float, float, float, float] | None = None
    """For an exemplar: the object's box in the image's pixels (a labeled example); None for a crop."""


def create_exemplar_set(session: Session, *, set_id: uuid.UUID, owner: str, name: str | None, bundle: str,
                        bundle_sha256: str, prototype: bytes, prototype_dim: int,
                        exemplars: list[NewBlob], calibration: dict | None = None, threshold: float = 0.5,
                        negatives: bytes | None = None, num_negatives: int = 0) -> ExemplarSet:
    """A set, its exemplar rows and its ``base`` checkpoint (the bundle's policy), made active; the set and
    its base checkpoint record ``bundle_sha256``, the sha256 of the bundle file that made the prototype.
    Exemplars with a ``box`` are the set's labeled examples (counted in ``num_labeled``)."""
    es = ExemplarSet(id=set_id, owner=owner, name=name, bundle=bundle, bundle_sha256=bundle_sha256,
                     prototype=prototype, prototype_dim=prototype_dim, num_exemplars=len(exemplars),
                     num_labeled=sum(e.box is not None for e in exemplars), calibration=calibration,
                     threshold=threshold, negatives=negatives, num_negatives=num_negatives)
    session.add(es)
    session.flush()
    for e in exemplars:
        x1, y1, x2, y2 = e.box if e.box is not None else (None, None, None, None)
        session.add(Exemplar(exemplar_set_id=set_id, position=e.position, filename=e.filename,
                             content_type=e.content_type, width=e.width, height=e.height, sha256=e.sha256,
                             blob=e.blob, box_x1=x1, box_y1=y1, box_x2=x2, box_y2=y2))
    base = Checkpoint(exemplar_set_id=set_id, parent_id=None, job_id=None, kind="base", iteration=0,
                      sha256=bundle_sha256, metrics={}, blob=None)
    session.add(base)
    session.flush()
    es.active_checkpoint_id = base.id
    return es


def get_exemplar_set(session: Session, *, set_id: uuid.UUID, owner: str | None) -> ExemplarSet | None:
    return session.scalars(_scoped(select(ExemplarSet).where(ExemplarSet.id == set_id), ExemplarSet.owner,
                                   owner)).first()


def get_exemplar_set_and_active(session: Session, *, set_id: uuid.UUID, owner: str | None
                                ) -> tuple[ExemplarSet, Checkpoint | None] | None:
    """The set, if ``owner`` may see it, with its active checkpoint (None: none active), in one query (a left
    join): the localize path, where one client's latency feels each round trip.

    Their calibrations come back as the JSON's text and are parsed once per distinct text (``parsed_json``): a
    set's is ~23 kB with a known-kinds check, and parsing it was the largest part of reading the row. The parsed
    values are shared between requests: read them, never change them (a stored calibration is written once)."""
    stmt = _SET_AND_ACTIVE if owner is None else _SET_AND_ACTIVE_OWNED
    row = session.execute(stmt, {"set_id": set_id} if owner is None else {"set_id": set_id, "owner": owner}).first()
    if row is None:
        return None
    es, active, set_calibration, active_calibration = row
    set_committed_value(es, "calibration", parsed_json(set_calibration))
    if active is not None:
        set_committed_value(active, "calibration", parsed_json(active_calibration))
    return es, active


_PARSED: LoadingLRU[Any] = LoadingLRU(256)


def parsed_json(text: str | None) -> Any:
    """``json.loads(text)``, kept by the text (``None``: ``None``): the same object for the same text, shared."""
    return None if text is None else _PARSED.get(text, lambda: json.loads(text))


# Built once (the localize path runs it on every request): the ORM caches the compiled SQL, not the statement.
# The calibrations are read as text, not as the ORM's JSON (which parses them on every read): ``parsed_json``.
_SET_AND_ACTIVE = (select(ExemplarSet, Checkpoint, cast(ExemplarSet.calibration, Text).label("set_calibration"),
                          cast(Checkpoint.calibration, Text).label("active_calibration"))
                   .outerjoin(Checkpoint, Checkpoint.id == ExemplarSet.active_checkpoint_id)
                   .options(defer(ExemplarSet.calibration), defer(Checkpoint.calibration))
                   .where(ExemplarSet.id == bindparam("set_id")))
_SET_AND_ACTIVE_OWNED = _SET_AND_ACTIVE.where(ExemplarSet.owner == bindparam("owner"))


def labeled_examples(session: Session, set_id: uuid.UUID) -> list[Exemplar]:
    """The set's labeled examples: its exemplar rows that have a box, ordered by ``position``.

    Each is a whole image as uploaded, with the object's box. Read the image with
    ``store.read_verified(row.blob, row.sha256)`` and decode the bytes with PIL (``Image.open``, as
    ``app.images.decode_image`` does: no EXIF rotation); ``row.box`` is ``(x1, y1, x2, y2)`` in the pixels of
    that decoded image (x right, y down; ``row.width`` x ``row.height`` is its size, and the box lies within
    ``[0, width] x [0, height]``). To put the box in a bundle's input frame after ``models.inference.preprocess``,
    divide x by ``width / S`` and y by ``height / S`` (the scales it returns). The prototype was made from the
    crops cut from these boxes (edges rounded to the nearest pixel). An unknown set, or a set of plain crops,
    gives ``[]``. ``set_id`` may be passed by keyword or by position."""
    stmt = (select(Exemplar).where(Exemplar.exemplar_set_id == set_id, Exemplar.box_x1.is_not(None))
            .order_by(Exemplar.position))
    return list(session.scalars(stmt))


def list_exemplar_sets(session: Session, *, owner: str | None, limit: int, offset: int
                       ) -> tuple[list[ExemplarSet], int]:
    count = session.scalar(_scoped(select(func.count()).select_from(ExemplarSet), ExemplarSet.owner, owner)) or 0
    stmt = _scoped(select(ExemplarSet), ExemplarSet.owner, owner).order_by(ExemplarSet.created_at, ExemplarSet.id)
    return list(session.scalars(stmt.limit(limit).offset(offset))), count


def unfinished_jobs(session: Session, *, set_id: uuid.UUID) -> list[tuple[uuid.UUID, bool]]:
    """The set's queued or running jobs, oldest first -> (id, whether a cancel was asked for)."""
    stmt = (select(AdaptationJob.id, AdaptationJob.cancel_requested)
            .where(AdaptationJob.exemplar_set_id == set_id, AdaptationJob.status.not_in(FINISHED_STATES))
            .order_by(AdaptationJob.created_at, AdaptationJob.id))
    return [(r.id, bool(r.cancel_requested)) for r in session.execute(stmt)]


def delete_exemplar_set(session: Session, *, set_id: uuid.UUID) -> None:
    """Delete the set and every row under it (explicitly, so no backend's cascade order matters)."""
    jobs = select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)
    session.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=None))
    session.execute(update(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id)
                    .values(checkpoint_id=None, base_checkpoint_id=None))
    session.execute(update(Checkpoint).where(Checkpoint.exemplar_set_id == set_id).values(parent_id=None))
    session.execute(delete(Checkpoint).where(Checkpoint.exemplar_set_id == set_id))
    session.execute(delete(JobImage).where(JobImage.job_id.in_(jobs)))
    session.execute(delete(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id))
    session.execute(delete(PoolImage).where(PoolImage.exemplar_set_id == set_id))
    session.execute(delete(Exemplar).where(Exemplar.exemplar_set_id == set_id))
    session.execute(delete(LabelStudioSetup).where(LabelStudioSetup.exemplar_set_id == set_id))
    session.execute(delete(ExemplarSet).where(ExemplarSet.id == set_id))


# --- checkpoints


def get_checkpoint(session: Session, *, checkpoint_id: uuid.UUID, owner: str | None) -> Checkpoint | None:
    stmt = select(Checkpoint).join(ExemplarSet, ExemplarSet.id == Checkpoint.exemplar_set_id).where(
        Checkpoint.id == checkpoint_id)
    return session.scalars(_scoped(stmt, ExemplarSet.owner, owner)).first()


def list_checkpoints(session: Session, *, set_id: uuid.UUID, limit: int, offset: int) -> tuple[list[Checkpoint], int]:
    where = Checkpoint.exemplar_set_id == set_id
    count = session.scalar(select(func.count()).select_from(Checkpoint).where(where)) or 0
    stmt = select(Checkpoint).where(where).order_by(Checkpoint.created_at, Checkpoint.iteration, Checkpoint.id)
    return list(session.scalars(stmt.limit(limit).offset(offset))), count


def activate_checkpoint(session: Session, *, checkpoint: Checkpoint) -> ExemplarSet | None:
    """Make ``checkpoint`` its set's active one -> the set; ``None``: the checkpoint was deleted meanwhile (the caller
    holds the set's lock, ``app.pool.lock``, as ``delete_checkpoint``'s caller does)."""
    if session.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.id == checkpoint.id)) != 1:
        return None
    es = session.get_one(ExemplarSet, checkpoint.exemplar_set_id)
    es.active_checkpoint_id = checkpoint.id
    return es


def delete_checkpoint(session: Session, *, checkpoint: Checkpoint) -> str | None:
    """Delete an adapted checkpoint's row -> its blob key (the caller deletes the file after the commit). Its
    children are re-parented to its parent (lineage skips it); finished jobs that name it forget it. The caller
    has taken the set's lock and refused the cases that must not be deleted (``checkpoint_in_use``)."""
    session.execute(update(Checkpoint).where(Checkpoint.parent_id == checkpoint.id)
                    .values(parent_id=checkpoint.parent_id))
    session.execute(update(AdaptationJob).where(AdaptationJob.checkpoint_id == checkpoint.id)
                    .values(checkpoint_id=None))
    session.execute(update(AdaptationJob).where(AdaptationJob.base_checkpoint_id == checkpoint.id)
                    .values(base_checkpoint_id=None))
    session.execute(delete(Checkpoint).where(Checkpoint.id == checkpoint.id))
    return checkpoint.blob


def checkpoint_in_use(session: Session, *, checkpoint: Checkpoint) -> str | None:
    """Why ``checkpoint`` must not be deleted now (its set's base policy, its active one, or what a queued or running
    job starts from or writes), or ``None``."""
    if checkpoint.kind == "base":
        return "it is the set's base policy (the bundle's own); delete the exemplar set to remove it"
    es = session.get_one(ExemplarSet, checkpoint.exemplar_set_id)
    if es.active_checkpoint_id == checkpoint.id:
        return "it is the set's active checkpoint: activate another one first (POST /v1/checkpoints/{id}/activate)"
    jobs = list(session.scalars(select(AdaptationJob.id).where(
        AdaptationJob.status.not_in(FINISHED_STATES),
        or_(AdaptationJob.base_checkpoint_id == checkpoint.id, AdaptationJob.id == checkpoint.job_id))))
    if jobs:
        return (f"job {', '.join(str(j) for j in jobs)} (queued or running) starts from it or wrote it: wait for it "
                "to end, or cancel it")
    return None


# --- adaptation jobs


def create_job(session: Session, *, job_id: uuid.UUID, exemplar_set: ExemplarSet, owner: str,
               idempotency_key: str | None, request_sha256: str, iterations: int, learning_rate: float, seed: int,
               activate: str, images: list[NewBlob]) -> AdaptationJob:
    """A ``queued`` job (the status column's default; ``app.jobstates`` owns every change of it) not yet sent
    (``enqueued_at`` NULL): commit it, send its task, then ``mark_enqueued`` (or ``jobstates.fail_unsent``)."""
    job = AdaptationJob(id=job_id, exemplar_set_id=exemplar_set.id, owner=owner,
                        idempotency_key=idempotency_key, request_sha256=request_sha256, iterations=iterations,
                        learning_rate=learning_rate, seed=seed, activate=activate, num_images=len(images),
                        base_checkpoint_id=exemplar_set.active_checkpoint_id, progress_iteration=0,
                        cancel_requested=False, attempts=0, enqueued_at=None)
    session.add(job)
    session.flush()
    for im in images:
        session.add(JobImage(job_id=job_id, position=im.position, filename=im.filename, content_type=im.content_type,
                             width=im.width, height=im.height, sha256=im.sha256, blob=im.blob))
    return job


def get_job(session: Session, *, job_id: uuid.UUID, owner: str | None) -> AdaptationJob | None:
    return session.scalars(_scoped(select(AdaptationJob).where(AdaptationJob.id == job_id), AdaptationJob.owner,
                                   owner)).first()


def get_job_by_idempotency_key(session: Session, *, owner: str, key: str) -> AdaptationJob | None:
    return session.scalars(select(AdaptationJob).where(AdaptationJob.owner == owner,
                                                       AdaptationJob.idempotency_key == key)).first()


def list_jobs(session: Session, *, set_id: uuid.UUID, limit: int, offset: int) -> tuple[list[AdaptationJob], int]:
    where = AdaptationJob.exemplar_set_id == set_id
    count = session.scalar(select(func.count()).select_from(AdaptationJob).where(where)) or 0
    stmt = select(AdaptationJob).where(where).order_by(AdaptationJob.created_at, AdaptationJob.id)
    return list(session.scalars(stmt.limit(limit).offset(offset))), count


def mark_enqueued(session: Session, *, job_id: uuid.UUID) -> None:
    """Record that the job's task was sent (the outbox's confirmation), unless a reaper recorded a send first."""
    session.execute(update(AdaptationJob).where(AdaptationJob.id == job_id, AdaptationJob.enqueued_at.is_(None))
                    .values(enqueued_at=utcnow()))


def job_counts(session: Session) -> dict[str, int]:
    rows = session.execute(select(AdaptationJob.status, func.count()).group_by(AdaptationJob.status))
    return {status: n for status, n in rows}


def job_duration_stats(session: Session) -> dict[str, tuple[int, float]]:
    """status -> (count, total seconds from start to finish) of finished jobs that ran."""
    if session.get_bind().dialect.name == "sqlite":
        seconds = (func.julianday(AdaptationJob.finished_at) - func.julianday(AdaptationJob.started_at)) * 86400.0
    else:
        seconds = func.extract("epoch", AdaptationJob.finished_at - AdaptationJob.started_at)
    rows = session.execute(
        select(AdaptationJob.status, func.count(), func.coalesce(func.sum(seconds), 0.0))
        .where(AdaptationJob.status.in_(FINISHED_STATES), AdaptationJob.started_at.is_not(None),
               AdaptationJob.finished_at.is_not(None))
        .group_by(AdaptationJob.status))
    return {status: (int(n), float(total)) for status, n, total in rows}


# --- Label Studio


def labelstudio_setup(session: Session, *, set_id: uuid.UUID, project: str) -> LabelStudioSetup | None:
    """What the latest ``/setup`` of the set's Label Studio ``project`` gave, or ``None``."""
    return session.get(LabelStudioSetup, (set_id, project))


def put_labelstudio_setup(session: Session, *, set_id: uuid.UUID, project: str, url: str | None, token: str | None,
                          max_instances: int) -> None:
    """Record a ``/setup`` (one statement, safe against a concurrent one for the same key: an upsert on both
    databases): ``max_instances`` replaces the last; ``url`` and ``token`` only where given."""
    dialect = session.get_bind().dialect.name
    insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    now = utcnow()
    stmt = insert(LabelStudioSetup).values(exemplar_set_id=set_id, project=project, url=url, token=token,
                                           max_instances=max_instances, updated_at=now)
    session.execute(stmt.on_conflict_do_update(
        index_elements=[LabelStudioSetup.exemplar_set_id, LabelStudioSetup.project],
        set_={"url": func.coalesce(stmt.excluded.url, LabelStudioSetup.url),
              "token": func.coalesce(stmt.excluded.token, LabelStudioSetup.token),
              "max_instances": stmt.excluded.max_instances, "updated_at": now}))
