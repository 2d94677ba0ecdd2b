"""An exemplar set's image pool: add unlabeled images over many requests (capped), list, delete.

Adaptation jobs use the pool with ``source=pool|both`` (``app.routes.adaptations``); localize adds its images
with ``keep=true`` (``app.routes.localize``). The rules live in ``app.pool``.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Response, UploadFile, status
from sqlalchemy.orm import Session

from app import crud, pool
from app.config import Settings
from app.deps import CallerDep, Limit, Offset, PoolImageId, SessionDep, SetId, SettingsDep, StoreDep
from app.images import DecodedImage
from app.routes.errors import UNAUTHORIZED, UPLOAD_ERRORS, error, invalid
from app.routes.uploads import read_images
from app.schemas import PoolImagePublic, PoolImagesAdded, PoolImagesPublic
from app.storage import BlobStore
from app.tables import ExemplarSet

router = APIRouter(prefix="/v1/exemplar-sets", tags=["image pool"], responses=UNAUTHORIZED)

NOT_FOUND = "exemplar set not found"
FULL = error("The pool would pass its cap (QLOC_MAX_POOL_IMAGES images or QLOC_MAX_POOL_BYTES bytes): nothing of "
             "the request was stored; delete pool images or send fewer")
IN_USE = error("A queued or running adaptation job took the image(s): nothing was deleted; cancel the job or wait")


def limits(settings: Settings) -> pool.Limits:
    return pool.Limits(settings.max_pool_images, settings.max_pool_bytes)


def get_set(session: Session, set_id: uuid.UUID, scope: str | None) -> ExemplarSet:
    es = crud.get_exemplar_set(session, set_id=set_id, owner=scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    return es


def add_to_pool(session: Session, store: BlobStore, settings: Settings, es: ExemplarSet,
                images: list[DecodedImage]) -> list[PoolImagePublic]:
    """Store ``images`` in the set's pool (all or none) -> their public rows; 409 past the cap, 404 if the set
    was deleted meanwhile. Ends the caller's transaction."""
    set_id = es.id
    session.commit()  # end the read transaction while files are written
    try:
        rows = pool.add(session, store, set_id=set_id, images=images, limits=limits(settings))
    except pool.PoolFull as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    except pool.SetGone as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND) from e
    return [PoolImagePublic.model_validate(r) for r in rows]


def state(session: Session, settings: Settings, set_id: uuid.UUID) -> dict[str, int]:
    es = session.get(ExemplarSet, set_id, populate_existing=True)
    session.commit()
    return {"num_pool_images": es.num_pool_images if es else 0, "pool_bytes": es.pool_bytes if es else 0,
            "max_pool_images": settings.max_pool_images, "max_pool_bytes": settings.max_pool_bytes}


@router.post("/{set_id}/images", status_code=status.HTTP_201_CREATED, response_model=PoolImagesAdded, responses={
    **UPLOAD_ERRORS, 404: error("Unknown exemplar set"), 409: FULL,
    422: invalid("Invalid fields, no file, or a field the route does not take")})
def add_pool_images(
    set_id: SetId, session: SessionDep, settings: SettingsDep, store: StoreDep, caller: CallerDep,
    files: Annotated[list[UploadFile], File(min_length=1, description=(
        "Unlabeled PNG/JPEG/WebP images of the kind the set's object appears in (as many per request as other uploads "
        "allow: QLOC_MAX_FILES_PER_REQUEST)"))],
) -> PoolImagesAdded:
    """Add unlabeled images to the set's pool, for adaptation jobs (`source=pool` or `both`).

    Fill a pool over as many requests as needed, up to QLOC_MAX_POOL_IMAGES images (default 2000) and
    QLOC_MAX_POOL_BYTES bytes (default 1 GiB) per set. A request that would pass either cap is refused whole
    with 409, and nothing of it is stored; every file is checked (as for other uploads) before anything is.
    The images are deleted with the set."""
    es = get_set(session, set_id, caller.scope)
    images = read_images(files, settings)
    try:
        pool.check_room(es, images, limits(settings))  # before writing files; add() decides for good
    except pool.PoolFull as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    added = add_to_pool(session, store, settings, es, images)
    return PoolImagesAdded(data=added, **state(session, settings, set_id))


@router.get("/{set_id}/images", response_model=PoolImagesPublic, responses={404: error("Unknown exemplar set")})
def list_pool_images(set_id: SetId, session: SessionDep, settings: SettingsDep, caller: CallerDep,
                     limit: Limit = 50, offset: Offset = 0) -> PoolImagesPublic:
    """The set's pool, oldest first (in upload order within a request); `count` is the pool's size."""
    get_set(session, set_id, caller.scope)
    rows, count = pool.list_images(session, set_id=set_id, limit=limit, offset=offset)
    data = [PoolImagePublic.model_validate(r) for r in rows]
    return PoolImagesPublic(data=data, count=count, limit=limit, offset=offset, **state(session, settings, set_id))


def _delete(session: Session, store: BlobStore, set_id: uuid.UUID, image_id: uuid.UUID | None) -> None:
    try:
        keys = pool.delete_images(session, set_id=set_id, image_id=image_id)
    except pool.ImageInUse as e:
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
    except pool.SetGone as e:
        session.rollback()
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND) from e
    if keys is None:
        session.rollback()
        raise HTTPException(status.HTTP_404_NOT_FOUND, "image not found in this set's pool")
    session.commit()
    for key in keys:  # rows first, then files
        store.delete(key)


@router.delete("/{set_id}/images/{image_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses={404: error("Unknown exemplar set, or an image not in its pool"), 409: IN_USE})
def delete_pool_image(set_id: SetId, image_id: PoolImageId, session: SessionDep, store: StoreDep,
                      caller: CallerDep) -> Response:
    """Delete one image of the pool (row, then file). An image that a queued or running job took is kept
    until the job ends (409): the job reads it."""
    get_set(session, set_id, caller.scope)
    session.commit()
    _delete(session, store, set_id, image_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.delete("/{set_id}/images", status_code=status.HTTP_204_NO_CONTENT,
               responses={404: error("Unknown exemplar set"), 409: IN_USE})
def delete_pool(set_id: SetId, session: SessionDep, store: StoreDep, caller: CallerDep) -> Response:
    """Empty the pool. All or nothing: while a queued or running job holds any of its images, nothing is
    deleted (409)."""
    get_set(session, set_id, caller.scope)
    session.commit()
    _delete(session, store, set_id, None)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
