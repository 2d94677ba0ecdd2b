"""Label Studio's side of the ML backend protocol: its label config, its task images, its address and token.

``app/routes/labelstudio.py`` serves the protocol; this module holds what does not need FastAPI:

- ``parse_label_config``: the project's XML config -> which ``RectangleLabels`` tag, image and label to answer
  with (stdlib ``xml.etree``; a config with a DOCTYPE or entities is refused, never expanded);
- ``ImageFetcher``: a task's image bytes from an ``http(s)`` URL, a Label Studio path (``/data/upload/...``,
  fetched from Label Studio with its token), a cloud storage URI (``s3://``..., read through Label Studio's
  resolver) or a ``data:`` URI; bounded in time and size, refusals as ``Refused`` (status + message), never a
  500;
- ``Access``: the Label Studio address and token, and the backend's ``max_instances`` (what ``/setup`` gave, kept
  per exemplar set and project in the database: ``app.tables.LabelStudioSetup``).
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import urllib.parse
import xml.etree.ElementTree as ET  # noqa: N817 -- the stdlib's usual name
from dataclasses import dataclass

import httpx

TRAIN_ACTIONS = frozenset({"START_TRAINING"})
"""Webhook actions that start an adaptation job. Label Studio turns annotation submissions into START_TRAINING
itself (every N annotations, when the project's "Start model training on annotation submission" is on), so
ANNOTATION_CREATED and the other events its project webhook sends are acknowledged and ignored."""

MAX_SHOWN_URL = 120
STORAGE_SCHEMES = frozenset({"s3", "gs", "azure-blob", "azure-spi"})
"""Cloud storage URIs of Label Studio's source storages: read through Label Studio (``/tasks/{id}/resolve/``)."""


class Refused(Exception):  # noqa: N818 -- a verdict, not a crash
    """A request qloc cannot serve: answered with ``status`` and ``detail``."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


# --- the label config


@dataclass(frozen=True)
class Target:
    """What a prediction fills in: the RectangleLabels tag (``from_name``), its image (``to_name``), the task
    data key of that image (``image_key``, from ``<Image value="$key">``) and the label given to the box."""

    from_name: str
    to_name: str
    image_key: str
    label: str


def _local(tag: object) -> str:
    """A tag's name, lower case (Label Studio's tags are case-insensitive)."""
    return tag.lower() if isinstance(tag, str) else ""


def parse_label_config(config: str, *, set_name: str | None) -> Target:
    """The ``RectangleLabels`` of the config that qloc answers with; ``Refused(422)`` with the reason otherwise.

    The label is the one named like the exemplar set (case-insensitive); without such a label, a config with
    exactly one RectangleLabels tag holding exactly one label uses that label."""
    if not isinstance(config, str) or not config.strip():
        raise Refused(422, "the labeling config is empty (/setup's `schema`, a task's `label_config`): Label Studio "
                           "sends the project's; it needs a <RectangleLabels> tag on an <Image>")
    if "<!DOCTYPE" in config.upper() or "<!ENTITY" in config.upper():
        raise Refused(422, "label_config must not contain a DOCTYPE or entities")
    try:
        root = ET.fromstring(config)
    except (ET.ParseError, ValueError) as e:
        raise Refused(422, f"label_config is not valid XML: {e}") from e
    images = {el.get("name"): el for el in root.iter() if _local(el.tag) == "image" and el.get("name")}
    candidates: list[tuple[str, str, str, list[str]]] = []
    for el in root.iter():
        if _local(el.tag) != "rectanglelabels":
            continue
        name, to_name = el.get("name"), (el.get("toName") or "").split(",")[0].strip()
        if not name or to_name not in images:
            continue
        value = images[to_name].get("value") or ""
        if not value.startswith("$") or len(value) < 2:
            raise Refused(422, f'label_config: <Image name="{to_name}"> has value={value!r}; qloc needs a task data '
                               'key, like value="$image"')
        labels = [lab.get("value") or "" for lab in el if _local(lab.tag) == "label" and lab.get("value")]
        candidates.append((name, to_name, value[1:], labels))
    if not candidates:
        raise Refused(422, "label_config has no <RectangleLabels> tag whose toName is an <Image>: qloc predicts "
                           'bounding boxes, e.g. <Image name="image" value="$image"/> <RectangleLabels name="label" '
                           'toName="image"><Label value="object"/></RectangleLabels>')
    if set_name:
        for name, to_name, key, labels in candidates:
            for label in labels:
                if label.strip().lower() == set_name.strip().lower():
                    return Target(name, to_name, key, label)
    if len(candidates) == 1 and len(candidates[0][3]) == 1:
        name, to_name, key, labels = candidates[0]
        return Target(name, to_name, key, labels[0])
    shown = sorted({label for c in candidates for label in c[3]})
    raise Refused(422, (
        f"label_config: cannot tell which label the exemplar set ({set_name or 'unnamed'!s}) is: its labels are "
        f"{shown}; name the exemplar set like one of them (case does not matter), or use one RectangleLabels tag "
        "with one label"))


# --- where Label Studio is, and its token


@dataclass(frozen=True)
class Access:
    """Label Studio's base URL and token (either may be unknown), and the backend's ``max_instances`` (its
    "extra params" in Label Studio's model settings: regions per task)."""

    url: str | None = None
    token: str | None = None
    max_instances: int = 1


def project_id(project: object) -> str:
    """Label Studio's project: ``"12.1712345678"`` in /setup and /predict (id.created-timestamp), a dict with
    ``id`` in webhooks -> ``"12"``."""
    if isinstance(project, dict):
        project = project.get("id")
    if isinstance(project, bool) or project is None:
        return ""
    return str(project).split(".", 1)[0].strip()[:64]


def merged(configured_url: str | None, configured_token: str | None, remembered: Access) -> Access:
    """The settings win over what /setup gave; either may fill in for the other's gap."""
    url = configured_url or remembered.url
    return Access(url.rstrip("/") if url else None, configured_token or remembered.token, remembered.max_instances)


def max_instances_of(extra_params: object, limit: int) -> int:
    """``max_instances`` from /setup's ``extra_params`` (a JSON object, or its text) -> 1..``limit`` (1 when absent);
    ``Refused`` (422) for a value that is not such a number."""
    if isinstance(extra_params, str):
        if not extra_params.strip():
            return 1
        try:
            extra_params = json.loads(extra_params)
        except ValueError as e:
            raise Refused(422, "extra_params must be a JSON object, e.g. {\"max_instances\": 4}") from e
    if extra_params is None:
        return 1
    if not isinstance(extra_params, dict):
        raise Refused(422, "extra_params must be a JSON object, e.g. {\"max_instances\": 4}")
    k = extra_params.get("max_instances", 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limit:
        raise Refused(422, f"extra_params.max_instances must be a whole number from 1 to {limit}, got {k!r}")
    return k


# --- fetching task images


def shown(url: str) -> str:
    """A URL as messages show it: no query (it may hold a signature), at most MAX_SHOWN_URL characters."""
    if url.startswith("data:"):
        return url[:30] + "..."
    parts = urllib.parse.urlsplit(url)
    out = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return out if len(out) <= MAX_SHOWN_URL else out[:MAX_SHOWN_URL - 3] + "..."


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class HostRefused(Exception):
    """A fetch (or a redirect) to a host ``ImageFetcher.hosts`` does not hold."""


class ImageFetcher:
    """Task images for one request: ``fetch(url, where)`` -> bytes, or ``Refused`` naming ``where`` (the task).

    ``http``/``https`` URLs are fetched (redirects followed, at most 5; the token is sent only to Label Studio's
    own origin, and httpx drops it on a redirect elsewhere); a path starting with ``/`` is Label Studio's and is
    fetched from ``access.url`` with its token; ``data:`` URIs are decoded. At most ``max_bytes`` per image,
    ``timeout`` seconds per connect and per read. Use as a context manager (it holds one HTTP client)."""

    def __init__(self, access: Access, *, max_bytes: int, timeout: float, hosts: list[str] | None = None):
        self.access = access
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.hosts = None if hosts is None else {h.lower() for h in hosts}
        self._client = httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=5,
                                    headers={"User-Agent": "qloc-labelstudio"},
                                    event_hooks={"request": [self._allowed]})
        self._auth: dict[str, str] | None = None
        self._auth_lock = threading.Lock()

    def __enter__(self) -> ImageFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def close(self) -> None:
        self._client.close()

    def _allowed(self, request: httpx.Request) -> None:
        """Every request the client sends (redirects too): refused unless its host is Label Studio's or among
        ``hosts`` (``QLOC_LABELSTUDIO_FETCH_HOSTS``; ``None``: any)."""
        if self.hosts is None:
            return
        url = request.url
        if self.access.url is not None and _origin(str(url)) == _origin(self.access.url):
            return
        host = (url.host or "").lower()
        if host in self.hosts or f"{host}:{url.port}" in self.hosts:
            return
        raise HostRefused(f"{url.scheme}://{url.netloc.decode()} is not among QLOC_LABELSTUDIO_FETCH_HOSTS")

    def _too_large(self, where: str) -> Refused:
        return Refused(413, f"{where}: the image is larger than {self.max_bytes} bytes")

    def _auth_headers(self, where: str) -> dict[str, str]:
        """Label Studio's auth header: ``Token <legacy token>``, or a personal access token (a JWT refresh token)
        exchanged once per request for an access token (``Bearer``)."""
        token = self.access.token
        if not token:
            return {}
        with self._auth_lock:
            if self._auth is None:
                if _looks_like_jwt(token):
                    url = f"{self.access.url}/api/token/refresh/"
                    try:
                        r = self._client.post(url, json={"refresh": token})
                        access = r.json().get("access") if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError, AttributeError) as e:
                        raise Refused(422, f"{where}: cannot exchange the Label Studio personal access token at "
                                           f"{shown(url)}: {type(e).__name__}: {e}") from e
                    if not isinstance(access, str):
                        raise Refused(422, f"{where}: Label Studio refused the personal access token "
                                           f"({shown(url)} answered {r.status_code})")
                    self._auth = {"Authorization": f"Bearer {access}"}
                else:
                    self._auth = {"Authorization": f"Token {token}"}
            return self._auth

    def resolve(self, url: object, where: str, task_id: int | None = None) -> tuple[str, bool]:
        """The absolute URL to fetch and whether it is Label Studio's (the token goes with it). A cloud storage
        URI (``s3://``, ``gs://``, ``azure-blob://``) is read through Label Studio's resolver for its task, which
        redirects to a signed URL or proxies the file."""
        if not isinstance(url, str) or not url.strip():
            raise Refused(422, f"{where}: the image URL is empty or not a string")
        url = url.strip()
        if url.startswith("/") and not url.startswith("//"):
            if not self.access.url:
                raise Refused(422, (
                    f"{where}: {shown(url)} is a Label Studio path, and Label Studio's address is unknown: connect "
                    "qloc as the project's ML backend (its /setup call gives the address; set Label Studio's HOST), "
                    "or set QLOC_LABELSTUDIO_URL"))
            return self.access.url + url, True
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in STORAGE_SCHEMES:
            if not self.access.url or task_id is None:
                raise Refused(422, (
                    f"{where}: {shown(url)} is in cloud storage, read through Label Studio, whose address is "
                    "unknown: connect qloc as the project's ML backend, or set QLOC_LABELSTUDIO_URL"))
            fileuri = base64.urlsafe_b64encode(url.encode()).decode()
            return f"{self.access.url}/tasks/{task_id}/resolve/?fileuri={fileuri}", True
        if scheme not in ("http", "https"):
            raise Refused(422, (f"{where}: {shown(url)}: only http(s) URLs, Label Studio paths (/data/...), cloud "
                                f"storage URIs and data: URIs are read, not {scheme or 'relative'!s} ones"))
        same = self.access.url is not None and _origin(url) == _origin(self.access.url)
        return url, same

    def fetch(self, url: object, where: str, task_id: int | None = None) -> bytes:
        if isinstance(url, str) and url.strip()[:5].lower() == "data:":
            return self._data_uri(url.strip(), where)
        full, to_label_studio = self.resolve(url, where, task_id)
        headers = self._auth_headers(where) if to_label_studio else {}
        try:
            with self._client.stream("GET", full, headers=headers) as r:
                if r.status_code != 200:
                    hint = (" (Label Studio's token is missing or refused: check QLOC_LABELSTUDIO_API_KEY or its "
                            "legacy tokens)") if to_label_studio and r.status_code in (401, 403) else ""
                    raise Refused(422, f"{where}: GET {shown(full)} answered {r.status_code}{hint}")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise self._too_large(where)
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > self.max_bytes:
                        raise self._too_large(where)
                return bytes(buf)
        except HostRefused as e:
            raise Refused(422, f"{where}: {shown(full)}: {e} (the hosts task images may come from, besides Label "
                               "Studio's own address)") from e
        except httpx.TimeoutException as e:
            raise Refused(422, f"{where}: {shown(full)} did not answer within {self.timeout:g} s") from e
        except httpx.HTTPError as e:
            raise Refused(422, f"{where}: cannot fetch {shown(full)}: {type(e).__name__}: {e}") from e

    def _data_uri(self, url: str, where: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise Refused(422, f"{where}: a data: URI needs a comma before its data")
        is_base64 = header.lower().endswith(";base64")
        if len(payload) > (self.max_bytes * 4 // 3 if is_base64 else self.max_bytes * 3) + 12:  # before decoding
            raise self._too_large(where)
        try:
            if is_base64:
                data = base64.b64decode("".join(payload.split()), validate=True)
            else:
                data = urllib.parse.unquote_to_bytes(payload)
        except (binascii.Error, ValueError) as e:
            raise Refused(422, f"{where}: the data: URI is not valid base64 ({e})") from e
        if len(data) > self.max_bytes:
            raise self._too_large(where)
        return data
