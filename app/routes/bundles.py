"""The model bundles this server can serve: their names and the default (what an exemplar set's ``bundle`` takes)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.deps import BundlesDep, CallerDep, SettingsDep
from app.routes.errors import UNAUTHORIZED

router = APIRouter(prefix="/v1", tags=["bundles"], responses=UNAUTHORIZED)


class BundlePublic(BaseModel):
    name: str = Field(description="The bundle's name: a set's `bundle` form field")
    default: bool = Field(description="The bundle a new exemplar set gets when it names none")


class BundlesPublic(BaseModel):
    data: list[BundlePublic] = Field(description="The bundles installed now, by name (files are not loaded)")
    default: str = Field(description="The server's default bundle (QLOC_DEFAULT_BUNDLE); it may be missing")


@router.get("/bundles", response_model=BundlesPublic)
def list_bundles(settings: SettingsDep, bundles: BundlesDep, caller: CallerDep) -> BundlesPublic:
    """The bundles installed in the server's bundle directory (read at each request), and the default."""
    del caller  # authenticates only: every caller sees the same bundles
    return BundlesPublic(data=[BundlePublic(name=n, default=n == settings.default_bundle) for n in bundles.names()],
                         default=settings.default_bundle)
