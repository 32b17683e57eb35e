"""Scale-out latency (boots guests): PUT /v1/scale through the real app until every new primary
accepts writes with a streaming synchronous standby, split into control-plane time and guest
boot. Writes scale-out.json (and .png)."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import remove_all, with_size
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.removal import leftovers
from pgcarve.control.state_check import prepare_state
from pgcarve.errors import PgcarveError
from pgcarve.naming import instance_name
from pgcarve.postgres.pgbench import create_test_table, insert_row
from pgcarve.postgres.replication import streaming_synchronous_standbys
from pgcarve.postgres.session import CLIENT_DATABASE
from pgcarve.settings import Paths

from bench.charts import chart_scale_out, save_chart
from bench.guests import guest_hosts, prepare_hosts
from bench.harness import AUTH, SCALE_OUT, TOKEN, bench_fleet, finish, log, run_meta, write_json


@dataclass
class StepRecorder:
    """Timestamps of Provisioner.create_instance's progress callbacks (monotonic, first of each step)."""

    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, step: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), name, step))

    def clear(self) -> None:
        with self.lock:
            self.events.clear()

    def first(self, name: str, *prefixes: str) -> float | None:
        with self.lock:
            for t, n, step in self.events:
                if n == name and step.startswith(prefixes):
                    return t
        return None


class RecordingProvisioner(Provisioner):
    """The real Provisioner; create_instance also hands every progress step to a StepRecorder
    (an operation's own `steps` keep only the last step per guest)."""

    def __init__(self, fleet: Fleet, recorder: StepRecorder):
        super().__init__(fleet)
        self.recorder = recorder

    def create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        def recording(name: str, step: str, fraction: float) -> None:
            self.recorder.record(name, step)
            progress(name, step, fraction)

        return super().create_instance(index, recording)


def write_probe(fleet: Fleet, guest: Guest, want_sync: bool) -> dict[str, Any]:
    """One committed insert on a new primary; with standbys, also its synchronous standby's state."""
    t = time.perf_counter()
    with fleet.connect(guest, database=CLIENT_DATABASE) as conn:
        create_test_table(conn)
        insert_row(conn, "scale-out probe")
        sync = streaming_synchronous_standbys(conn)
    return {"commit_ms": round((time.perf_counter() - t) * 1000, 1),
            "streaming_sync_standbys": sync,
            "ok": bool(sync) or not want_sync}


def wait_operation(client: Any, op_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        op = client.get(f"/v1/operations/{op_id}").json()
        if op["status"] in ("succeeded", "failed"):
            return dict(op)
        time.sleep(0.25)
    raise PgcarveError(f"operation {op_id} did not finish in {timeout_s:.0f} s")


def instance_breakdown(fleet: Fleet, rec: StepRecorder, index: int, t0: float, standbys: int) -> dict[str, Any]:
    """Split one instance's creation into control-plane segments and guest-boot segments."""
    name = instance_name(fleet.config.fleet, index)

    def at(guest: str, *prefixes: str) -> float:
        t = rec.first(guest, *prefixes)
        if t is None:
            raise PgcarveError(f"no '{prefixes[0]}' step recorded for {guest}")
        return t - t0

    p_disk = at(name, "disk and seed")
    p_started = at(name, "booting", "waiting for PostgreSQL", "primary accepts SQL")
    p_sql = at(name, "primary accepts SQL")
    seg: dict[str, float] = {
        "queue_and_plan": p_disk,
        "primary_disk_seed_define_start": p_started - p_disk,
    }
    ready = p_sql
    if standbys:
        # The standbys start as soon as the primary's address is known (reserved before it boots,
        # or else its first DHCP lease) and boot while it does (control/provisioning.py); they
        # stream (or clone) once it accepts SQL.
        snames = [f"{name}-s{s}" for s in range(1, standbys + 1)]
        p_address = at(name, "booting at")
        s_started = max(at(s, "booting", "waiting for PostgreSQL", "standby replaying") for s in snames)
        ready = at(name, "ready")
        seg["primary_start_to_known_address"] = max(0.0, p_address - p_started)
        seg["standby_disk_seed_define_start"] = s_started - max(p_address, p_started)
        seg["primary_rest_of_boot_to_sql"] = p_sql - s_started
        seg["standby_streaming_after_primary_sql"] = ready - p_sql
    else:
        seg["primary_boot_to_sql"] = p_sql - p_started
    control = seg["queue_and_plan"] + seg["primary_disk_seed_define_start"] + seg.get(
        "standby_disk_seed_define_start", 0.0)
    guest = fleet.instance(name).primary
    if guest is None:
        raise PgcarveError(f"{name} has no primary after the scale")
    probe = write_probe(fleet, guest, want_sync=bool(standbys))
    return {
        "instance": name,
        "segments_s": {k: round(v, 2) for k, v in seg.items()},
        "control_plane_s": round(control, 2),
        "guest_boot_s": round(ready - control, 2),
        "ready_s": round(ready, 2),
        "write_probe": probe,
    }


def scale_out(out: Path | None, paths: Paths, hosts: int, standbys: int, steps: Sequence[int],
              hosts_file: Path | None = None, size: str = "custom", notes: Sequence[str] = (),
              charts: bool = True) -> dict[str, Any]:
    """Time PUT /v1/scale -> every new primary accepts writes with a streaming sync standby."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from pgcarve.control.service import ManagerService
    from pgcarve_api.main import create_app
    from pgcarve_api.settings import Settings

    doc: dict[str, Any] = {"part": SCALE_OUT, **run_meta(size), "notes": list(notes)}
    results: list[dict[str, Any]] = []
    doc["steps"] = results
    with guest_hosts(paths, hosts, hosts_file, doc) as base:
        config = with_size(base, standbys=standbys, fleet=bench_fleet("o"))
        (paths.state_dir / "operations.json").unlink(missing_ok=True)  # never resume an old bench's scale
        recorder = StepRecorder()
        service = ManagerService(config, paths, refresh_s=5.0, collect=False, supervise=False)
        fleet = service.fleet
        prepare_state(fleet)  # as `serve` does: a new fleet's secrets, never new ones over live guests
        service.scaler.provisioner = RecordingProvisioner(fleet, recorder)
        try:
            remove_all(fleet)
            doc["prepare"] = prepare_hosts(fleet)
            doc["setup"] = {"standbys": standbys, "instance": config.instance.model_dump(),
                            "synchronous_commit": config.replication.synchronous_commit,
                            "hosts": [f"{h.name} ({h.role})" for h in config.hosts]}
            service.start()
            app = create_app(Settings(state_dir=paths.state_dir, token=TOKEN), service=service)
            with TestClient(app, base_url="http://127.0.0.1:8080") as client:  # a Host the API accepts
                current = 0
                for add in steps:
                    target = current + add
                    log(f"scale-out: PUT /v1/scale {current} -> {target}")
                    recorder.clear()
                    t0 = time.monotonic()
                    resp = client.put("/v1/scale", json={"instances": target}, headers=AUTH)
                    put_ms = (time.monotonic() - t0) * 1000
                    if resp.status_code != 202:
                        raise PgcarveError(f"PUT /v1/scale {target}: {resp.status_code} {resp.text}")
                    op_id = resp.json()["operation"]
                    op = wait_operation(client, op_id, timeout_s=3600)
                    t_done = time.monotonic()
                    if op["status"] != "succeeded":
                        raise PgcarveError(f"scale to {target} failed: {op.get('error')}")
                    step: dict[str, Any] = {"from": current, "to": target, "added": add,
                                            "put_response_ms": round(put_ms, 1),
                                            "operation_s": round(t_done - t0, 2), "instances": []}
                    for index in range(current + 1, target + 1):
                        step["instances"].append(instance_breakdown(fleet, recorder, index, t0, standbys))
                    t_ready = [i["ready_s"] for i in step["instances"]]
                    step["all_ready_s"] = round(max(t_ready), 2)
                    step["control_plane_s"] = round(max(i["control_plane_s"] for i in step["instances"]), 2)
                    step["guest_boot_s"] = round(max(i["guest_boot_s"] for i in step["instances"]), 2)
                    step["all_writes_ok"] = all(i["write_probe"]["ok"] for i in step["instances"])
                    results.append(step)
                    log(f"scale-out: +{add} ready in {step['all_ready_s']} s (control plane "
                        f"{step['control_plane_s']} s, guest boot {step['guest_boot_s']} s)")
                    current = target
                log(f"scale-out: PUT /v1/scale {current} -> 0")
                t0 = time.monotonic()
                resp = client.put("/v1/scale", json={"instances": 0}, headers=AUTH)
                op = wait_operation(client, resp.json()["operation"], timeout_s=1800)
                doc["scale_in"] = {"from": current, "to": 0, "status": op["status"],
                                   "seconds": round(time.monotonic() - t0, 2)}
            doc["fleet_leftovers"] = leftovers(fleet)
        finally:
            service.stop()
            with contextlib.suppress(Exception):
                remove_all(fleet)
            fleet.close()
    finish(doc)
    if out is not None:
        write_json(out / "scale-out.json", doc)
        if charts:
            save_chart(chart_scale_out, doc, out / "scale-out.png")
    return doc
