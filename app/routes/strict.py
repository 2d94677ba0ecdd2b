"""Query parameters and form fields a route does not take are refused, not ignored; so is one value sent twice.

FastAPI drops what a route does not declare, so a misspelt ``?max_instance=4`` would answer with one box and no
word why, and ``-F lr=0.01`` would run a job at the default rate; and of ``?samples=1&samples=2`` it keeps one; an
empty form field (``-F iterations=``) it takes for an absent one.
``known_parameters`` (a dependency of the v1 routers, ``app.main``) answers 422 naming the unknown names and listing
the ones the route takes, or naming a parameter or field given more than once that takes one value, or a form field
sent empty or in bytes that are not text in the body's charset (``app.forms``). Form fields are
checked on routes that take a form (a form sent to one that takes none is not read); a body of another type sent to
one of them (JSON, say) is a 415 saying it takes multipart/form-data. Label Studio's routes (its
own protocol, whose callers add what they like) and the health probes are left as they are."""

from __future__ import annotations

from fastapi import HTTPException, Request, params, status
from fastapi._compat import field_annotation_is_sequence
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.datastructures import FormData

from app.routes.errors import invalid

UNKNOWN_PARAMETER = {422: invalid("Invalid fields or parameters, or one the route does not take (named in the "
                                  "message, with the ones it takes)")}
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def _names(dependant: Dependant) -> tuple[set[str], set[str], set[str]]:
    """The query parameters and body fields of ``dependant`` and of its sub-dependencies, by their aliases, and those
    of them that take several values (a list: ``files``)."""
    fields = [*dependant.query_params, *dependant.body_params]
    query, body = {p.alias for p in dependant.query_params}, {p.alias for p in dependant.body_params}
    lists = {p.alias for p in fields if field_annotation_is_sequence(p.field_info.annotation)}
    for sub in dependant.dependencies:
        q, b, m = _names(sub)
        query |= q
        body |= b
        lists |= m
    return query, body, lists


def _declared(route: APIRoute) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The route's query parameters, body (form) fields and those of either that take several values, by the names
    a client sends. Worked out on each request (~50 us on the largest route): a route object is shared by every app
    that includes its router, so a value kept on it would outlive the app that computed it."""
    query, body, lists = _names(route.dependant)
    return frozenset(query), frozenset(body), frozenset(lists)


def _refuse(kind: str, unknown: list[str], known: frozenset[str], route: APIRoute, method: str) -> HTTPException:
    names = ", ".join(repr(n) for n in unknown)
    takes = ", ".join(sorted(known)) if known else "none"
    plural = "s" if len(unknown) > 1 else ""
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                         f"unknown {kind}{plural} {names}: {method} {route.path} takes {kind}s: {takes}")


async def known_parameters(request: Request) -> None:
    """422 if the request has a query parameter, or a form field, that its route does not declare."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    query, body, lists = _declared(route)
    ctype = request.headers.get("content-type", "").lower()
    if body and _takes_a_form(route) and not ctype.startswith(FORMS) and _has_body(request):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, (
            f"{request.method} {route.path} takes multipart/form-data (curl -F files=@image.png -F name=value), got "
            f"{ctype.split(';')[0] or 'a body without a Content-Type'}"))
    if body and not _takes_a_form(route) and _has_body(request) and not ctype.startswith("application/json"):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, (
            f"{request.method} {route.path} takes a JSON body (Content-Type: application/json; curl -H "
            f"'Content-Type: application/json' -d '{{...}}'), got {ctype.split(';')[0] or 'no Content-Type'}"))
    if ctype.startswith("application/x-www-form-urlencoded") and any(  # a route that needs files (a job need not)
            isinstance(p.field_info, params.File) and p.field_info.is_required() for p in route.dependant.body_params):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, (
            f"{request.method} {route.path} takes files: send multipart/form-data (curl -F files=@image.png -F "
            "name=value), not an urlencoded form (curl -d), which cannot carry files"))
    unknown = sorted(set(request.query_params) - query)
    if unknown:
        raise _refuse("query parameter", unknown, query, route, request.method)
    _once("query parameter", request.query_params.multi_items(), lists)
    if body and ctype.startswith(FORMS):
        form = await request.form()  # parsed already by FastAPI (it closes its files): the same object, cached
        unknown = sorted(set(form) - body)
        if unknown:
            raise _refuse("form field", unknown, body, route, request.method)
        _once("form field", form.multi_items(), lists)
        _filled(form.multi_items(), route)
        _text(form, route)


def _takes_a_form(route: APIRoute) -> bool:
    """Whether the route's body is a form (files and form fields), not JSON."""
    return all(isinstance(p.field_info, params.Form) for p in route.dependant.body_params)


def _has_body(request: Request) -> bool:
    return request.headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in request.headers


def _filled(items: list[tuple[str, object]], route: APIRoute) -> None:
    """422 if a form field is sent empty (``-F iterations=``): FastAPI would take it for an absent field and use the
    default, so a script's unset variable would run a 200-iteration job with no word why. An empty file field
    (no default to fall back on) is a file left out."""
    for name, value in items:
        if isinstance(value, str) and not value.strip():
            files = {p.alias for p in route.dependant.body_params if isinstance(p.field_info, params.File)}
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, (
                f"form field {name!r} is empty: attach a file (curl -F '{name}=@image.png')" if name in files else
                f"form field {name!r} is empty: give it a value, or leave it out for its default"))


def _text(form: FormData, route: APIRoute) -> None:
    """422 if a text field's bytes were not valid in the body's charset, or the charset is one Python does not know
    (``app.forms``: Starlette would read them as Latin-1). A file field sent without a filename is a text part too:
    the route says so in its own words."""
    files = {p.alias for p in route.dependant.body_params if isinstance(p.field_info, params.File)}
    charset = getattr(form, "unknown_charset", None)
    text = [name for name, value in form.multi_items() if isinstance(value, str) and name not in files]
    if charset is not None and text:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, (
            f"the body's Content-Type names charset {charset!r}, which is not known, so form field {text[0]!r} cannot "
            "be read: send the form as UTF-8 (leave the charset parameter out)"))
    for name, why in getattr(form, "not_text", {}).items():
        if name not in files:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"form field {name!r} is {why}: send it UTF-8 encoded")


def _once(kind: str, items: list[tuple[str, object]], lists: frozenset[str]) -> None:
    """422 if a name that takes one value (not in ``lists``) comes more than once among ``items``."""
    seen: set[str] = set()
    for name, _ in items:
        if name in seen and name not in lists:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"{kind} {name!r} given more than once: it takes one value (send it once)")
        seen.add(name)
