"""Checkpoints: list a set's, read one (lineage, iteration, sha256, metrics), activate one (rollback), delete one."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, HTTPException, Response, status
from sqlalchemy.orm import Session

from app import crud, pool
from app.deps import Caller, CallerDep, CheckpointId, Limit, Offset, SessionDep, SetId, StoreDep
from app.retention import remove_checkpoints
from app.routes.errors import UNAUTHORIZED, error
from app.routes.exemplar_sets import to_public as set_to_public
from app.schemas import CheckpointPublic, CheckpointsPublic, ExemplarSetPublic
from app.storage import BlobStore
from app.tables import Checkpoint

router = APIRouter(prefix="/v1", tags=["checkpoints"], responses=UNAUTHORIZED)

NOT_FOUND = "checkpoint not found"


def to_public(ckpt: Checkpoint, active_id: uuid.UUID | None) -> CheckpointPublic:
    return CheckpointPublic(id=ckpt.id, exemplar_set_id=ckpt.exemplar_set_id, parent_id=ckpt.parent_id,
                            job_id=ckpt.job_id, kind=ckpt.kind, iteration=ckpt.iteration,  # type: ignore[arg-type]
                            sha256=ckpt.sha256, metrics=ckpt.metrics or {}, active=ckpt.id == active_id,
                            created_at=ckpt.created_at)


@router.get("/exemplar-sets/{set_id}/checkpoints", response_model=CheckpointsPublic,
            responses={404: error("Unknown exemplar set")})
def list_checkpoints(set_id: SetId, session: SessionDep, caller: CallerDep,
                     limit: Limit = 50, offset: Offset = 0) -> CheckpointsPublic:
    """The set's checkpoints, oldest first: its base policy, then those its jobs wrote."""
    return checkpoints_of(set_id, session, caller, limit, offset)


def checkpoints_of(set_id: uuid.UUID, session: Session, caller: Caller, limit: int, offset: int) -> CheckpointsPublic:
    """``list_checkpoints``' page: 404 for another key's or no set; ``active`` marks the set's active one."""
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    ckpts, count = crud.list_checkpoints(session, set_id=set_id, limit=limit, offset=offset)
    return CheckpointsPublic(data=[to_public(c, es.active_checkpoint_id) for c in ckpts], count=count, limit=limit,
                             offset=offset)


@router.get("/checkpoints/{checkpoint_id}", response_model=CheckpointPublic,
            responses={404: error("Unknown checkpoint")})
def read_checkpoint(checkpoint_id: CheckpointId, session: SessionDep, caller: CallerDep) -> CheckpointPublic:
    return checkpoint_of(checkpoint_id, session, caller)


def checkpoint_of(checkpoint_id: uuid.UUID, session: Session, caller: Caller) -> CheckpointPublic:
    """``read_checkpoint``'s answer: 404 for another key's or no checkpoint."""
    ckpt = crud.get_checkpoint(session, checkpoint_id=checkpoint_id, owner=caller.scope)
    if ckpt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    es = crud.get_exemplar_set(session, set_id=ckpt.exemplar_set_id, owner=caller.scope)
    return to_public(ckpt, es.active_checkpoint_id if es else None)


@router.post("/checkpoints/{checkpoint_id}/activate", response_model=ExemplarSetPublic,
             responses={404: error("Unknown checkpoint")})
def activate_checkpoint(checkpoint_id: CheckpointId, session: SessionDep, caller: CallerDep) -> ExemplarSetPublic:
    """Make the checkpoint its set's active policy; activating an older one rolls back."""
    return activated(checkpoint_id, session, caller)


def activated(checkpoint_id: uuid.UUID, session: Session, caller: Caller) -> ExemplarSetPublic:
    """``activate_checkpoint``: under the set's lock, 404 for another key's checkpoint or one deleted meanwhile."""
    ckpt = crud.get_checkpoint(session, checkpoint_id=checkpoint_id, owner=caller.scope)
    if ckpt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    locked(session, ckpt.exemplar_set_id)  # a deletion of this checkpoint waits, or has happened
    es = crud.activate_checkpoint(session, checkpoint=ckpt)
    if es is None:
        session.rollback()
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    session.commit()
    return set_to_public(es)


@router.delete("/checkpoints/{checkpoint_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses={404: error("Unknown checkpoint"),
                          409: error("The set's base or active checkpoint, or one a queued or running job starts "
                                     "from or wrote")})
def delete_checkpoint(checkpoint_id: CheckpointId, session: SessionDep, caller: CallerDep, store: StoreDep) -> Response:
    """Delete an adapted checkpoint and its file, to free storage. Its children keep their lineage through its parent;
    jobs that named it keep their record (their `checkpoint_id` becomes null). The set's base policy, its active
    checkpoint and those of unfinished jobs are refused (409 saying which). A head file its job stored apart goes
    when no checkpoint of the set uses it any more (one written since a job of the set still unfinished began, at
    a later deletion)."""
    removed(checkpoint_id, session, caller, store)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def removed(checkpoint_id: uuid.UUID, session: Session, caller: Caller, store: BlobStore) -> None:
    """``delete_checkpoint``: under the set's lock, 404 for another key's or no checkpoint, 409 saying why one is in
    use; else its row, then its files."""
    ckpt = crud.get_checkpoint(session, checkpoint_id=checkpoint_id, owner=caller.scope)
    if ckpt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    set_id = ckpt.exemplar_set_id
    locked(session, set_id)  # no activation of it, no job from it, while this decides
    session.refresh(ckpt)
    why = crud.checkpoint_in_use(session, checkpoint=ckpt)
    if why is not None:
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, f"checkpoint {checkpoint_id} cannot be deleted: {why}")
    remove_checkpoints(session, store, set_id, [ckpt])


def locked(session: Session, set_id: uuid.UUID) -> None:
    try:
        pool.lock(session, set_id)
    except pool.SetGone as e:
        session.rollback()
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND) from e
