"""etcd without an etcd: the hosts file's section, the certificates issued for it, what a probe
means (dcs/health.py), what doctor says about it, what /metrics exports, and the sandbox's plan
of members (with witnesses) and their command lines. tests/integration/test_etcd.py runs the
real members."""

from __future__ import annotations

import itertools
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pgcarve.cli.main import main
from pgcarve.config import EtcdConfig, FleetConfig
from pgcarve.control.doctor_etcd import ETCD, decide, etcd_findings
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.dcs.health import assess
from pgcarve.dcs.watch import EtcdWatch
from pgcarve.errors import ConfigError
from pgcarve.guest.tls import certificate_names, issue_certificate, new_ca
from pgcarve.sandbox.etcd import ELECTION_MS, HEARTBEAT_MS, member_args, plan_members
from pgcarve_api.etcd_metrics import EtcdMetrics
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from tests.support.etcd import CONFIG, FakeEtcdClient, cluster

# -- the hosts file ---------------------------------------------------------------------------


def fleet(etcd: object) -> dict[str, object]:
    return {"hosts": [{"name": "db1", "uri": "qemu:///system"}], "replication": {"standbys": 0}, "etcd": etcd}


def section(**changes: object) -> dict[str, object]:
    return {"endpoints": ["https://10.0.0.1:2379", "https://10.0.0.2:2379", "https://10.0.0.3:2379"],
            "ca_file": "/etc/pgcarve/etcd-ca.pem", "cert_file": "/etc/pgcarve/etcd-client.pem",
            "key_file": "/etc/pgcarve/etcd-client.key"} | changes


def test_an_etcd_section_is_read_and_optional() -> None:
    config = FleetConfig.model_validate(fleet(section()))
    assert config.etcd is not None and config.etcd.endpoints[2] == "https://10.0.0.3:2379"
    assert config.etcd.timeout_s == 3.0
    assert FleetConfig.model_validate(fleet(None)).etcd is None


@pytest.mark.parametrize(("change", "said"), [
    ({"endpoints": ["http://10.0.0.1:2379"]}, "must start with https://"),
    ({"endpoints": ["https://10.0.0.1"]}, "is not https://ADDRESS:PORT"),
    ({"endpoints": ["https://10.0.0.1:2379/v3"]}, "is not https://ADDRESS:PORT"),
    ({"endpoints": ["https://10.0.0.1:2379", "https://10.0.0.1:2379"]}, "listed twice"),
    ({"endpoints": []}, "at least 1 item"),
    ({"ca_file": "etcd-ca.pem"}, "must be an absolute path"),
    ({"timeout_s": 0}, "greater than or equal to 0.2"),
    ({"user": "root"}, "Extra inputs are not permitted"),
])
def test_a_bad_etcd_section_is_refused_naming_the_problem(change: dict[str, object], said: str) -> None:
    with pytest.raises(ValueError, match="etcd") as caught:
        FleetConfig.model_validate(fleet(section(**change)))
    assert said in str(caught.value)


def test_the_client_names_a_missing_tls_file() -> None:
    with pytest.raises(ConfigError, match=r"etcd.ca_file /nonexistent/ca.pem does not exist"):
        EtcdClient(CONFIG)


# -- certificates -----------------------------------------------------------------------------


def usages(pem: bytes) -> set[x509.ObjectIdentifier]:
    cert = x509.load_pem_x509_certificate(pem)
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_a_member_certificate_serves_and_dials_for_its_addresses(tmp_path: Path) -> None:
    ca = new_ca()
    member = issue_certificate(ca, common_name="h1", ip_addresses=["10.76.0.2", "127.0.0.1"], server=True, client=True)
    assert certificate_names(member.cert_pem) == ([], ["10.76.0.2", "127.0.0.1"])
    assert usages(member.cert_pem) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    cert = x509.load_pem_x509_certificate(member.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "h1"
    # It verifies against the CA for its address (what etcd's peers and clients check).
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    assert context.verify_mode == ssl.CERT_REQUIRED


def test_a_client_certificate_has_a_name_and_no_server_use() -> None:
    client = issue_certificate(new_ca(), common_name="patroni-pgc-01", server=False, client=True)
    assert usages(client.cert_pem) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert certificate_names(client.cert_pem) == ([], [])
    cert = x509.load_pem_x509_certificate(client.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "patroni-pgc-01"


def test_certificates_refuse_what_cannot_be_issued() -> None:
    ca = new_ca()
    with pytest.raises(ConfigError, match="a server, a client, or both"):
        issue_certificate(ca, common_name="x", server=False, client=False)
    with pytest.raises(ConfigError, match="common name"):
        issue_certificate(ca, server=False, client=True)
    with pytest.raises(ConfigError, match="not an IP address"):
        issue_certificate(ca, common_name="h0", ip_addresses=["10.76.0.300"], server=True, client=True)


# -- what a probe means -----------------------------------------------------------------------


def test_three_healthy_members_have_a_quorum_and_a_leader() -> None:
    health = assess(cluster(["h0", "h1", "h2"], leader="h1"))
    assert [m.name for m in health.members if m.up] == ["h0", "h1", "h2"]
    assert health.leader == "h1" and health.quorum == 2 and health.has_quorum


def test_one_member_down_keeps_the_quorum_two_do_not() -> None:
    one = assess(cluster(["h0", "h1", "h2"], down=["h2"]))
    assert one.has_quorum and one.up == 2 and [p.endpoint for p in one.unreachable] == [CONFIG.endpoints[2]]
    assert next(m for m in one.members if m.name == "h2").detail == "no configured endpoint answered as this member"
    two = assess(cluster(["h0", "h1", "h2"], down=["h1", "h2"]))
    assert not two.has_quorum and two.up == 1


def test_a_leader_that_is_down_or_unhealthy_members_mean_no_quorum() -> None:
    gone = assess(cluster(["h0", "h1", "h2"], down=["h0"], leader="h0"))
    assert gone.leader is None and not gone.has_quorum
    sick = assess(cluster(["h0", "h1", "h2"], unhealthy=["h1", "h2"]))
    assert not sick.has_quorum and "reports itself unhealthy" in sick.members[1].detail


def test_an_earlier_member_list_stands_in_when_none_answers() -> None:
    earlier = cluster(["h0", "h1", "h2"]).members
    health = assess(cluster(["h0", "h1", "h2"], down=["h0", "h1", "h2"], listed=False), earlier)
    assert health.members_known and [m.up for m in health.members] == [False, False, False]
    assert not assess(cluster(["h0"], down=["h0"], listed=False)).members_known


# -- doctor -----------------------------------------------------------------------------------


def statuses(findings: list) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for f in findings:
        assert f.host == ETCD
        found.setdefault(f.check, []).append(f.status)
    return found


def test_doctor_is_content_with_three_healthy_members() -> None:
    findings = etcd_findings(CONFIG, lambda _c: cluster(["h0", "h1", "h2"]))
    assert {f.status for f in findings} == {"ok"}
    assert "quorum: 3 of 3 members up (2 needed), leader h0" in [f.message for f in findings]


def test_doctor_warns_about_one_member_down_while_the_quorum_holds() -> None:
    findings = decide(assess(cluster(["h0", "h1", "h2"], down=["h1"])), CONFIG)
    assert statuses(findings) == {"endpoint": ["warn", "ok"], "members": ["ok"], "member": ["ok", "warn", "ok"],
                                  "quorum": ["ok"]}
    down = next(f for f in findings if f.check == "member" and f.status == "warn").message
    assert down.startswith("member h1 is down") and "one more member lost stops it" in down


def test_doctor_fails_without_a_quorum_saying_how_many_are_needed() -> None:
    findings = decide(assess(cluster(["h0", "h1", "h2"], down=["h1", "h2"])), CONFIG)
    (quorum,) = [f for f in findings if f.check == "quorum"]
    assert quorum.status == "fail" and "1 of 3 members up, 2 needed" in quorum.message
    assert statuses(findings)["member"] == ["ok", "fail", "fail"]


@pytest.mark.parametrize("names", [["h0"], ["h0", "h1"]])
def test_doctor_fails_with_fewer_than_three_members_saying_why(names: list[str]) -> None:
    findings = decide(assess(cluster(names)), CONFIG)
    (members,) = [f for f in findings if f.check == "members"]
    assert members.status == "fail"
    assert f"etcd has {len(names)} member" in members.message and "fewer than 3" in members.message
    assert "a fleet on two hosts needs a third, witness member" in members.message


def test_doctor_fails_when_no_endpoint_answers_and_warns_without_a_section() -> None:
    findings = decide(assess(cluster(["h0", "h1", "h2"], down=["h0", "h1", "h2"], listed=False)), CONFIG)
    assert statuses(findings) == {"endpoint": ["fail", "fail", "fail"], "members": ["fail"]}
    (missing,) = etcd_findings(None)
    assert missing.status == "warn" and "no etcd section in the hosts file" in missing.message


def test_doctor_reports_unusable_tls_files_as_a_failure() -> None:
    (found,) = etcd_findings(CONFIG)  # the real client, with files that do not exist
    assert found.status == "fail" and "etcd.ca_file /nonexistent/ca.pem does not exist" in found.message


# -- /metrics ----------------------------------------------------------------------------------


def exposition(watch: EtcdWatch) -> str:
    registry = CollectorRegistry()
    registry.register(EtcdMetrics(watch))
    return generate_latest(registry).decode()


def test_metrics_show_each_member_and_the_quorum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pgcarve.dcs.watch.EtcdClient", FakeEtcdClient)
    watch = EtcdWatch(CONFIG)
    assert "\npgcarve_etcd_has_quorum " not in exposition(watch)  # nothing before the first poll
    monkeypatch.setattr(FakeEtcdClient, "answer", cluster(["h0", "h1", "h2"], leader="h1"))
    watch.poll_once()
    text = exposition(watch)
    for line in ('pgcarve_etcd_member_up{member="h0"} 1.0', 'pgcarve_etcd_member_leader{member="h1"} 1.0',
                 'pgcarve_etcd_member_leader{member="h0"} 0.0', "pgcarve_etcd_has_quorum 1.0",
                 "pgcarve_etcd_members 3.0"):
        assert line in text, text
    # Every member silent, no member list: the last one known shows them down.
    monkeypatch.setattr(FakeEtcdClient, "answer", cluster(["h0", "h1", "h2"], down=["h0", "h1", "h2"], listed=False))
    watch.poll_once()
    text = exposition(watch)
    assert 'pgcarve_etcd_member_up{member="h2"} 0.0' in text and "pgcarve_etcd_has_quorum 0.0" in text


def test_metrics_say_no_quorum_when_the_tls_files_are_unusable() -> None:
    watch = EtcdWatch(EtcdConfig(**CONFIG.model_dump()))  # the real client: its files do not exist
    assert watch.poll_once() is None and watch.error is not None
    assert "pgcarve_etcd_has_quorum 0.0" in exposition(watch)


# -- the sandbox's members ----------------------------------------------------------------------


def test_the_sandbox_adds_witnesses_up_to_three_members(tmp_path: Path) -> None:
    one = plan_members(tmp_path, "abc123", [("h0", "pgc-abc123-h0", "10.76.0.1")])
    assert [(m.name, m.address, m.witness) for m in one] == [
        ("h0", "10.76.0.1", False), ("witness1", "10.76.0.241", True), ("witness2", "10.76.0.242", True)]
    assert one[1].netns == "pgc-abc123-witness1" and one[1].directory == tmp_path / "witness1"
    two = plan_members(tmp_path, "abc123", [("h0", "n0", "10.76.0.1"), ("h1", "n1", "10.76.0.2")])
    assert [m.name for m in two] == ["h0", "h1", "witness1"]
    four = plan_members(tmp_path, "abc123", [(f"h{i}", f"n{i}", f"10.76.0.{i + 1}") for i in range(4)])
    assert not any(m.witness for m in four)


def test_a_member_runs_tls_both_ways_with_timeouts_for_a_busy_machine(tmp_path: Path) -> None:
    cluster_ = plan_members(tmp_path, "abc123", [("h0", "n0", "10.76.0.1"), ("h1", "n1", "10.76.0.2")])
    args = member_args(cluster_[1], cluster_, "pgc-abc123", new=True)
    pairs = dict(itertools.pairwise(args))  # each flag with what follows it
    assert pairs["--listen-client-urls"] == "https://10.76.0.2:2379"
    assert pairs["--listen-peer-urls"] == "https://10.76.0.2:2380"
    assert pairs["--initial-cluster"] == ("h0=https://10.76.0.1:2380,h1=https://10.76.0.2:2380,"
                                          "witness1=https://10.76.0.241:2380")
    assert pairs["--initial-cluster-state"] == "new"
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args and "--pre-vote" in args
    assert not any(a.startswith("http://") for a in args)
    assert (int(pairs["--heartbeat-interval"]), int(pairs["--election-timeout"])) == (HEARTBEAT_MS, ELECTION_MS)
    assert ELECTION_MS >= 10 * HEARTBEAT_MS  # etcd's tuning guide: an election timeout of 10 heartbeats or more
    later = dict(itertools.pairwise(member_args(cluster_[0], cluster_, "t", new=False)))
    assert later["--initial-cluster-state"] == "existing"  # a member started again, or added to a running cluster


# -- certificates for real hosts (`pgcarve etcd-certificate`) -----------------------------------


def test_the_cli_issues_member_and_client_certificates_from_the_fleet_ca(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(tmp_path / "state"))
    assert main(["etcd-certificate", "db1", "--ip", "192.0.2.11", "--dns", "db1.example.net",
                 "--out", str(tmp_path / "db1")]) == 0
    member = (tmp_path / "db1" / "db1.pem").read_bytes()
    assert certificate_names(member) == (["db1.example.net"], ["192.0.2.11"])
    assert usages(member) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert (tmp_path / "db1" / "db1.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "db1" / "ca.pem").read_bytes() == (tmp_path / "state" / "tls" / "ca.pem").read_bytes()
    assert main(["etcd-certificate", "pgcarve-manager", "--client", "--out", str(tmp_path / "mgr")]) == 0
    assert usages((tmp_path / "mgr" / "pgcarve-manager.pem").read_bytes()) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    # A member certificate without an address is refused, and nothing is written.
    assert main(["etcd-certificate", "db2", "--out", str(tmp_path / "db2")]) == 2
    assert not (tmp_path / "db2").exists()


def test_no_new_ca_for_etcd_where_the_state_directory_records_a_fleet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a hosts file, the state directory alone says whether the fleet is new (the sandbox asks
    the same before its hosts run): instances recorded there depend on the CA that is missing."""
    state = tmp_path / "state"
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)  # no ./hosts.yaml
    (state / "instances").mkdir(parents=True)
    (state / "instances" / "pgc-01.json").write_text("{}")
    (state / "instances" / "pgc-01.json").chmod(0o600)
    assert main(["etcd-certificate", "db1", "--ip", "192.0.2.11", "--out", str(tmp_path / "db1")]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "records instances pgc-01 but lacks the fleet CA" in said and "pgcarve state import" in said, said
    assert not (state / "tls" / "ca.key").exists() and not (tmp_path / "db1").exists()
