"""etcd in the shared 3-host sandbox: three members over TLS as the manager sees them, a client
without a certificate refused, the members reached from the guests' networks (from a booted guest
when test_carve.py left one), one member stopped by its PID record (quorum kept, doctor and
/metrics say so) and started again by an idempotent `sandbox up`. Last, a one-host sandbox of its
own gets two witness members and grows to two hosts (no guests: seconds).

Runs after test_carve.py on its sandbox and guests (tests/conftest.py FLEET_ORDER); it stops no
guest, so the modules after it find the fleet as it was. Seconds, not minutes.
"""

from __future__ import annotations

import ssl
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgcarve.config import EtcdConfig
from pgcarve.control.doctor_etcd import etcd_findings
from pgcarve.control.fleet import Fleet
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.dcs.health import ClusterHealth, assess
from pgcarve.postgres.conninfo import GUEST_CA_FILE
from pgcarve.processes import ProcessStatus, check
from pgcarve.sandbox.etcd import CLIENT_PORT
from pgcarve.sandbox.forward import join_netns

from tests.integration.conftest import IT_STATE, CarveEnv, clean_sandbox, wait_for
from tests.integration.test_connect import guest_exec

pytestmark = pytest.mark.integration

MEMBERS = ["h0", "h1", "h2"]


def health(env: CarveEnv) -> ClusterHealth:
    assert env.config.etcd is not None, "the sandbox's hosts file has no etcd section"
    with EtcdClient(env.config.etcd) as client:
        return assess(client.probe())


def test_three_members_answer_the_manager_over_tls(carve_env: CarveEnv) -> None:
    etcd = carve_env.config.etcd
    assert etcd is not None and all(url.startswith("https://127.0.0.1:") for url in etcd.endpoints)
    found = health(carve_env)
    assert sorted(m.name for m in found.members) == MEMBERS
    assert all(m.up for m in found.members), found
    assert found.has_quorum and found.leader in MEMBERS
    # Each member runs in its own host's namespace, recorded by PID.
    for member in carve_env.sandbox.etcd.members():
        record = carve_env.sandbox.etcd.running(member)
        assert record is not None and Path(record.cmdline[0]).name == "etcd"
        assert member.netns == carve_env.sandbox.host_named(member.name).netns


def test_a_client_without_a_certificate_is_refused(carve_env: CarveEnv) -> None:
    etcd = carve_env.config.etcd
    assert etcd is not None
    endpoint = etcd.endpoints[0]
    anonymous = ssl.create_default_context(cafile=etcd.ca_file)  # trusts the members, proves nothing itself
    with httpx.Client(verify=anonymous, timeout=5) as client, pytest.raises(httpx.HTTPError):
        client.post(f"{endpoint}/v3/maintenance/status", json={})
    with EtcdClient(etcd) as client:  # the same request with the manager's certificate
        assert client.status(endpoint).healthy


def _from_namespace(netns: Path, etcd: EtcdConfig, source: str, url: str) -> dict[str, Any]:
    """GET `url` from inside network namespace `netns`, from address `source` (a host's guest
    gateway: the path a guest's packets take), with the manager's client certificate."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            join_netns(str(netns))  # this thread only
            context = ssl.create_default_context(cafile=etcd.ca_file)
            context.load_cert_chain(etcd.cert_file, etcd.key_file)
            transport = httpx.HTTPTransport(verify=context, local_address=source)
            with httpx.Client(transport=transport, timeout=10) as client:
                result["json"] = client.get(url).json()
        except Exception as exc:  # reported by the test
            result["error"] = repr(exc)

    thread = threading.Thread(target=run, name="etcd-from-guest-network")
    thread.start()
    thread.join(30)
    return result


# Run inside a guest: a TLS handshake with each member, checking its certificate (the fleet CA,
# the member's address), then a request without a client certificate, which etcd must refuse.
IN_GUEST = r"""
import socket, ssl, sys
context = ssl.create_default_context(cafile=sys.argv[1])
port = int(sys.argv[2])
for host in sys.argv[3:]:
    try:
        with socket.create_connection((host, port), timeout=15) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: etcd\r\n\r\n")
                try:
                    data = tls.recv(64)
                    print(host, "verified;", f"answered {data[:12]!r}" if data else "refused (closed)")
                except (ssl.SSLError, OSError) as exc:
                    print(host, "verified; refused", type(exc).__name__)
    except Exception as exc:
        print(host, "failed", exc)
"""


def test_guest_networks_reach_every_member(carve_env: CarveEnv) -> None:
    addresses = [m.address for m in carve_env.sandbox.etcd.members()]
    assert carve_env.config.etcd is not None
    # From h1's guest network (10.77.1.1, its guests' gateway) to every member, h1's own included.
    for address in addresses:
        got = _from_namespace(carve_env.sandbox.host_named("h1").netns_path, carve_env.config.etcd, "10.77.1.1",
                              f"https://{address}:{CLIENT_PORT}/health")
        assert got.get("json") == {"health": "true"}, (address, got)
    fleet = Fleet(carve_env.config, carve_env.paths)
    try:
        guests = [g for inst in fleet.observe(with_endpoints=False) for g in inst.guests
                  if g.info.state == "running" and g.info.host == "h1"]
    finally:
        fleet.close()
    if not guests:
        pytest.skip("no running guest on h1 (test_carve.py leaves some): the host-side check above ran")
    argv = ["/usr/bin/python3", "-c", IN_GUEST, GUEST_CA_FILE, str(CLIENT_PORT), *addresses]
    code, out, err = guest_exec(carve_env, guests[0], argv, ["HOME=/root"])
    assert code == 0, (code, out, err)
    lines = out.strip().splitlines()
    assert len(lines) == len(addresses) and all("verified; refused" in line for line in lines), out
    print(f"from guest {guests[0].name}: {out.strip()}")


def test_one_member_stopped_keeps_the_quorum_and_shows(carve_env: CarveEnv) -> None:
    etcd, sandbox = carve_env.config.etcd, carve_env.sandbox
    assert etcd is not None
    others = {m.name: sandbox.etcd.running(m) for m in sandbox.etcd.members() if m.name != "h2"}
    stopped = sandbox.etcd.running(sandbox.etcd.member("h2"))
    assert stopped is not None
    try:
        sandbox.etcd.stop_member("h2")
        assert check(stopped) is not ProcessStatus.RUNNING
        found = health(carve_env)
        assert found.has_quorum and [m.name for m in found.members if not m.up] == ["h2"], found
        # Writes still go through (a quorum of two).
        with EtcdClient(etcd) as client:
            assert client.members() and client.status(etcd.endpoints[0]).healthy
        findings = etcd_findings(etcd)
        assert not [f for f in findings if f.status == "fail"], findings
        (down,) = [f for f in findings if f.status == "warn" and f.check == "member"]
        assert down.message.startswith("member h2 is down")
        # The manager's /metrics (its etcd watch polls every 5 s).
        with carve_env.client() as client:
            wait_for(lambda: 'pgcarve_etcd_member_up{member="h2"} 0.0' in client.get("/metrics").text,
                     "/metrics to show h2 down", 30)
            text = client.get("/metrics").text
            assert "pgcarve_etcd_has_quorum 1.0" in text and 'pgcarve_etcd_member_up{member="h0"} 1.0' in text
    finally:
        sandbox.up(3)  # idempotent: starts what is missing (h2), leaves the rest
    assert all(m.up for m in health(carve_env).members)
    for member in sandbox.etcd.members():
        if member.name in others:
            assert sandbox.etcd.running(member) == others[member.name], f"{member.name} was restarted"
    with carve_env.client() as client:
        wait_for(lambda: 'pgcarve_etcd_member_up{member="h2"} 1.0' in client.get("/metrics").text,
                 "/metrics to show h2 up again", 30)


def test_a_one_host_sandbox_gets_two_witnesses_and_grows(carve_env: CarveEnv) -> None:
    """A sandbox of its own (no guests, seconds): one host and two witness members, reached from
    the host's guest network; without its witnesses, no quorum; grown to two hosts, the new
    host's member joins the running cluster; down leaves no member, namespace or file. (carve_env
    only orders it among the shared tests.)"""
    paths, sandbox = clean_sandbox(IT_STATE.with_name(IT_STATE.name + "-etcd"))
    try:
        config = sandbox.up(1)
        assert config.etcd is not None
        witnesses = [m for m in sandbox.etcd.members() if m.witness]
        assert [(m.name, m.address) for m in witnesses] == [("witness1", "10.76.0.241"), ("witness2", "10.76.0.242")]
        found = sandbox.etcd.health()
        assert sorted(m.name for m in found.members if m.up) == ["h0", "witness1", "witness2"] and found.has_quorum
        got = _from_namespace(sandbox.host_named("h0").netns_path, config.etcd, "10.77.0.1",
                              f"https://{witnesses[0].address}:{CLIENT_PORT}/health")
        assert got.get("json") == {"health": "true"}, got
        # Both witnesses stopped: no quorum, and doctor says so from what the last member answers.
        for witness in witnesses:
            sandbox.etcd.stop_member(witness.name)
        # h0 answers, but once it notices it leads no quorum (an election timeout) it is not healthy.
        lost = wait_for(lambda: (h := sandbox.etcd.health()).members and not any(m.up for m in h.members) and h,
                        "h0 to report no quorum", 30)
        assert not lost.has_quorum and lost.members_known, lost
        (quorum,) = [f for f in etcd_findings(config.etcd) if f.check == "quorum"]
        assert quorum.status == "fail" and "etcd has no quorum: 0 of 3 members up, 2 needed" in quorum.message, quorum
        config = sandbox.up(2)  # starts the witnesses again, then adds h1's member
        assert config.etcd is not None and len(config.etcd.endpoints) == 4
        grown = sandbox.etcd.health()
        assert sorted(m.name for m in grown.members if m.up) == ["h0", "h1", "witness1", "witness2"], grown
        records = [r for m in sandbox.etcd.members() if (r := sandbox.etcd.running(m)) is not None]
        assert len(records) == 4
    finally:
        sandbox.down()
    assert sandbox.leftovers() == []
    assert not [r for r in records if check(r) is ProcessStatus.RUNNING]
    assert not paths.sandbox_dir.joinpath("etcd").exists()
