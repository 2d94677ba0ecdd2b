"""The model bundles this server can serve: their names and the default (what an exemplar set's ``bundle`` takes)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.bundle_choice import installed_photo_default
from app.deps import BundlesDep, CallerDep, SettingsDep
from app.routes.errors import UNAUTHORIZED

router = APIRouter(prefix="/v1", tags=["bundles"], responses=UNAUTHORIZED)


class BundlePublic(BaseModel):
    name: str = Field(description="The bundle's name: a set's `bundle` form field")
    default: bool = Field(description="The bundle a new exemplar set gets when it names none (but for photos)")


class BundlesPublic(BaseModel):
    data: list[BundlePublic] = Field(description="The bundles installed now, by name (files are not loaded)")
    default: str = Field(description="The server's default bundle (QLOC_DEFAULT_BUNDLE); it may be missing")
    default_photo: str | None = Field(description=(
        "The bundle a set naming none gets when its exemplar crops look like photos (in continuous tones, or in color "
        "and 100 pixels or more; QLOC_DEFAULT_PHOTO_BUNDLE), if installed; null: none is (such sets get `default`)"))


@router.get("/bundles", response_model=BundlesPublic)
def list_bundles(settings: SettingsDep, bundles: BundlesDep, caller: CallerDep) -> BundlesPublic:
    """The bundles installed in the server's bundle directory (read at each request), and the defaults a set naming
    none gets (``app.bundle_choice``)."""
    del caller  # authenticates only: every caller sees the same bundles
    names = bundles.names()
    return BundlesPublic(data=[BundlePublic(name=n, default=n == settings.default_bundle) for n in names],
                         default=settings.default_bundle,
                         default_photo=installed_photo_default(settings.default_photo_bundle, names))
