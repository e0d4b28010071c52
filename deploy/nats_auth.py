"""``shoal nats-auth``: the nats-server authorization config of a namespace, one user per role
(``bus.nats_ops.permissions``), each with a random password kept in ``<credentials
dir>/<role>.password`` (a 0600 file in a 0700 folder; an existing one is reused, so running it
again prints the same config). The printed config holds the passwords in plain text: keep its file
0600 too (or a Kubernetes Secret), and give each actor its own role's file
(``--nats-password-file``).

The cluster's routes get a user of their own, ``<namespace>-route`` (password in
``route.password``): ``cluster_auth_config`` is the part of a node's ``cluster {}`` block that
holds it, the ``authorization`` a node asks of nodes routing to it and the route URLs with the
credentials, to be written to a 0600 file (``cluster-auth.conf``) the nodes include there."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from shoal.bus.nats_ops.cluster import route_auth
from shoal.bus.nats_ops.credentials import read_password_file
from shoal.bus.nats_ops.permissions import ROLES, authorization_config, user_name

PASSWORD_BYTES = 24
ROUTE = "route"  # the routes' password file is route.password


def password_path(credentials_dir: Path, role: str) -> Path:
    return credentials_dir / f"{role}.password"


def ensure_passwords(credentials_dir: Path, roles: list[str]) -> dict[str, str]:
    """Each role's password, generated and written (0600) where its file is missing."""
    credentials_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(credentials_dir, 0o700)
    passwords = {}
    for role in roles:
        path = password_path(credentials_dir, role)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(PASSWORD_BYTES) + "\n")
        passwords[role] = read_password_file(path)
        if not passwords[role]:
            raise ValueError(f"{path} is empty")
    return passwords


def nats_auth_config(
    namespace: str,
    credentials_dir: Path,
    roles: list[str] | None = None,
    *,
    gateway_may_command: bool = False,
) -> str:
    """The ``authorization { users = [...] }`` block, preceded by a comment naming each user."""
    roles = roles or list(ROLES)
    passwords = ensure_passwords(credentials_dir, roles)
    header = [f"# shoal namespace {namespace!r}: one NATS user per role (password files in "]
    header[0] += f"{credentials_dir.resolve()})"
    header += [f"#   {user_name(namespace, r)}: {r}.password" for r in roles]
    body = authorization_config(namespace, passwords, gateway_may_command=gateway_may_command)
    return "\n".join(header) + "\n" + body


def route_user(namespace: str) -> str:
    """The user nodes route to each other as (``shoal-route``; dots become dashes)."""
    return f"{namespace.replace('.', '-')}-{ROUTE}"


def cluster_auth_config(namespace: str, credentials_dir: Path, routes: list[str]) -> str:
    """The route user's ``authorization`` and the ``routes`` list (``HOST:PORT`` each) with
    its credentials, to be included inside every node's ``cluster {}`` block."""
    password = ensure_passwords(credentials_dir, [ROUTE])[ROUTE]
    header = f"# shoal namespace {namespace!r}: the cluster routes' user "
    header += f"(password file {password_path(credentials_dir.resolve(), ROUTE)}).\n"
    header += "# Include inside cluster {} on every node; keep this file 0600.\n"
    return header + route_auth(routes, route_user(namespace), password)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
