"""NATS credentials of an actor process: from the environment (``SHOAL_NATS_USER``,
``SHOAL_NATS_PASSWORD``) or a user name with a password file, never from a command line, and
never logged: ``NatsCredentials`` hides its password in ``repr``, ``redact_url`` masks a URL's
password; ``child_env`` hands them to a child process through its environment."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_USER = "SHOAL_NATS_USER"
ENV_PASSWORD = "SHOAL_NATS_PASSWORD"
SECRET_OPTIONS = ("password", "token", "creds_file")  # bus options never put on a command line


class CredentialsError(ValueError):
    """Credentials given half, or a password file that cannot be read."""


@dataclass(frozen=True)
class NatsCredentials:
    user: str
    password: str = field(repr=False)

    def bus_options(self) -> dict[str, str]:
        """``NatsBus`` keyword arguments."""
        return {"user": self.user, "password": self.password}

    def child_env(self) -> dict[str, str]:
        """The environment that gives a child process these credentials."""
        return {ENV_USER: self.user, ENV_PASSWORD: self.password}


def resolve_credentials(
    user: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> NatsCredentials | None:
    """``user`` (else ``$SHOAL_NATS_USER``) with the password read from ``password_file`` (one
    line; else ``$SHOAL_NATS_PASSWORD``); None when neither a user nor a password is given."""
    env = os.environ if environ is None else environ
    user = user or env.get(ENV_USER) or None
    if password_file is not None:
        try:
            password: str | None = read_password_file(password_file)
        except OSError as exc:
            raise CredentialsError(f"cannot read the NATS password file: {exc}") from None
    else:
        password = env.get(ENV_PASSWORD) or None
    if user is None and password is None:
        return None
    if user is None:
        raise CredentialsError(f"a NATS password needs a user (--nats-user or ${ENV_USER})")
    if not password:
        raise CredentialsError(
            f"NATS user {user!r} needs a password (--nats-password-file or ${ENV_PASSWORD})"
        )
    return NatsCredentials(user, password)


def read_password_file(path: str | os.PathLike[str]) -> str:
    """A password file's one line, without its line ending (spaces are part of the password;
    ``shoal nats-auth`` reads its own files the same way)."""
    return Path(path).read_text().rstrip("\r\n")


def redact_url(url: str) -> str:
    """``url`` (or comma-separated URLs) with any password replaced by ``***``."""
    return ",".join(_redact_one(u) for u in url.split(","))


def _redact_one(url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip())
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    name = userinfo.partition(":")[0] if parts.password is not None else "***"
    masked = f"{name}:***@{host}" if parts.password is not None else f"{name}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=masked))


def url_has_secret(url: str) -> bool:
    """Whether ``url`` (or one of comma-separated URLs) carries a user or token in it."""
    return any("@" in urllib.parse.urlsplit(u.strip()).netloc for u in url.split(","))
