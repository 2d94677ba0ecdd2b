"""An exemplar set's image pool: unlabeled images kept for adaptation jobs, filled over many requests, capped.

No HTTP here (the routes map the exceptions). The cap holds under concurrency because every change of the
pool first updates the set's row (``exemplar_sets.num_pool_images`` / ``pool_bytes``) in the transaction that
changes the rows: adding is one conditional UPDATE (``... WHERE num_pool_images + n <= cap``), which PostgreSQL
runs under the row's lock and re-checks after waiting for another writer, and which SQLite runs under its
database write lock (``BEGIN IMMEDIATE``, ``app.db``). Deleting and a job's snapshot of the pool take the same
row lock first, so a pool image is never deleted while a queued or running job that took it can still read it.

Files are written before their rows and deleted after them (``app.storage``); a refused or failed add deletes
the files it wrote.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.images import DecodedImage
from app.jobstates import FINISHED_STATES
from app.storage import BlobStore, exemplar_set_prefix, pool_image_key
from app.tables import AdaptationJob, ExemplarSet, JobImage, PoolImage, utcnow

ORDER = (PoolImage.created_at, PoolImage.position, PoolImage.id)
"""The pool's order: by request, then upload order within a request. Listings and job snapshots follow it."""


class SetGone(Exception):  # noqa: N818 -- a verdict, not a crash
    """The exemplar set does not exist (any more)."""


class PoolFull(Exception):  # noqa: N818
    """Adding these images would pass the pool's cap; nothing was stored."""


class ImageInUse(Exception):  # noqa: N818
    """A queued or running job took these pool images: they are kept until it ends."""

    def __init__(self, detail: str, job_ids: list[uuid.UUID]):
        super().__init__(detail)
        self.job_ids = job_ids


@dataclass
class Limits:
    max_images: int
    max_bytes: int


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def full_message(set_id: uuid.UUID, *, count: int, nbytes: int, adding: int, adding_bytes: int,
                 limits: Limits) -> str | None:
    """Why ``adding`` images of ``adding_bytes`` do not fit a pool that holds ``count`` of ``nbytes`` -> the
    message, or None when they fit."""
    if count + adding <= limits.max_images and nbytes + adding_bytes <= limits.max_bytes:
        return None
    return (f"the set's image pool is full: it holds {_plural(count, 'image')} ({nbytes} bytes) of at most "
            f"{limits.max_images} ({limits.max_bytes} bytes), and this request adds {_plural(adding, 'image')} "
            f"({adding_bytes} bytes). Nothing was stored: delete pool images (DELETE /v1/exemplar-sets/{set_id}/"
            "images/{image_id}, or all of them with DELETE /v1/exemplar-sets/" f"{set_id}/images) or send fewer")


def check_room(es: ExemplarSet, images: list[DecodedImage], limits: Limits) -> None:
    """Refuse (PoolFull) images that would not fit the pool as read now: a check before any work; ``add``
    decides for good."""
    msg = full_message(es.id, count=es.num_pool_images, nbytes=es.pool_bytes, adding=len(images),
                       adding_bytes=sum(len(im.data) for im in images), limits=limits)
    if msg is not None:
        raise PoolFull(msg)


def lock(session: Session, set_id: uuid.UUID) -> None:
    """Take the set's row lock for the rest of the transaction (a no-op UPDATE); SetGone for an unknown set."""
    res = session.execute(update(ExemplarSet).where(ExemplarSet.id == set_id)
                          .values(num_pool_images=ExemplarSet.num_pool_images)
                          .execution_options(synchronize_session=False))
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise SetGone(str(set_id))


def deleted_meanwhile(session: Session, store: BlobStore, set_id: uuid.UUID, error: BaseException) -> bool:
    """After an upload for the set failed with ``error`` (its transaction rolled back): whether the set was deleted
    meanwhile -- ``SetGone``, or a file write failing as the deletion removed the set's folder under it. Then what is
    left under the deleted set's folder (this request's files, the folders a write re-made) is removed too."""
    if not isinstance(error, SetGone | OSError):
        return False
    if not isinstance(error, SetGone):
        there = session.scalar(select(ExemplarSet.id).where(ExemplarSet.id == set_id))
        session.rollback()
        if there is not None:
            return False
    store.delete_tree(exemplar_set_prefix(set_id))
    return True


def add(session: Session, store: BlobStore, *, set_id: uuid.UUID, images: list[DecodedImage],
        limits: Limits) -> list[PoolImage]:
    """Store ``images`` in the set's pool and commit -> their rows, in upload order. All or nothing: PoolFull
    (the cap would be passed) or SetGone, and any other error, leave no row and no file of this call."""
    now = utcnow()
    rows: list[PoolImage] = []
    keys: list[str] = []
    try:
        for i, im in enumerate(images):
            image_id = uuid.uuid4()
            key = pool_image_key(set_id, image_id, im.ext)
            keys.append(key)
            sha = store.put(key, im.data)
            rows.append(PoolImage(id=image_id, exemplar_set_id=set_id, position=i, filename=im.filename,
                                  content_type=im.content_type, width=im.width, height=im.height,
                                  size=len(im.data), sha256=sha, blob=key, created_at=now))
        n, nbytes = len(rows), sum(r.size for r in rows)
        res = session.execute(
            update(ExemplarSet)
            .where(ExemplarSet.id == set_id, ExemplarSet.num_pool_images + n <= limits.max_images,
                   ExemplarSet.pool_bytes + nbytes <= limits.max_bytes)
            .values(num_pool_images=ExemplarSet.num_pool_images + n, pool_bytes=ExemplarSet.pool_bytes + nbytes)
            .execution_options(synchronize_session=False))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            now_held = session.execute(select(ExemplarSet.num_pool_images, ExemplarSet.pool_bytes)
                                       .where(ExemplarSet.id == set_id)).first()
            if now_held is None:
                raise SetGone(str(set_id))
            raise PoolFull(full_message(set_id, count=now_held[0], nbytes=now_held[1], adding=n, adding_bytes=nbytes,
                                        limits=limits) or "the set's image pool is full")
        session.add_all(rows)
        session.commit()
    except BaseException as e:
        session.rollback()
        if deleted_meanwhile(session, store, set_id, e):
            raise e if isinstance(e, SetGone) else SetGone(str(set_id)) from e
        for key in keys:
            store.delete(key)
        raise
    return rows


def list_images(session: Session, *, set_id: uuid.UUID, limit: int, offset: int) -> tuple[list[PoolImage], int]:
    where = PoolImage.exemplar_set_id == set_id
    count = session.scalar(select(func.count()).select_from(PoolImage).where(where)) or 0
    return list(session.scalars(select(PoolImage).where(where).order_by(*ORDER).limit(limit).offset(offset))), count


def _jobs_using(session: Session, image_ids: object) -> list[uuid.UUID]:
    stmt = (select(AdaptationJob.id).distinct().join(JobImage, JobImage.job_id == AdaptationJob.id)
            .where(JobImage.pool_image_id.in_(image_ids), AdaptationJob.status.not_in(FINISHED_STATES)))  # type: ignore[arg-type]
    return sorted(session.scalars(stmt))


def delete_images(session: Session, *, set_id: uuid.UUID, image_id: uuid.UUID | None = None) -> list[str] | None:
    """Delete one pool image (``image_id``) or all of the set's, in the caller's transaction -> the blob keys to
    delete once it commits; None when ``image_id`` is not in the pool. ImageInUse (nothing deleted) when a queued
    or running job took any of them; SetGone for an unknown set."""
    lock(session, set_id)
    where = [PoolImage.exemplar_set_id == set_id] + ([PoolImage.id == image_id] if image_id is not None else [])
    rows = session.execute(select(PoolImage.id, PoolImage.blob, PoolImage.size).where(*where)).all()
    if image_id is not None and not rows:
        return None
    ids = [r.id for r in rows]
    jobs = _jobs_using(session, select(PoolImage.id).where(*where))
    if jobs:
        what = "this pool image" if image_id is not None else "images of this pool"
        shown = ", ".join(str(j) for j in jobs[:5]) + (", ..." if len(jobs) > 5 else "")
        one = len(jobs) == 1
        raise ImageInUse(f"{_plural(len(jobs), 'queued or running adaptation job')} ({shown}) "
                         f"{'adapts' if one else 'adapt'} on {what}: it is kept until "
                         f"{'it ends' if one else 'they end'}; cancel {'it' if one else 'them'} "
                         "(POST /v1/adaptations/{job_id}/cancel) or wait, then delete again", jobs)
    if ids:
        # explicitly, so no backend's cascade order matters: finished jobs keep their rows, without the link
        session.execute(update(JobImage).where(JobImage.pool_image_id.in_(ids)).values(pool_image_id=None)
                        .execution_options(synchronize_session=False))
        session.execute(delete(PoolImage).where(PoolImage.id.in_(ids)).execution_options(synchronize_session=False))
        session.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(
            num_pool_images=ExemplarSet.num_pool_images - len(ids),
            pool_bytes=ExemplarSet.pool_bytes - sum(r.size for r in rows)).execution_options(synchronize_session=False))
    return [r.blob for r in rows]


def snapshot_into_job(session: Session, *, job: AdaptationJob, set_id: uuid.UUID) -> int:
    """Give the (uncommitted) ``job`` every image of the set's pool as it is now, after the job's own uploads ->
    how many. The job's ``job_images`` rows name the pool images (``pool_image_id``) and their files: images added
    later are not the job's, and the images it took are not deleted while it is queued or running."""
    lock(session, set_id)
    start = job.num_images
    rows = list(session.scalars(select(PoolImage).where(PoolImage.exemplar_set_id == set_id).order_by(*ORDER)))
    session.add_all([JobImage(job_id=job.id, position=start + i, filename=r.filename, content_type=r.content_type,
                              width=r.width, height=r.height, sha256=r.sha256, blob=r.blob, pool_image_id=r.id)
                     for i, r in enumerate(rows)])
    job.num_images = start + len(rows)
    job.num_pool_images = len(rows)
    return len(rows)
