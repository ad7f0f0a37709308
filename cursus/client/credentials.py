"""Where a client's token credentials come from: arguments, the environment, or a credentials file.

Precedence, highest first: explicit arguments (a principal and token, or a credentials file); the environment (``CURSUS_PRINCIPAL`` with ``CURSUS_TOKEN``,
or ``CURSUS_TOKEN_FILE`` naming a file holding the token); a credentials file (``credentials_file=`` or
``CURSUS_CREDENTIALS_FILE``): flat YAML with ``principal:`` and ``token:`` (or ``token_file:``). A
principal without a token (or the reverse) is an error, never a silent anonymous connection.

Tokens are secrets: :class:`Credentials` hides the token in its ``repr``, and no error message here
contains one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_PRINCIPAL = "CURSUS_PRINCIPAL"
ENV_TOKEN = "CURSUS_TOKEN"
ENV_TOKEN_FILE = "CURSUS_TOKEN_FILE"
ENV_CREDENTIALS_FILE = "CURSUS_CREDENTIALS_FILE"


class CredentialsError(ValueError):
    """Credentials are incomplete or a credentials file is unreadable or malformed (no token in the message)."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """A principal and its token (``repr`` hides the token)."""

    principal: str
    token: str = field(repr=False)


def _read_token_file(path: str | os.PathLike[str], what: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise CredentialsError(f"{what} {path}: {exc.strerror or exc}") from None
    if not token:
        raise CredentialsError(f"{what} {path} is empty")
    return token


def _from_file(path: str | os.PathLike[str]) -> Credentials:
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CredentialsError(f"credentials file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError:
        raise CredentialsError(f"credentials file {path} is not valid YAML") from None
    if not isinstance(doc, dict):
        raise CredentialsError(f"credentials file {path} must be a mapping with principal and token")
    unknown = sorted(set(map(str, doc)) - {"principal", "token", "token_file"})
    if unknown:
        raise CredentialsError(f"credentials file {path}: unknown key {unknown[0]!r}")
    principal = doc.get("principal")
    token = doc.get("token")
    if token is None and doc.get("token_file"):
        base = Path(path).parent
        token = _read_token_file(base / str(doc["token_file"]), "token file")
    if not isinstance(principal, str) or not principal:
        raise CredentialsError(f"credentials file {path} has no principal")
    if not isinstance(token, str) or not token:
        raise CredentialsError(f"credentials file {path} has no token for principal {principal}")
    return Credentials(principal, token)


def resolve_credentials(principal: str | None = None, token: str | None = None, *,
                        credentials_file: str | os.PathLike[str] | None = None,
                        environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials to authenticate with, or None for an anonymous connection.

    Args:
        principal, token: explicit values (a principal given here with no token takes the token from
            ``CURSUS_TOKEN`` / ``CURSUS_TOKEN_FILE``).
        credentials_file: YAML file with ``principal`` and ``token`` / ``token_file``; default
            ``CURSUS_CREDENTIALS_FILE``.
        environ: the environment (default ``os.environ``).

    Raises:
        CredentialsError: a principal without a token or a token without a principal, or an unreadable or
            malformed credentials or token file.
    """
    env = os.environ if environ is None else environ
    env_token = env.get(ENV_TOKEN) or None
    if env_token is None and env.get(ENV_TOKEN_FILE):
        env_token = _read_token_file(env[ENV_TOKEN_FILE], ENV_TOKEN_FILE)
    if principal is not None or token is not None:
        principal = principal or env.get(ENV_PRINCIPAL) or None
        token = token or env_token
    elif credentials_file:
        return _from_file(credentials_file)
    elif env.get(ENV_PRINCIPAL) or env_token:
        principal, token = env.get(ENV_PRINCIPAL) or None, env_token
    elif env.get(ENV_CREDENTIALS_FILE):
        return _from_file(env[ENV_CREDENTIALS_FILE])
    else:
        return None
    if not principal:
        raise CredentialsError(f"a token was given without a principal (set {ENV_PRINCIPAL} or pass one)")
    if not token:
        raise CredentialsError(f"principal {principal} has no token (set {ENV_TOKEN} or {ENV_TOKEN_FILE}, "
                               f"or pass one)")
    return Credentials(principal, token)
