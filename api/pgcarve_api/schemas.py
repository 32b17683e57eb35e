"""Request and response models: the public contract (paths and field names are relied upon)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    ha_loop: Literal["watching", "starting", "off"] = Field(
        "off", description="watching: every host's lifecycle events are followed and the start-up sweep for faults "
                           "missed while no manager ran is done; starting: not yet; off: PGCARVE_SUPERVISE=0, or "
                           "a standby manager (the leader runs the HA loop)")
    role: Literal["leader", "standby"] = Field(
        "leader", description="leader: this manager acts on the fleet; standby: it serves reads and answers "
                              "mutations with 503 naming the leader (several managers share the fleet through etcd)")
    leadership: dict[str, Any] = Field(
        default_factory=dict, description="the lease (etcd key, TTL), this manager's epoch, the leader's URL, pid "
                                          "and host; without an etcd section: one manager per state directory")


class HostOut(BaseModel):
    name: str
    uri: str
    role: Literal["primary", "standby"]
    cpus: int
    numa_nodes: int
    memory_mib: int
    free_cpus: int
    instances: int
    watching_events: bool | None = Field(
        None, description="the manager is subscribed to this host's libvirt lifecycle events (null: not supervising)")


class StandbyOut(BaseModel):
    name: str
    host: str
    state: str | None
    sync_state: str | None
    replay_lag_bytes: int | None


class EndpointsOut(BaseModel):
    """Where an application connects: libpq multi-host URIs over all of the instance's guests, for
    its application role and database, without the password (GET /v1/instances/{name}/credentials).
    They stay the same for the instance's whole life: libpq asks each host in turn and keeps the
    first that suits, so after a failover the same string reaches the new primary. The server's
    certificate is verified with the fleet CA (`sslmode=verify-ca`); `sslrootcert` names the CA
    file on the API's machine: elsewhere, save `GET /v1/ca.pem` and point `sslrootcert` at it."""

    rw: str = Field(description="the primary: target_session_attrs=read-write")
    ro: str = Field(description="a standby if one answers, else the primary: target_session_attrs=prefer-standby")


class PatroniMemberOut(BaseModel):
    name: str = Field(description="the guest")
    role: str = Field(description="Patroni's: primary (3.0 says master), replica, standby_leader")
    state: str = Field(description="running, starting, stopped, crashed, creating replica, ...")
    timeline: int | None
    lag_bytes: int | None = Field(description="behind the leader's last position (null for the leader, or unknown)")


class PatroniOut(BaseModel):
    """Under `replication.roles: patroni`: the instance as Patroni's keys in etcd say, as last read."""

    leader: str | None = Field(description="the guest holding the leader key; null: none (commits stop)")
    synchronous: list[str] = Field(description="the standbys Patroni made synchronous")
    synchronous_mode: str | None = Field(description="on, quorum or off (null before the cluster bootstrapped)")
    timeline: int | None
    paused: bool = Field(description="Patroni is paused: no automatic failover")
    members: list[PatroniMemberOut]
    problem: str | None = Field(description="what is wrong, in words; null when nothing is")


class InstanceOut(BaseModel):
    name: str
    primary: str | None = Field(None, description="the guest that is primary now (under Patroni: the holder of "
                                "the instance's leader key in etcd); null while none is")
    host: str | None
    state: str
    vcpus: list[int] = Field(description="host CPU ids the instance's vCPUs are pinned to")
    memory_mib: int
    dsn: str | None = Field(description="the admin role's postgresql:// URI for the current primary, without the "
                            "password (kept for compatibility: applications use `endpoints`)")
    endpoints: EndpointsOut | None = Field(None, description="the application's URIs (null while no guest of the "
                                           "instance can be listed yet)")
    writes: str = Field("unknown", description="whether commits are accepted now, and if not, why")
    incident: str | None = Field(None, description="the latest fault not recovered yet, if any")
    standbys: list[StandbyOut]
    patroni: PatroniOut | None = Field(None, description="under Patroni: its leader, synchronous standbys, "
                                       "timeline and members (null when the manager decides roles)")
    retired_at: float | None = Field(None, description="retired instances: when (unix time); their disks are kept")
    disk_mib: int | None = Field(None, description="retired instances: space their kept disks take")


class PurgeOut(BaseModel):
    name: str
    purged_mib: int = Field(description="disk space freed")
    volumes: list[str] = Field(description="the guests whose disks were deleted, and where")


class CredentialsOut(BaseModel):
    """An instance's application login: a role that is not a superuser and cannot replicate,
    owning its own database. Each instance has its own password."""

    user: str
    password: str
    database: str


class IncidentOut(BaseModel):
    id: int
    instance: str
    guest: str
    host: str
    role: str
    what: str
    cause: str
    detected_at: float = Field(description="when libvirt's event (or the periodic check) reported it")
    source: Literal["event", "sweep"]
    status: Literal["recovering", "recovered", "failed", "reported"]
    action: str
    message: str
    finished_at: float | None
    attempts: int


class ScaleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instances: int = Field(ge=0, le=100000, strict=True, description="the number of instances wanted")


class AdviceIn(BaseModel):
    """pgcarve advise's options (no --image over HTTP: the server's image is measured)."""

    model_config = ConfigDict(extra="forbid")
    host: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,30}$", description="default: the first primary host")
    max_instances: int | None = Field(None, ge=2, le=4096, strict=True, description="default: the host's capacity")
    seconds: int = Field(30, ge=5, le=3600, strict=True, description="each pgbench run")
    repeat: int = Field(3, ge=1, le=20, strict=True, description="runs of every case, interleaved")
    clients: int | None = Field(None, ge=1, le=1000, strict=True, description="default: found by a short ramp")
    spare: bool = Field(False, description="use only the free slots of a host that runs guests")


class AdviceAccepted(BaseModel):
    operation: str
    status: str
    plan: dict[str, object] = Field(description="what will be carved, and estimate_s: about how long it takes")


class FailoverIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,62}$", description="the standby to promote")
    force: bool = Field(False, description="promote `to` even if it cannot be proven to hold every acknowledged "
                                           "commit (the result says what may be missing)")


class SwitchoverIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,62}$",
                           description="the standby to hand the primary's role to (default: the synchronous one)")


class BackupIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["full", "diff", "incr"] = Field(
        "full", description="full; diff: what changed since the last full backup; incr: since the last backup")


class BackupOut(BaseModel):
    label: str
    type: Literal["full", "diff", "incr"]
    started_at: float = Field(description="UNIX time")
    stopped_at: float = Field(description="UNIX time; a restore can stop at any point from here on")
    size_bytes: int = Field(description="the database as the backup copied it")
    repository_bytes: int = Field(description="what the backup added to the repository (compressed, changed files)")
    wal_start: str = Field(description="the first WAL segment a restore of it needs")
    wal_stop: str = Field(description="the last WAL segment a consistent restore of it needs")
    lsn_start: str | None
    lsn_stop: str | None
    prior: str | None = Field(description="the backup a diff or incr builds on")
    error: bool = Field(description="the tool found page checksum errors while copying")


class WindowOut(BaseModel):
    earliest: float = Field(description="UNIX time: the oldest point a restore can recover to (the end of the "
                                        "oldest backup)")
    latest_proven: float = Field(description="UNIX time: the newest backup's end; archived WAL extends the "
                                             "window past it towards now (wal_last)")
    wal_last: str | None = Field(description="the newest WAL segment in the archive")


class BackupsOut(BaseModel):
    instance: str
    status: str = Field(description="ok, or what the backup tool says is wrong with the instance's stanza")
    backups: list[BackupOut] = Field(description="oldest first")
    wal: list[dict[str, str]] = Field(description="archived WAL per database generation: archive_id, first, last")
    window: WindowOut | None = Field(description="none while the instance has no backup")


class OperationAccepted(BaseModel):
    operation: str
    status: Literal["pending", "running", "succeeded", "failed"]
    kind: str


class ScaleAccepted(BaseModel):
    operation: str
    status: Literal["pending", "running", "succeeded", "failed"]
    target: int


class OperationOut(BaseModel):
    id: str
    kind: str
    status: Literal["pending", "running", "succeeded", "failed"]
    target: int
    progress: float = Field(ge=0, le=1)
    message: str
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    steps: dict[str, dict[str, object]]
    params: dict[str, object] = Field(default_factory=dict, description="failover/switchover: instance, to, force")
    result: dict[str, object] = Field(default_factory=dict,
                                      description="what it did: new_primary, host; failover: proven, may_be_missing; "
                                                  "switchover: write_pause_s")


class SlotOut(BaseModel):
    index: int
    host_cpus: list[int]
    numa_node: int
    memory_mib: int


class HostPlanOut(BaseModel):
    host: str
    role: str
    housekeeping_cpus: list[int]
    emulator_cpus: list[int]
    capacity: int
    slots: list[SlotOut]
    notes: list[str]
    explanation: str


class InstanceRateOut(BaseModel):
    tps: float
    qps: float | None
    replay_lag_bytes: int | None
    sampled_at: float = Field(description="unix time of this instance's newest sample: the totals hold its "
                              "transactions up to then (older than `at` when its polls fail)")


class WaitsOut(BaseModel):
    """What an instance's client sessions waited on, sampled from its primary's pg_stat_activity
    (GET /v1/instances/{name}/waits)."""

    instance: str
    window_s: float = Field(description="the samples of the last window_s seconds")
    samples: int = Field(description="samples of pg_stat_activity in the window")
    sessions: int = Field(description="client sessions seen, summed over the samples")
    shares: dict[str, float] = Field(
        description="fraction of the sessions seen in each category: SyncRep (a commit waits for its synchronous "
                    "standby), WAL write, WAL insert, other LWLocks, IPC, lock, IO, client (waiting for the "
                    "client), CPU (running), other")
    meaning: dict[str, str] = Field(description="what each category counts")
    dominant: str | None = Field(description="the category with the largest share (null: nothing sampled)")
    summary: str
    error: str | None = Field(description="why the last sample failed, if it did")


class TpsOut(BaseModel):
    aggregate_tps: float = Field(description="client transactions per second, summed over the primaries "
                                 "(autovacuum and pgcarve's own sessions excluded)")
    aggregate_qps: float = Field(description="client statements per second (pg_stat_statements)")
    window_s: float
    at: float = Field(description="unix time of the snapshot")
    xacts_total: int = Field(description="client transactions counted since the server started; the difference "
                             "between two snapshots is exactly what clients ran between them")
    statements_total: int = Field(description="client statements counted since the server started")
    instances: dict[str, InstanceRateOut]
