"""Commands that connect applications and people to an instance: connect, dsn, service-file.

Each asks the running API server for the instance's endpoint URIs (`GET /v1/instances/{name}`),
its application login (`.../credentials`, with the token) and the fleet CA (`GET /v1/ca.pem`).
The password never goes on a command line: `connect` hands it to psql in psql's own environment
(PGPASSWORD), `service-file` writes it to a .pgpass file of mode 0600, and `dsn` prints it only
when asked (`--with-password`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from pgcarve.cli.client import ApiClient, ApiError
from pgcarve.cli.display import console
from pgcarve.errors import ConfigError, GuestNotReady
from pgcarve.postgres import conninfo
from pgcarve.postgres.session import ClientTls
from pgcarve.settings import Settings

SERVICE_FILE = "pg_service.conf"
PGPASS_FILE = ".pgpass"
CA_FILE = "ca.pem"
RO_SUFFIX = "-ro"


@dataclass(frozen=True)
class Endpoint:
    """One endpoint URI taken apart: what a service file entry or a .pgpass line needs."""

    user: str
    database: str
    hosts: tuple[tuple[str, int], ...]
    params: dict[str, str]  # target_session_attrs, connect_timeout, keepalives...; not sslmode/sslrootcert
    sslmode: str

    @classmethod
    def parse(cls, uri: str) -> Endpoint:
        parts = {k: str(v) for k, v in conninfo_to_dict(uri).items() if v is not None}
        names, ports = parts.pop("host", "").split(","), parts.pop("port", "").split(",")
        if not names or len(names) != len(ports):
            raise ConfigError(f"the endpoint {uri!r} does not list one port per host")
        hosts = tuple((host, int(port)) for host, port in zip(names, ports, strict=True))
        user, database = parts.pop("user", ""), parts.pop("dbname", "")
        sslmode = parts.pop("sslmode", "verify-ca")
        parts.pop("sslrootcert", None)
        parts.pop("password", None)
        # libpq lists parameters in its own order: put them back in the order the API writes them.
        first = {key: parts.pop(key) for key in conninfo.ENDPOINT_PARAM_ORDER if key in parts}
        return cls(user, database, hosts, {**first, **parts}, sslmode)

    def uri(self, root_cert: Path, password: str | None = None) -> str:
        """The URI again, with `root_cert` as the CA file (and the password, if given)."""
        tls = ClientTls(str(root_cert), "verify-full" if self.sslmode == "verify-full" else "verify-ca")
        return conninfo.uri(self.user, self.database, list(self.hosts), tls, password, self.params)

    def service_entry(self, service: str, root_cert: Path) -> str:
        """A pg_service.conf section: libpq's own way to name this endpoint."""
        lines = [f"[{service}]",
                 f"host={','.join(h for h, _ in self.hosts)}",
                 f"port={','.join(str(p) for _, p in self.hosts)}",
                 f"dbname={self.database}", f"user={self.user}",
                 *(f"{key}={value}" for key, value in self.params.items()),
                 f"sslmode={self.sslmode}", f"sslrootcert={root_cert}"]
        return "\n".join(lines) + "\n"

    def pgpass_lines(self, password: str) -> list[str]:
        """One .pgpass line per host (libpq matches host, port, database and user)."""
        def field(value: str) -> str:
            return value.replace("\\", "\\\\").replace(":", "\\:")

        return [":".join(field(v) for v in (host, str(port), self.database, self.user, password))
                for host, port in self.hosts]


def endpoint_uri(client: ApiClient, name: str, read_only: bool) -> str:
    """The instance's rw (or ro) URI from the API; GuestNotReady while it has none."""
    endpoints = client.instance(name).get("endpoints")
    if not endpoints:
        raise GuestNotReady(f"instance {name} has no endpoints yet (its guests have no addresses): "
                            "try again once `pgcarve status` shows it running")
    return str(endpoints["ro" if read_only else "rw"])


def write_file(path: Path, text: str, mode: int) -> None:
    """Replace `path` atomically by a file that has `mode` from its creation."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)  # the umask may have narrowed it
    tmp.replace(path)


def local_ca_file(client: ApiClient, uri: str) -> Path:
    """A file on this machine holding the API's fleet CA: the one the URI names if it holds the
    same certificate (the API runs here), else a copy in ~/.pgcarve named by its content."""
    pem = client.get_text("/v1/ca.pem")
    named = conninfo_to_dict(uri).get("sslrootcert")
    if named:
        with_path = Path(str(named))
        try:
            if with_path.read_text() == pem:
                return with_path
        except OSError:
            pass
    directory = Path.home() / ".pgcarve"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    copy = directory / f"ca-{hashlib.sha256(pem.encode()).hexdigest()[:16]}.pem"
    if not copy.exists() or copy.read_text() != pem:
        write_file(copy, pem, 0o644)
    return copy


def cmd_dsn(args: argparse.Namespace, settings: Settings) -> int:
    """Print the instance's rw (or --ro) URI, verified with a CA file on this machine."""
    client = ApiClient.for_settings(settings, args.url)
    uri = endpoint_uri(client, args.name, args.ro)
    password = client.credentials(args.name)["password"] if args.with_password else None
    sys.stdout.write(Endpoint.parse(uri).uri(local_ca_file(client, uri), password) + "\n")
    return 0


def psql_command(uri: str) -> list[str]:
    """psql on `uri`: the URI is its only argument (it holds no password)."""
    psql = shutil.which("psql")
    if psql is None:
        raise ConfigError("psql is not installed: run `make deps` (Debian package postgresql-client)")
    return [psql, uri]


def cmd_connect(args: argparse.Namespace, settings: Settings) -> int:
    """Replace this process by psql on the instance, as its application role."""
    client = ApiClient.for_settings(settings, args.url)
    uri = endpoint_uri(client, args.name, args.ro)
    password = client.credentials(args.name)["password"]
    command = psql_command(Endpoint.parse(uri).uri(local_ca_file(client, uri)))
    # Only psql's environment holds the password: never argv, which every local user can read.
    os.execve(command[0], command, {**os.environ, "PGPASSWORD": password})  # noqa: S606
    return 0  # not reached


def service_files(entries: Sequence[tuple[str, Endpoint, Endpoint, str]], ca_file: Path) -> tuple[str, str]:
    """(pg_service.conf, .pgpass) for (instance, rw, ro, password) entries: services NAME and NAME-ro."""
    services, pgpass = [], []
    for name, rw, ro, password in entries:
        services += [rw.service_entry(name, ca_file), ro.service_entry(name + RO_SUFFIX, ca_file)]
        pgpass += rw.pgpass_lines(password)
    header = "# Written by `pgcarve service-file`: one service per instance (NAME: the primary, NAME-ro: a standby).\n"
    return header + "\n".join(services), "\n".join(dict.fromkeys(pgpass)) + "\n"


def cmd_service_file(args: argparse.Namespace, settings: Settings) -> int:
    """Write pg_service.conf, .pgpass (0600) and the CA into a directory; print what to export."""
    client = ApiClient.for_settings(settings, args.url)
    directory = Path(args.dir).expanduser().resolve() if args.dir else Path.home() / ".pgcarve"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_file = directory / CA_FILE
    write_file(ca_file, client.get_text("/v1/ca.pem"), 0o644)
    entries = []
    for doc in client.get("/v1/instances"):
        name, endpoints = doc["name"], doc.get("endpoints")
        if not endpoints:
            console.print(f"{name}: no endpoints yet (its guests have no addresses); left out")
            continue
        try:
            password = client.credentials(name)["password"]
        except ApiError as exc:
            if exc.status != 404:
                raise
            console.print(f"{name}: left out: {exc.detail}")
            continue
        entries.append((name, Endpoint.parse(endpoints["rw"]), Endpoint.parse(endpoints["ro"]), password))
    service_text, pgpass_text = service_files(entries, ca_file)
    write_file(directory / SERVICE_FILE, service_text, 0o644)
    write_file(directory / PGPASS_FILE, pgpass_text, 0o600)
    names = ", ".join(f"{n}, {n}{RO_SUFFIX}" for n, *_ in entries) or "none"
    console.print(f"wrote {directory / SERVICE_FILE} (services: {names}), {directory / PGPASS_FILE} (0600) and "
                  f"{ca_file}; then: psql service={entries[0][0] if entries else 'NAME'}")
    # Plain stdout, so that `eval "$(pgcarve service-file)"` works.
    sys.stdout.write(f"export PGSERVICEFILE={directory / SERVICE_FILE}\nexport PGPASSFILE={directory / PGPASS_FILE}\n")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    connect = sub.add_parser("connect", help="open psql on an instance as its application role (through the API)")
    connect.add_argument("name", help="the instance, e.g. pgc-01")
    connect.add_argument("--ro", action="store_true",
                         help="a standby if one answers (target_session_attrs=prefer-standby)")
    connect.add_argument("--url", help="API base URL (default: the local server)")
    connect.set_defaults(func=cmd_connect)

    dsn = sub.add_parser("dsn", help="print an instance's URI (follows failover; no password unless asked)")
    dsn.add_argument("name", help="the instance, e.g. pgc-01")
    dsn.add_argument("--ro", action="store_true", help="the read-only URI (prefer-standby)")
    dsn.add_argument("--with-password", action="store_true", help="put the password in the URI")
    dsn.add_argument("--url", help="API base URL (default: the local server)")
    dsn.set_defaults(func=cmd_dsn)

    service = sub.add_parser("service-file", help="write pg_service.conf, .pgpass and the CA, for `psql service=NAME`")
    service.add_argument("--dir", help="where to write them (default: ~/.pgcarve)")
    service.add_argument("--url", help="API base URL (default: the local server)")
    service.set_defaults(func=cmd_service_file)
