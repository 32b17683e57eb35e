"""Where the API server listens, and the names it answers to.

The server binds its socket itself (`bind_listener`) so that what it decides from "where it
listens" comes from the socket's own address, never from the configured string: reads are open
without the token only when the listening socket is bound to a loopback address, and a name
like `localhost` or a host name counts for what it resolved to.

`server_names` are the names the server was started for: the bind address, on loopback also
`localhost`, `127.0.0.1` and `::1`, on a wildcard address (0.0.0.0, ::) also this machine's host
name and addresses, plus PGCARVE_ALLOWED_HOSTS. The Host header is checked against them (the
DNS-rebinding defence) and the API's certificate from the fleet CA is issued for them.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import ConfigError
from pgcarve.guest.tls import check_names

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def is_loopback_address(value: str) -> bool:
    """An IP address on the loopback network (a host name is not an address: False)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class Listener:
    """The listening socket: the bind string it was asked for and the address it got."""

    bind: str  # as configured: an address, a host name, 0.0.0.0 or ::
    address: str  # the IP address the socket is bound to (getsockname)
    port: int

    @property
    def loopback(self) -> bool:
        return is_loopback_address(self.address)

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    def local_url_host(self) -> str:
        """How a client on this machine names the server in a URL: the bind name if it is a host
        name (what an operator's certificate names), else the bound address; loopback for a
        wildcard bind."""
        if self.wildcard:
            return "[::1]" if ":" in self.address else "127.0.0.1"
        if not is_ip(self.bind) and self.bind:
            return self.bind
        return f"[{self.address}]" if ":" in self.address else self.address


def bind_listener(bind: str, port: int) -> tuple[socket.socket, Listener]:
    """A TCP socket bound to (bind, port), not yet listening, and what it is bound to.
    ConfigError (nothing bound) if the address cannot be used."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
    except (OSError, UnicodeError) as exc:
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot listen on {bind}:{port}: {reason} (choose another --bind or --port)") from None
    address, bound_port = sock.getsockname()[:2]
    return sock, Listener(bind=bind, address=str(address), port=int(bound_port))


def local_addresses() -> list[str]:
    """This machine's IP addresses (in the server's network namespace), read from /proc: no
    lookup leaves the machine. IPv6 link-local addresses are left out (a URL needs a zone)."""
    found: list[str] = []
    # fib_trie lists every IPv4 route; a local address is followed by "/32 host LOCAL".
    last = None
    try:
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("|--", "+--")):
                last = stripped[3:].strip().split()[0]
            elif stripped == "/32 host LOCAL" and last is not None:
                found.append(last)
    except OSError:
        pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            raw = line.split()[0]
            address = ipaddress.IPv6Address(bytes.fromhex(raw))
            if not address.is_link_local:
                found.append(str(address))
    except (OSError, ValueError, IndexError):
        pass
    return [a for a in dict.fromkeys(found) if is_ip(a)]


@dataclass(frozen=True)
class ServerNames:
    """The host names and IP addresses the server was started for."""

    dns: tuple[str, ...]
    ips: tuple[str, ...]

    def accepts(self, host: str) -> bool:
        """Whether a Host header's host part (no port; IPv6 without brackets) is one of them."""
        host = host.rstrip(".").lower()
        if is_ip(host):
            return str(ipaddress.ip_address(host)) in self.ips
        return host in self.dns

    def all(self) -> list[str]:
        return [*self.dns, *self.ips]


def _is_host_name(name: str) -> bool:
    try:
        check_names([name], [])
    except ConfigError:
        return False
    return True


def server_names(bind: str, listener: Listener | None, extra: list[str]) -> ServerNames:
    """See the module's docstring. Without a listener (an app not started by `serve`, as in
    tests) the bind string stands for the address. ConfigError names a bad PGCARVE_ALLOWED_HOSTS entry."""
    bind = bind.strip("[]")
    address = listener.address if listener is not None else (bind if is_ip(bind) else None)
    wildcard = address is not None and ipaddress.ip_address(address).is_unspecified
    loopback = is_loopback_address(address) if address is not None else bind == "localhost"
    names = [n for n in (bind, address) if n and not (is_ip(n) and ipaddress.ip_address(n).is_unspecified)]
    if wildcard:
        hostname = socket.gethostname()
        names += [hostname] if _is_host_name(hostname) else []
        names += local_addresses()
    if loopback or wildcard:
        names += LOOPBACK_NAMES
    for name in extra:
        if not (is_ip(name) or _is_host_name(name)):
            raise ConfigError(f"PGCARVE_ALLOWED_HOSTS: {name!r} is neither a host name nor an IP address "
                              "(give names or addresses separated by commas)")
    names += extra
    dns = [n.rstrip(".").lower() for n in names if not is_ip(n)]
    ips = [str(ipaddress.ip_address(n)) for n in names if is_ip(n)]
    return ServerNames(dns=tuple(dict.fromkeys(dns)), ips=tuple(dict.fromkeys(ips)))
