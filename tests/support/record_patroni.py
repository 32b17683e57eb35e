"""Record what a real Patroni writes, for tests/unit/test_patroni_view.py (tests/data/patroni/).

    .venv/bin/python -m tests.support.record_patroni OUT [--members 3] [--quorum] [--failsafe]
        [--patroni-source DIR]

Starts etcd and Patroni members on 127.0.0.1 (tests/support/patroni_local.py), and writes the
range answer of `/service/` (every key, as dcs/etcd.py decodes it) at each stage: `steady` (a
leader with its synchronous standbys, every member running), `after_switchover` (the same again
with another leader), `paused`; the REST API's answers beside them (`rest_*.json`); with
--failsafe, the leader's GET /patroni once etcd is stopped and failsafe mode holds. The Patroni is
Debian's (/usr/bin/patroni), or the `patroni` package of a source tree (--patroni-source, e.g.
`git archive v4.0.7 patroni` of patroni/patroni, run with this host's python3). Every process is
stopped by its PID at the end, also on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from pgcarve.dcs.etcd import EtcdClient

from tests.support import localpg
from tests.support.patroni_local import API_PASSWORD, API_USER, DCS_SETTINGS, PATRONI, LocalPatroniCluster

SCOPE = "pgc-01"
PREFIX = f"/service/{SCOPE}/"


def keys(client: EtcdClient) -> tuple[dict[str, Any], dict[str, str]]:
    found = client.range_prefix("/service/")
    doc = {"revision": found.revision, "kvs": [
        {"key": kv.key, "value": kv.value, "mod_revision": kv.mod_revision, "create_revision": kv.create_revision,
         "version": kv.version, "lease": kv.lease} for kv in found.kvs]}
    return doc, {kv.key.removeprefix(PREFIX): kv.value for kv in found.kvs}


def settled(values: dict[str, str], members: int, leader: str | None = None) -> bool:
    """A leader (`leader` if named) whose `sync` key names it and every other member, all running."""
    sync = json.loads(values.get("sync") or "{}")
    standbys = [s for s in str(sync.get("sync_standby") or "").split(",") if s]
    running = [json.loads(v).get("state") == "running" for k, v in values.items() if k.startswith("members/")]
    return (sync.get("leader") == values.get("leader") and (leader is None or values.get("leader") == leader)
            and len(standbys) == members - 1 and len(running) == members and all(running))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--members", type=int, default=2, choices=(2, 3))
    parser.add_argument("--quorum", action="store_true", help="synchronous_mode: quorum (Patroni 4)")
    parser.add_argument("--failsafe", action="store_true", help="stop etcd last and record the leader's status")
    parser.add_argument("--patroni-source", type=Path, help="a directory holding Patroni's `patroni` package")
    args = parser.parse_args(argv)

    def stop_on_term(*_: object) -> None:
        raise SystemExit(2)

    signal.signal(signal.SIGTERM, stop_on_term)
    args.out.mkdir(parents=True, exist_ok=True)
    names = (SCOPE, *(f"{SCOPE}-s{i}" for i in range(1, args.members)))
    dcs: dict[str, object] = dict(DCS_SETTINGS)
    if args.quorum:
        dcs["synchronous_mode"] = "quorum"
    command: tuple[str, ...] = (PATRONI,)
    if args.patroni_source is not None:
        command = ("env", f"PYTHONPATH={args.patroni_source.resolve()}", "python3", "-m", "patroni")
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-patroni-record-")))
    cluster = LocalPatroniCluster(base, SCOPE, names, dcs, command)

    def write(name: str, doc: object) -> None:
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")

    def wait(what: str, client: EtcdClient, leader: str | None = None) -> dict[str, str]:
        deadline = time.monotonic() + 90
        while True:
            doc, values = keys(client)
            if settled(values, len(names), leader):
                return values
            for member in cluster.members:
                if not member.running():
                    raise SystemExit(f"Patroni {member.name} exited: {member.log_tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: not within 90 s; keys: {json.dumps(doc)}")
            time.sleep(0.5)

    try:
        config = cluster.start()
        with EtcdClient(config) as client, httpx.Client(verify=str(cluster.etcd.certs.ca_file),
                                                        auth=(API_USER, API_PASSWORD), timeout=60) as api:
            values = wait("a settled cluster", client)
            write("steady", keys(client)[0])
            leader = values["leader"]
            other = next(n for n in names if n != leader)
            write("rest_patroni_leader", api.get(cluster.member(leader).api_url + "/patroni").json())
            write("rest_patroni_replica", api.get(cluster.member(other).api_url + "/patroni").json())
            write("rest_cluster", api.get(cluster.member(leader).api_url + "/cluster").json())
            answer = api.post(cluster.member(leader).api_url + "/switchover",
                              json={"leader": leader, "candidate": other})
            print(f"switchover {leader} -> {other}: HTTP {answer.status_code} {answer.text}")
            wait("a settled cluster after the switchover", client, other)
            write("after_switchover", keys(client)[0])
            write("rest_cluster_after_switchover", api.get(cluster.member(other).api_url + "/cluster").json())
            answer = api.patch(cluster.member(other).api_url + "/config", json={"pause": True})
            print(f"pause: HTTP {answer.status_code}")
            deadline = time.monotonic() + 30
            while not all(json.loads(v).get("pause") for k, v in keys(client)[1].items() if k.startswith("members/")):
                if time.monotonic() > deadline:
                    raise SystemExit("the members never said they were paused")
                time.sleep(0.5)
            write("paused", keys(client)[0])
            api.patch(cluster.member(other).api_url + "/config", json={"pause": None})
            if args.failsafe:
                wait("a resumed cluster", client, other)
                cluster.etcd.stop()
                deadline = time.monotonic() + 60
                while not (status := api.get(cluster.member(other).api_url + "/patroni").json()).get(
                        "failsafe_mode_is_active"):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"failsafe mode never became active: {status}")
                    time.sleep(0.5)
                write("rest_patroni_failsafe_leader", status)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"recorded in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
