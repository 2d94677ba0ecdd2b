"""``app.labelstudio``'s fetcher and helpers by value, without the app: what a message shows of a URL (never its
query, which may hold a signature), whose origin gets Label Studio's token, the personal access token's exchange and
its refusals. The protocol through the app is ``test_labelstudio.py``."""

from __future__ import annotations

import pytest
from labelstudio_fake import IMAGES, JWT
from service_fixtures import free_port

from app.labelstudio import MAX_SHOWN_URL, Access, ImageFetcher, Refused, _looks_like_jwt, _origin, shown


def test_shown_drops_the_query_and_fragment_and_bounds_the_length():
    assert shown("https://bucket.s3.amazonaws.com/a.png?X-Amz-Signature=secret#frag") == (
        "https://bucket.s3.amazonaws.com/a.png")
    assert shown("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB") == "data:image/png;base64,iVBORw0K..."
    exact = "https://h/" + "p" * (MAX_SHOWN_URL - len("https://h/"))
    assert shown(exact) == exact and len(exact) == MAX_SHOWN_URL
    longer = exact + "q"
    assert shown(longer) == longer[:MAX_SHOWN_URL - 3] + "..." and len(shown(longer)) == MAX_SHOWN_URL


def test_origin_and_token_kind_ignore_case_and_need_a_whole_jwt():
    assert _origin("HTTPS://Label.Example:8080/data/x.png?q=1") == ("https", "label.example:8080")
    assert _origin("https://label.example:8080/") == _origin("HTTPS://LABEL.EXAMPLE:8080")
    assert _looks_like_jwt(JWT)
    assert not _looks_like_jwt("eyJnot-a-jwt")  # a legacy token that happens to start like one
    assert not _looks_like_jwt("abc.def.ghi")


def test_label_studios_token_goes_to_its_origin_whatever_the_case_and_nowhere_else(fake_ls):
    host, port = fake_ls.url.removeprefix("http://").split(":")
    with ImageFetcher(Access(fake_ls.url.upper(), "legacy-token"), max_bytes=10**6, timeout=5.0) as f:
        assert f.fetch(f"{fake_ls.url}/data/upload/3/a.png", "task 1") == IMAGES["a.png"]
        assert f.fetch(f"http://localhost:{port}/data/upload/3/b.png", "task 2") == IMAGES["b.png"]  # another origin
    assert fake_ls.seen == [("/data/upload/3/a.png", "Token legacy-token"), ("/data/upload/3/b.png", None)]


def test_a_refused_or_failed_token_exchange_is_a_422_naming_the_task_and_the_address(fake_ls):
    refused_token = Access(fake_ls.url, JWT.replace("c2ln", "bad"))
    with ImageFetcher(refused_token, max_bytes=10**6, timeout=5.0) as f, pytest.raises(Refused) as refused:
        f.fetch("/data/upload/3/a.png", "task 7")
    assert refused.value.status == 422
    assert refused.value.detail == (f"task 7: Label Studio refused the personal access token "
                                    f"({fake_ls.url}/api/token/refresh/ answered 401)")
    assert fake_ls.seen == [("/api/token/refresh/", None)]  # the image is not asked for without a token

    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ImageFetcher(Access(nobody, JWT), max_bytes=10**6, timeout=5.0) as f, pytest.raises(Refused) as refused:
        f.fetch("/data/upload/3/a.png", "task 8")
    assert refused.value.status == 422
    assert refused.value.detail.startswith(f"task 8: cannot exchange the Label Studio personal access token at "
                                           f"{nobody}/api/token/refresh/: ConnectError: ")
