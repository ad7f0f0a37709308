"""Client credentials from arguments, the environment and files (cursus.client.credentials)."""

from __future__ import annotations

import pytest

from cursus.client.connection import ConnectionOptions, options_from
from cursus.client.credentials import Credentials, CredentialsError, resolve_credentials

SECRET = "tok-client-Yy52"


def test_precedence_arguments_then_environment_then_file(tmp_path):
    file = tmp_path / "creds.yaml"
    file.write_text(f"principal: filed\ntoken: {SECRET}\n")
    env = {"CURSUS_PRINCIPAL": "envy", "CURSUS_TOKEN": "env-tok", "CURSUS_CREDENTIALS_FILE": str(file)}
    assert resolve_credentials("arg", "arg-tok", environ=env) == Credentials("arg", "arg-tok")
    assert resolve_credentials("arg", environ=env) == Credentials("arg", "env-tok")  # token from the env
    assert resolve_credentials(credentials_file=file, environ=env) == Credentials("filed", SECRET)
    assert resolve_credentials(environ=env) == Credentials("envy", "env-tok")
    assert resolve_credentials(environ={"CURSUS_CREDENTIALS_FILE": str(file)}) == Credentials("filed", SECRET)
    assert resolve_credentials(environ={}) is None


def test_token_files(tmp_path):
    (tmp_path / "token").write_text(SECRET + "\n")
    env = {"CURSUS_PRINCIPAL": "p", "CURSUS_TOKEN_FILE": str(tmp_path / "token")}
    assert resolve_credentials(environ=env) == Credentials("p", SECRET)
    (tmp_path / "c.yaml").write_text("principal: q\ntoken_file: token\n")  # relative to the file
    assert resolve_credentials(credentials_file=tmp_path / "c.yaml", environ={}) == Credentials("q", SECRET)


@pytest.mark.parametrize(("kwargs", "env", "message"), [
    ({"principal": "p"}, {}, "has no token"),
    ({"token": SECRET}, {}, "without a principal"),
    ({}, {"CURSUS_TOKEN": SECRET}, "without a principal"),
    ({}, {"CURSUS_PRINCIPAL": "p", "CURSUS_TOKEN_FILE": "/nonexistent/x"}, "CURSUS_TOKEN_FILE"),
])
def test_incomplete_credentials_are_errors(kwargs, env, message):
    with pytest.raises(CredentialsError, match=message) as info:
        resolve_credentials(**kwargs, environ=env)
    assert SECRET not in str(info.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, message in ((f"token: {SECRET}\n", "no principal"), ("principal: p\n", "no token"),
                          (f"principal: p\ntoken: {SECRET}\nextra: 1\n", "unknown key"), ("- x\n", "mapping")):
        bad.write_text(text)
        with pytest.raises(CredentialsError, match=message) as info:
            resolve_credentials(credentials_file=bad, environ={})
        assert SECRET not in str(info.value)


def test_tokens_are_never_in_reprs(monkeypatch):
    assert SECRET not in repr(Credentials("p", SECRET))
    assert SECRET not in repr(ConnectionOptions(principal="p", token=SECRET))
    monkeypatch.setenv("CURSUS_PRINCIPAL", "from-env")
    monkeypatch.setenv("CURSUS_TOKEN", SECRET)
    options = options_from(None, {})
    assert (options.principal, options.token) == ("from-env", SECRET)
    assert options_from(ConnectionOptions(), {}).principal is None  # explicit options are used as given
