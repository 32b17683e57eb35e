"""IP addresses and networks that end up in pg_hba.conf, conninfo strings and seeds, validated."""

from __future__ import annotations

import ipaddress
import re

from pgcarve.errors import ConfigError

# Digits, hex letters, ':' and '.' only: ipaddress alone accepts IPv6 scope ids ("fe80::%x"),
# which may carry spaces or newlines into pg_hba.conf or a conninfo string.
_ADDRESS_CHARS = re.compile(r"[0-9A-Fa-f:.]+")
_NETWORK_CHARS = re.compile(r"[0-9A-Fa-f:.]+/[0-9]{1,3}")


def check_network(value: str) -> str:
    """A CIDR such as 10.77.0.0/16 (normalized), or ConfigError."""
    if not isinstance(value, str) or not _NETWORK_CHARS.fullmatch(value):
        raise ConfigError(f"allowed network {value!r} is not a CIDR like 10.77.0.0/16")
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError as exc:
        raise ConfigError(f"allowed network {value!r} is not a CIDR: {exc}") from None


def check_address(value: str) -> str:
    """A plain IPv4/IPv6 address, or ConfigError."""
    if not isinstance(value, str) or not _ADDRESS_CHARS.fullmatch(value):
        raise ConfigError(f"address {value!r} is not a plain IP address")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError as exc:
        raise ConfigError(f"address {value!r} is not an IP address: {exc}") from None
