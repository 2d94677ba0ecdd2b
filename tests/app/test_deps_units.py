"""``app.deps`` by value: who a request's API key makes its caller, and what rows record as their owner. Through
HTTP (every route, both headers, the 401's header): ``test_app_auth.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from fastapi.security import HTTPAuthorizationCredentials
from service_fixtures import refusal

from app.deps import Caller, Serving, get_caller, get_serving, owner_of

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
MISSING = "missing or invalid API key (X-API-Key or Bearer)"


def keyed(*keys: str) -> SimpleNamespace:
    return SimpleNamespace(api_keys=list(keys), auth_enabled=bool(keys))


def bearer(key: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=key)


def test_rows_record_a_digest_of_the_key_never_the_key():
    assert owner_of(KEY_A) == hashlib.sha256(b"key-a-0123456789abcdef").hexdigest()[:32]
    assert len(owner_of(KEY_A)) == 32 and owner_of(KEY_A) != owner_of(KEY_B)
    accented = "\u00e9t\u00e9-key-0123456789"  # UTF-8 bytes hashed
    assert owner_of(accented) == hashlib.sha256(accented.encode("utf-8")).hexdigest()[:32]


def test_without_keys_every_caller_sees_everything_and_records_no_owner():
    for api_key, cred in ((None, None), ("anything", None), (None, bearer("x")), ("a", bearer("b"))):
        caller = get_caller(keyed(), api_key, cred)  # type: ignore[arg-type]
        assert caller == Caller(None) and caller.owner == ""


def test_with_keys_a_caller_is_the_digest_of_its_key_from_either_header():
    settings = keyed(KEY_A, KEY_B)
    for api_key, cred, key in ((KEY_A, None, KEY_A), (None, bearer(KEY_B), KEY_B), (KEY_B, None, KEY_B),
                               (KEY_A, bearer(KEY_A), KEY_A)):  # both headers with the same key: one caller
        caller = get_caller(settings, api_key, cred)  # type: ignore[arg-type]
        assert caller == Caller(owner_of(key)) and caller.owner == owner_of(key)


def test_a_missing_wrong_or_doubled_key_is_a_401_saying_which():
    settings = keyed(KEY_A, KEY_B)
    for api_key, cred in ((None, None), ("", None), (None, bearer("")), ("key-a-0123456789abcde", None),
                          (KEY_A + "x", None), (KEY_A.upper(), None), (None, bearer("wrong-key-0123456789"))):
        status, detail = refusal(get_caller, settings, api_key, cred)
        assert (status, detail) == (401, MISSING), (api_key, cred)
    status, detail = refusal(get_caller, settings, KEY_A, bearer(KEY_B))
    assert (status, detail) == (401, "two different API keys given (X-API-Key and Bearer): send one")
    status, _ = refusal(get_caller, settings, "wrong-key-0123456789", bearer(KEY_A))  # the two differ: refused
    assert status == 401
    for args in ((None, None), (KEY_A, bearer(KEY_B))):
        with pytest.raises(HTTPException) as e:
            get_caller(settings, *args)  # type: ignore[arg-type]
        assert e.value.headers == {"WWW-Authenticate": "Bearer"}


def test_the_localize_path_reads_the_apps_parts_as_one_and_runs_the_model_unless_workers_do():
    turns = threading.BoundedSemaphore(2)
    parts = {name: object() for name in ("settings", "store", "bundles", "metrics", "inference")}

    def serving(**state: object) -> Serving:
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(**parts, route_turns=turns, **state)))
        return asyncio.run(get_serving(request))  # type: ignore[arg-type]

    want = Serving(parts["settings"], parts["store"], parts["bundles"], parts["metrics"], parts["inference"],  # type: ignore[arg-type]
                   True, turns)
    assert serving(remote=None) == want and serving() == want  # no workers: this process runs the model
    assert serving(remote=object()) == dataclasses.replace(want, local=False)
