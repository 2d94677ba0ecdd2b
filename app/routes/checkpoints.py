"""Checkpoints: list a set's, read one (lineage, iteration, sha256, metrics), activate one (rollback)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from app import crud
from app.deps import CallerDep, SessionDep
from app.routes.errors import UNAUTHORIZED, error
from app.routes.exemplar_sets import to_public as set_to_public
from app.schemas import CheckpointPublic, CheckpointsPublic, ExemplarSetPublic
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
def list_checkpoints(set_id: uuid.UUID, session: SessionDep, caller: CallerDep,
                     limit: Annotated[int, Query(ge=1, le=200)] = 50,
                     offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> CheckpointsPublic:
    """The set's checkpoints, oldest first: its base policy, then those its jobs wrote."""
    es = crud.get_exemplar_set(session, set_id=set_id, owner=caller.scope)
    if es is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "exemplar set not found")
    ckpts, count = crud.list_checkpoints(session, set_id=set_id, limit=limit, offset=offset)
    return CheckpointsPublic(data=[to_public(c, es.active_checkpoint_id) for c in ckpts], count=count, limit=limit,
                             offset=offset)


@router.get("/checkpoints/{checkpoint_id}", response_model=CheckpointPublic,
            responses={404: error("Unknown checkpoint")})
def read_checkpoint(checkpoint_id: uuid.UUID, session: SessionDep, caller: CallerDep) -> CheckpointPublic:
    ckpt = crud.get_checkpoint(session, checkpoint_id=checkpoint_id, owner=caller.scope)
    if ckpt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    es = crud.get_exemplar_set(session, set_id=ckpt.exemplar_set_id, owner=caller.scope)
    return to_public(ckpt, es.active_checkpoint_id if es else None)


@router.post("/checkpoints/{checkpoint_id}/activate", response_model=ExemplarSetPublic,
             responses={404: error("Unknown checkpoint")})
def activate_checkpoint(checkpoint_id: uuid.UUID, session: SessionDep, caller: CallerDep) -> ExemplarSetPublic:
    """Make the checkpoint its set's active policy; activating an older one rolls back."""
    ckpt = crud.get_checkpoint(session, checkpoint_id=checkpoint_id, owner=caller.scope)
    if ckpt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, NOT_FOUND)
    es = crud.activate_checkpoint(session, checkpoint=ckpt)
    session.commit()
    return set_to_public(es)
