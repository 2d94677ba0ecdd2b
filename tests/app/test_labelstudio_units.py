"""``app.labelstudio`` by value, without the app: the label config's choice and refusals, project ids, what a message
shows of a URL (never its query, which may hold a signature), whose origin gets Label Studio's token, the personal
access token's exchange, the fetcher's hosts, redirects, timeout, size bounds and refusals. The protocol through the
app is ``test_labelstudio.py``."""

from __future__ import annotations

import httpx
import pytest
from labelstudio_fake import IMAGES, JWT
from service_fixtures import free_port

from app.labelstudio import (
    MAX_SHOWN_URL,
    Access,
    ImageFetcher,
    Refused,
    Target,
    _looks_like_jwt,
    _origin,
    max_instances_of,
    merged,
    parse_label_config,
    project_id,
    shown,
)


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
    port = fake_ls.url.rsplit(":", 1)[1]
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


def test_the_hosts_hold_once_label_studios_address_is_known(fake_ls):
    """``QLOC_LABELSTUDIO_FETCH_HOSTS`` with Label Studio's address known: its own origin is fetched, another host
    only when listed (by name, or name and port), whatever the case of the URL."""
    port = fake_ls.url.rsplit(":", 1)[1]
    with ImageFetcher(Access(fake_ls.url, None), max_bytes=10**6, timeout=5.0, hosts=["example.invalid"]) as f:
        assert f.fetch("/data/upload/1/a.png", "task 1") == IMAGES["a.png"]
        with pytest.raises(Refused, match=f"http://localhost:{port} is not among QLOC_LABELSTUDIO_FETCH_HOSTS"):
            f.fetch(f"http://localhost:{port}/any/b.png", "task 2")
    assert [path for path, _ in fake_ls.seen] == ["/data/upload/1/a.png"]
    with ImageFetcher(Access(fake_ls.url, None), max_bytes=10**6, timeout=5.0, hosts=[f"localhost:{port}"]) as f:
        assert f.fetch(f"http://LOCALHOST:{port}/any/b.png", "task 2") == IMAGES["b.png"]


def test_resolve_tells_label_studio_paths_storage_uris_and_urls_apart(fake_ls):
    ls = Access(fake_ls.url, "t")
    with ImageFetcher(ls, max_bytes=10, timeout=5.0) as f:
        assert f.resolve("  /data/upload/3/a.png ", "task 1") == (f"{fake_ls.url}/data/upload/3/a.png", True)
        assert f.resolve(f"{fake_ls.url.upper()}/x.png", "task 1") == (f"{fake_ls.url.upper()}/x.png", True)
        assert f.resolve("https://elsewhere.example/x.png", "task 1") == ("https://elsewhere.example/x.png", False)
        fileuri = "czM6Ly9idWNrZXQvay5wbmc="  # urlsafe base64 of s3://bucket/k.png
        assert f.resolve("s3://bucket/k.png", "task 1", task_id=5) == (
            f"{fake_ls.url}/tasks/5/resolve/?fileuri={fileuri}", True)
        for url, words in (("", "the image URL is empty or not a string"), (5, "the image URL is empty"),
                           ("//elsewhere.example/x.png", "not relative ones"),  # protocol-relative: not a path
                           ("ftp://elsewhere.example/x.png", "not ftp ones"),
                           ("s3://bucket/k.png", "is in cloud storage")):  # no task to resolve it for
            with pytest.raises(Refused) as refused:
                f.resolve(url, "task 9")
            assert refused.value.status == 422 and refused.value.detail.startswith("task 9: ")
            assert words in refused.value.detail, refused.value.detail
    with ImageFetcher(Access(None, None), max_bytes=10, timeout=5.0) as f, pytest.raises(Refused) as refused:
        f.resolve("/data/upload/3/a.png?token=secret", "task 1")
    assert refused.value.status == 422 and refused.value.detail == (
        "task 1: /data/upload/3/a.png is a Label Studio path, and Label Studio's address is unknown: connect qloc as "
        "the project's ML backend (its /setup call gives the address; set Label Studio's HOST), or set "
        "QLOC_LABELSTUDIO_URL")


def mock_fetcher(handler, max_bytes=100, access=Access(None, None)):
    """An ImageFetcher whose requests ``handler`` answers (httpx's mock transport)."""
    f = ImageFetcher(access, max_bytes=max_bytes, timeout=5.0)
    f._client = httpx.Client(transport=httpx.MockTransport(handler))
    return f


def test_fetch_refuses_what_it_cannot_use_with_the_reason():
    def answer(request):
        name = request.url.path.strip("/")
        if name == "big-declared":
            return httpx.Response(200, headers={"Content-Length": "101"}, content=b"x" * 101)
        if name == "big-streamed":
            return httpx.Response(200, content=iter([b"x" * 60, b"x" * 41]))  # no length declared
        if name == "exact":
            return httpx.Response(200, content=b"x" * 100)
        if name == "slow":
            raise httpx.ReadTimeout("read timed out", request=request)
        if name == "reset":
            raise httpx.ConnectError("connection reset", request=request)
        return httpx.Response(int(name))

    with mock_fetcher(answer, access=Access("http://ls.example", "t")) as f:
        assert f.fetch("http://img.example/exact", "task 1") == b"x" * 100  # the bound itself is allowed
        for path, status, detail in (
            ("big-declared", 413, "task 1: the image is larger than 100 bytes"),
            ("big-streamed", 413, "task 1: the image is larger than 100 bytes"),
            ("slow", 422, "task 1: http://img.example/slow did not answer within 5 s"),
            ("reset", 422, "task 1: cannot fetch http://img.example/reset: ConnectError: connection reset"),
            ("404", 422, "task 1: GET http://img.example/404 answered 404"),
            ("401", 422, "task 1: GET http://img.example/401 answered 401"),  # not Label Studio's: no hint
        ):
            with pytest.raises(Refused) as refused:
                f.fetch(f"http://img.example/{path}?sig=secret", "task 1")
            assert (refused.value.status, refused.value.detail) == (status, detail)
        for status in (401, 403):
            with pytest.raises(Refused, match=f"answered {status} \\(Label Studio's token is missing or refused"):
                f.fetch(f"/{status}", "task 2")


def test_data_uris_decode_within_the_byte_bound():
    with mock_fetcher(lambda request: httpx.Response(500), max_bytes=6) as f:
        assert f.fetch(" DATA:image/png;base64,YWJj ZGVm\n", "task 1") == b"abcdef"  # whitespace in base64 is skipped
        assert f.fetch("data:text/plain,a%20b", "task 1") == b"a b"
        for uri, status, words in (("data:image/png;base64", 422, "needs a comma"),
                                   ("data:image/png;base64,!!!!", 422, "not valid base64"),
                                   ("data:;base64,YWJjZGVmZw==", 413, "larger than 6 bytes"),  # 7 bytes decoded
                                   ("data:," + "a" * 7, 413, "larger than 6 bytes"),
                                   ("data:;base64," + "A" * 21, 413, "larger than 6 bytes")):  # refused undecoded
            with pytest.raises(Refused) as refused:
                f.fetch(uri, "task 3")
            assert refused.value.status == status and refused.value.detail.startswith("task 3: ")
            assert words in refused.value.detail


def test_max_instances_and_the_merged_address():
    assert [max_instances_of(v, 8) for v in (None, "", "  ", "{}", '{"max_instances": 4}', {"max_instances": 8})] == [
        1, 1, 1, 1, 4, 8]
    for bad in ("nope", "[4]", [4], {"max_instances": 0}, {"max_instances": 9}, {"max_instances": True},
                {"max_instances": 2.0}, '{"max_instances": "2"}'):
        with pytest.raises(Refused) as refused:
            max_instances_of(bad, 8)
        assert refused.value.status == 422 and "max_instances" in refused.value.detail
    with pytest.raises(Refused, match="from 1 to 8, got 9"):
        max_instances_of({"max_instances": 9}, 8)
    remembered = Access("http://setup.example/", "setup-token", 3)
    assert merged(None, None, remembered) == Access("http://setup.example", "setup-token", 3)
    assert merged("http://conf.example//", None, remembered) == Access("http://conf.example", "setup-token", 3)
    assert merged(None, "conf-token", Access()) == Access(None, "conf-token", 1)


def test_the_fetcher_names_itself_follows_at_most_five_redirects_and_keeps_its_timeout(fake_ls):
    with ImageFetcher(Access(None, None), max_bytes=10**6, timeout=5.0) as f:
        assert f.fetch(f"{fake_ls.url}/redirect/5/a.png", "task 1") == IMAGES["a.png"]
        with pytest.raises(Refused, match=f"task 2: cannot fetch {fake_ls.url}/redirect/6/a.png: TooManyRedirects"):
            f.fetch(f"{fake_ls.url}/redirect/6/a.png", "task 2")
    with ImageFetcher(Access(None, None), max_bytes=10**6, timeout=0.5) as f, pytest.raises(
            Refused, match=f"task 3: {fake_ls.url}/slow/a.png did not answer within 0.5 s"):
        f.fetch(f"{fake_ls.url}/slow/a.png", "task 3")  # the answer comes after 2 s
    assert set(fake_ls.agents) == {"qloc-labelstudio"}


def test_a_personal_access_token_is_exchanged_once_per_fetcher(fake_ls):
    with ImageFetcher(Access(fake_ls.url, JWT), max_bytes=10**6, timeout=5.0) as f:
        assert f.fetch("/data/upload/3/a.png", "task 1") == IMAGES["a.png"]
        assert f.fetch(f"{fake_ls.url}/data/upload/3/b.png", "task 2") == IMAGES["b.png"]
        assert f.fetch("s3://bucket/dir/c.png", "task 3", task_id=12) == IMAGES["c.png"]  # through the resolver
        with pytest.raises(Refused, match="^task 4: ftp://x/a.png: only http"):
            f.fetch("ftp://x/a.png", "task 4")
    assert fake_ls.seen == [("/api/token/refresh/", None), ("/data/upload/3/a.png", "Bearer short-lived"),
                            ("/data/upload/3/b.png", "Bearer short-lived"),
                            ("/tasks/12/resolve/?fileuri=czM6Ly9idWNrZXQvZGlyL2MucG5n", "Bearer short-lived")]


def test_refusals_by_their_whole_message(fake_ls):
    with mock_fetcher(lambda request: httpx.Response(401), access=Access("http://ls.example", "t")) as f, \
            pytest.raises(Refused) as refused:
        f.fetch("/data/upload/1/a.png?token=x", "task 1")
    assert refused.value.detail == (
        "task 1: GET http://ls.example/data/upload/1/a.png answered 401 (Label Studio's token is missing or "
        "refused: check QLOC_LABELSTUDIO_API_KEY or its legacy tokens)")
    with ImageFetcher(Access(None, None), max_bytes=10, timeout=5.0, hosts=["a.example"]) as f, \
            pytest.raises(Refused) as refused:
        f.fetch(f"{fake_ls.url}/a.png", "task 2")
    assert (refused.value.status, refused.value.detail) == (422, (
        f"task 2: {fake_ls.url}/a.png: {fake_ls.url} is not among QLOC_LABELSTUDIO_FETCH_HOSTS (the hosts task images "
        "may come from, besides Label Studio's own address)"))
    with ImageFetcher(Access(None, None), max_bytes=10, timeout=5.0) as f, pytest.raises(Refused) as refused:
        f.resolve("s3://bucket/k.png", "task 3", task_id=4)
    assert (refused.value.status, refused.value.detail) == (422, (
        "task 3: s3://bucket/k.png is in cloud storage, read through Label Studio, whose address is unknown: connect "
        "qloc as the project's ML backend, or set QLOC_LABELSTUDIO_URL"))
    for bad in ("nope", "[4]"):
        with pytest.raises(Refused) as refused:
            max_instances_of(bad, 8)
        assert refused.value.detail == 'extra_params must be a JSON object, e.g. {"max_instances": 4}'


def test_data_uris_at_their_bounds():
    with mock_fetcher(lambda request: httpx.Response(500), max_bytes=10) as f:
        assert f.fetch("data:,a,b", "task 1") == b"a,b"  # the data starts after the first comma
        # base64: at most 4/3 of the bound, + 12, before decoding (whitespace counted): 25 characters here
        assert f.fetch("data:;base64,YW" + " " * 21 + "Jj", "task 1") == b"abc"
        with pytest.raises(Refused, match="larger than 10 bytes"):
            f.fetch("data:;base64,YW" + " " * 22 + "Jj", "task 1")
        # percent-encoded: 3 characters a byte, so 3 times the bound (+ 12) before decoding
        assert f.fetch("data:," + "%61" * 10, "task 1") == b"a" * 10


CONFIG_TAIL = '<RectangleLabels name="l" toName="i"><Label value="x"/></RectangleLabels></View>'


def test_label_configs_by_value():
    one = '<View><Image name="i" value="$image"/>' + CONFIG_TAIL
    assert parse_label_config(one, set_name="other") == Target("l", "i", "image", "x")
    assert parse_label_config(one.replace('"$image"', '"$a"'), set_name=None).image_key == "a"
    several = ('<View><Image name="i" value="$image"/><Text name="t" value="$text"/>'
               '<RectangleLabels toName="i"><Label value="x"/></RectangleLabels>'  # no name: skipped
               '<RectangleLabels name="on-text" toName="t"><Label value="x"/></RectangleLabels>'  # not on an Image
               '<RectangleLabels name="l" toName="i, t"><Label value="x"/><Header value="h"/></RectangleLabels>'
               '</View>')
    assert parse_label_config(several, set_name=None) == Target("l", "i", "image", "x")  # the first Image named
    on_text = '<View><Text name="t" value="$text"/><RectangleLabels name="l" toName="t"><Label value="x"/>' \
              '</RectangleLabels></View>'
    for bad, message in (
        ("  ", "the labeling config is empty (/setup's `schema`, a task's `label_config`): Label Studio sends the "
               "project's; it needs a <RectangleLabels> tag on an <Image>"),
        ('<!DOCTYPE View><View/>', "label_config must not contain a DOCTYPE or entities"),
        ('<!doctype View><View/>', "label_config must not contain a DOCTYPE or entities"),
        ('<View><!ENTITY a "b"></View>', "label_config must not contain a DOCTYPE or entities"),
        ('<View><Image name="i" value="$"/>' + CONFIG_TAIL, None),  # a value naming no key
        (on_text, 'label_config has no <RectangleLabels> tag whose toName is an <Image>: qloc predicts bounding '
                  'boxes, e.g. <Image name="image" value="$image"/> <RectangleLabels name="label" toName="image">'
                  '<Label value="object"/></RectangleLabels>'),
        ('<View><Image name="i" value="$image"/><RectangleLabels name="l" toName="i"><Label value="b"/>'
         '<Label value="a"/></RectangleLabels></View>',
         "label_config: cannot tell which label the exemplar set (unnamed) is: its labels are ['a', 'b']; name the "
         "exemplar set like one of them (case does not matter), or use one RectangleLabels tag with one label"),
    ):
        with pytest.raises(Refused) as refused:
            parse_label_config(bad, set_name=None)
        assert refused.value.status == 422
        if message is None:
            assert "has value='$'; qloc needs a task data key" in refused.value.detail
        else:
            assert refused.value.detail == message


def test_project_ids_are_the_part_before_the_first_dot_at_most_64_characters():
    assert [project_id(p) for p in ("1.2.3", " 7 .1712345678", "9" * 70)] == ["1", "7", "9" * 64]
