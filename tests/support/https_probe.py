"""Run by tests/unit/test_api_hardening.py inside a network namespace of its own (only `lo`):
`pgcarve server start --bind 0.0.0.0`, look at the server as a client would, `pgcarve server
stop`; print what was seen as one JSON document. The namespace keeps the wildcard bind off the
machine's real interfaces; every request goes to 127.0.0.1.

    python -m tests.support.https_probe PORT     (PGCARVE_* in the environment)
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from pgcarve.guest.tls import new_ca


def pgcarve(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False)
    return {"code": proc.returncode, "output": proc.stdout + proc.stderr}


def peer_names(port: int, ca_file: str) -> list[str]:
    """The subjectAltName entries of the certificate the server presents."""
    import socket

    ctx = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return [str(v) for v in san.value.get_values_for_type(x509.DNSName)] + [
        str(v) for v in san.value.get_values_for_type(x509.IPAddress)]


def probe(port: int, state: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"start": pgcarve("server", "start", "--bind", "0.0.0.0", "--port", str(port))}
    server_file = state / "server.json"
    try:
        doc = json.loads(server_file.read_text())
        report["server_json"] = doc
        ca_file = doc["ca_file"]
        auth = {"Authorization": f"Bearer {os.environ['PGCARVE_TOKEN']}"}
        with httpx.Client(base_url=doc["url"], verify=ssl.create_default_context(cafile=ca_file),
                          timeout=10) as client:
            report["healthz"] = client.get("/healthz").status_code
            report["anonymous_read"] = client.get("/v1/instances").status_code
            report["read_with_token"] = client.get("/v1/instances", headers=auth).status_code
            evil = client.get("/v1/instances", headers={**auth, "Host": "evil.test"})
            report["evil_host"] = {"status": evil.status_code, "detail": evil.json().get("detail")}
            pem = client.get("/v1/ca.pem", headers=auth)
            report["ca_pem"] = {"status": pem.status_code, "type": pem.headers.get("content-type"),
                                "is_ca_file": pem.content == Path(ca_file).read_bytes()}
        report["peer_names"] = peer_names(port, ca_file)
        try:
            plain = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            report["plain_http"] = f"answered {plain.status_code}"
        except httpx.HTTPError as exc:
            report["plain_http"] = f"refused: {type(exc).__name__}"
        other = state / "other-ca.pem"
        other.write_bytes(new_ca().cert_pem)
        try:
            httpx.get(f"{doc['url']}/healthz", verify=ssl.create_default_context(cafile=str(other)), timeout=5)
            report["other_ca"] = "accepted"
        except httpx.ConnectError as exc:
            report["other_ca"] = f"refused: {exc}"
    except Exception as exc:  # reported, and the server still stopped below
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        report["stop"] = pgcarve("server", "stop")
        report["server_json_left"] = server_file.exists()
    return report


if __name__ == "__main__":
    print(json.dumps(probe(int(sys.argv[1]), Path(os.environ["PGCARVE_STATE_DIR"]))))
