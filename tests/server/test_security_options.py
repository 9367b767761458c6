"""The security options as `serve` reads them: origins written loosely, keys and their names, and
flags that make no sense alone refused before anything loads."""

from __future__ import annotations

import pytest

from streamsd.cli import main
from streamsd.server.auth import ApiKeys
from streamsd.server.origins import OriginPolicy, normalise


@pytest.mark.parametrize(("written", "origin"), [
    ("http://App.Example:80/", "http://app.example"),
    ("https://app.example:443", "https://app.example"),
    ("https://app.example:8443", "https://app.example:8443"),
    ("http://[::1]:3000", "http://[::1]:3000"),
    ("chrome-extension://abcdef", "chrome-extension://abcdef"),
    ("null", None),
    ("app.example", None),
    ("http://app.example/path", None),
    ("http://user@app.example", None),
    ("http://app.example:99999", None),
])
def test_origins_are_compared_as_browsers_write_them(written, origin):
    assert normalise(written) == origin


def test_origin_policy_from_the_command_line():
    policy = OriginPolicy.parse("https://A.example, http://b.example:8080,https://a.example", "get,post,put",
                                "Authorization")
    assert policy.origins == ("https://a.example", "http://b.example:8080")
    assert policy.methods == ("GET", "POST", "PUT") and policy.headers == ("Authorization",)
    assert OriginPolicy.parse(None) == OriginPolicy() and not OriginPolicy().origins
    assert OriginPolicy.parse("*").origins == ("*",)
    for bad in ("app.example", "http://a.example/x", ","):
        with pytest.raises(ValueError, match="allowed-origins"):
            OriginPolicy.parse(bad)
    with pytest.raises(ValueError, match="need --allowed-origins"):
        OriginPolicy.parse(None, "GET")


def test_api_keys_are_named_in_the_order_given(tmp_path):
    keys = ApiKeys.parse(["first", "ops:second", "third", "ci:with:colons", "not a name:fourth"])
    assert keys.names == ["key-1", "ops", "key-3", "ci", "key-5"]
    assert keys.match("second") == "ops" and keys.match("with:colons") == "ci"
    assert keys.match("not a name:fourth") == "key-5" and keys.match("ops:second") is None
    assert keys.bearer("bearer third") == "key-3" and keys.bearer("Basic third") is None
    for duplicate in (["a", "a"], ["x:a", "x:b"], ["a", "key-1:b"]):
        with pytest.raises(ValueError):
            ApiKeys.parse(duplicate)
    file = tmp_path / "keys"
    file.write_text("# staff\n\n  alice:k1  \nk2\n")
    assert ApiKeys.read_file(file) == ["alice:k1", "k2"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--ssl-certfile", "cert.pem"], "--ssl-certfile and --ssl-keyfile go together"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs"),
    (["--allowed-headers", "x-a"], "need --allowed-origins"),
    (["--allowed-origins", "evil.example"], "is not an origin"),
    (["--api-key", "a", "--api-key", "a"], "the same API key"),
])
def test_serve_refuses_options_that_cannot_work_before_loading_anything(argv, message, capsys):
    assert main(["serve", "--model", "/nonexistent", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_api_key_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "keys"
    empty.write_text("# nobody yet\n")
    assert main(["serve", "--model", "/nonexistent", "--api-key-file", str(empty)]) == 2
    assert "holds no key" in capsys.readouterr().err
