"""Benchmarks: ``python -m bench [--size smoke|small|full] [--out bench/results] [--cases ...]``.

``make bench`` runs this module with ``$(BENCH_ARGS)``. Three parts, each written as JSON and a
PNG chart into ``--out``, plus ``summary.md`` rebuilt from every JSON found there (so parts run
separately still end up in one summary):

* ``control-plane`` (no guest boots; libvirt's test driver): reconcile 0 -> N pinned domains
  across 8 large test-driver hosts through the planner, ``DomainSpec`` and ``LibvirtHost``, in
  parallel the way ``Scaler`` does; ``GET /v1/instances`` latency at N through the real FastAPI
  app; the planner's time on a 512-CPU host; optionally the whole ``Scaler``/``Provisioner``
  path with only the guest-side waits stubbed (tests/support/testdriver.py).
* ``scale-out`` (boots guests): ``PUT /v1/scale`` until every new primary accepts writes with a
  streaming synchronous standby, split into control-plane time and guest boot.
* the experiment's cases ``carved``, ``single``, ``multi-instance``, ``no-replica`` (boot guests;
  ``multi-process``, the older approximation of multi-instance, only when named):
  the insert-only pgbench load of ``../shared/seeds``, aggregate and per-instance TPS, latency
  percentiles from pgbench's per-transaction log, host and guest CPU user/system split, versions
  and a plain verdict.

Guest parts run in the local sandbox (state directory ``--state``, default
``/var/tmp/pgcarve-bench``), always stopped again in ``finally``, or on real hosts from
``--hosts-file`` (guests of a dedicated fleet name, removed at the end). See bench/README.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pgcarve.errors import PgcarveError
from pgcarve.settings import Settings

from bench.control_plane import control_plane
from bench.experiment import ExperimentParams, experiment
from bench.harness import (
    ALL_CASES,
    CONTROL_PLANE,
    DEFAULT_CASES,
    DEFAULT_OUT,
    DEFAULT_STATE,
    EXPERIMENT_CASES,
    SCALE_OUT,
    SIZES,
    loadavg,
    log,
)
from bench.scale_out import scale_out
from bench.summary import write_summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="smoke: minutes, proves the harness; small: this 2-CPU machine (default); "
                             "full: the experiment's sizes on real hosts (--hosts-file)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory (default bench/results)")
    parser.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(DEFAULT_CASES), metavar="CASE",
                        help=f"any of {', '.join(ALL_CASES)} (default: all but multi-process)")
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE,
                        help="state directory for the sandbox and secrets (default /var/tmp/pgcarve-bench)")
    parser.add_argument("--hosts-file", type=Path, default=None,
                        help="real hosts instead of the sandbox (needed for --size full)")
    g = parser.add_argument_group("control plane")
    g.add_argument("--cp-instances", type=int, help="instances to reconcile on the test driver")
    g.add_argument("--cp-requests", type=int, help="GET /v1/instances requests")
    g.add_argument("--no-scaler-path", action="store_true", help="skip the whole-Scaler path measurement")
    g = parser.add_argument_group("experiment")
    g.add_argument("--instances", type=int, help="N: carved instances and vCPUs of the single instance")
    g.add_argument("--standbys", type=int, help="standbys per primary")
    g.add_argument("--clients", type=int, help="total pgbench clients per case")
    g.add_argument("--threads", type=int, help="total pgbench threads per case")
    g.add_argument("--seconds", type=int, help="pgbench duration per case")
    g.add_argument("--repeats", type=_positive_int, default=3,
                   help="runs of every case, interleaved (default 3; fewer always gives an inconclusive verdict)")
    g.add_argument("--sampling-rate", type=float, help="share of transactions written to pgbench's log")
    g.add_argument("--memory-mib", type=int, help="guest memory (default: the hosts file's / sandbox's)")
    g.add_argument("--vcpus", type=int, help="V: vCPUs per carved guest (the single guest gets N x V); default 1 "
                   "in the sandbox, instance.vcpus of the hosts file on real hosts")
    g.add_argument("--clients-per-instance", action="store_true",
                   help="every carved instance / cluster / table gets --clients (default: split them)")
    g.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                   help="postgresql.conf setting applied with ALTER SYSTEM before each case (repeatable; "
                        "settings that need a restart are reported, not applied)")
    g.add_argument("--force", action="store_true", help="run guest parts even when the load average is high")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    size = SIZES[args.size]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # One settings object for the run: PGCARVE_IMAGE_DIR and PGCARVE_HOSTS_FILE apply as everywhere
    # in pgcarve; the bench's own state directory is --state.
    pgcarve_settings = Settings(state_dir=args.state)
    hosts_file = args.hosts_file or pgcarve_settings.hosts_file
    if hosts_file == Path("."):  # PGCARVE_HOSTS_FILE="" (pydantic reads ".") means unset, as it always did
        hosts_file = None
    settings: dict[str, str] = {}
    for item in args.pg_setting:
        name, sep, value = item.partition("=")
        if not sep or not re.match(r"^[a-z_][a-z0-9_.]*$", name):
            print(f"--pg-setting {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        settings[name] = value
    guest_cases = [c for c in args.cases if c != CONTROL_PLANE]
    if guest_cases and size.name == "full" and hosts_file is None:
        print("--size full runs the guest parts on real hosts: pass --hosts-file (see bench/README.md), "
              "or --cases control-plane", file=sys.stderr)
        return 2
    rc = 0
    if CONTROL_PLANE in args.cases:
        doc = control_plane(out, instances=args.cp_instances or size.cp_instances,
                            requests=args.cp_requests or size.cp_requests,
                            scaler_path=size.cp_scaler_path and not args.no_scaler_path, size=size.name)
        rec, get, pl = doc["reconcile"], doc["get_instances_summary"], doc["planner"]
        log(f"control plane: reconcile 0 -> {doc['verify']['instances_observed']} {rec['wall_s']:.2f} s, "
            f"GET p50 {get['p50_ms']:.1f} ms p99 {get['p99_ms']:.1f} ms, planner p50 {pl.get('p50_ms')} ms")
    load1 = loadavg()[0] if loadavg() else 0.0
    if guest_cases and size.name != "smoke" and hosts_file is None and load1 >= 2.5 and not args.force:
        log(f"load average {load1} >= 2.5: guest parts at size {size.name} would measure the other load too; "
            "skipped (use --size smoke, wait, or --force)")
        guest_cases, rc = [], 3
    if guest_cases:
        paths = pgcarve_settings.paths
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        if SCALE_OUT in guest_cases:
            try:
                scale_out(out, paths, size.scale_hosts, args.standbys if args.standbys is not None
                          else size.scale_standbys, size.scale_steps, hosts_file, size.name, size.notes)
            except PgcarveError as exc:
                log(f"scale-out failed: {exc}")
                rc = 1
        exp_cases = [c for c in guest_cases if c in EXPERIMENT_CASES]
        if exp_cases:
            params = ExperimentParams(
                instances=args.instances or size.exp_instances,
                standbys=args.standbys if args.standbys is not None else size.exp_standbys,
                clients=args.clients or size.clients, threads=args.threads or size.threads,
                seconds=args.seconds or size.seconds,
                sampling_rate=args.sampling_rate or size.sampling_rate, pg_settings=settings,
                memory_mib=args.memory_mib, vcpus=args.vcpus, clients_per_target=args.clients_per_instance,
                repeats=args.repeats)
            try:
                doc = experiment(out, paths, exp_cases, params, size.exp_hosts, hosts_file, size.name, size.notes)
                log(f"verdict: {doc.get('verdict', {}).get('text')}")
                if any("error" in r for r in doc["cases"].values()):
                    rc = 1
            except PgcarveError as exc:
                log(f"experiment failed: {exc}")
                rc = 1
    summary = write_summary(out)
    log(f"wrote {summary}")
    return rc


def _stop(signum: int, _frame: object) -> None:
    # Once only: a second signal during the clean-up would abort it and leave the sandbox up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


if __name__ == "__main__":
    # Stopping the bench stops what it started: SIGTERM, and SIGINT even where the shell that put
    # it in the background set SIGINT to be ignored, end the run through its `finally` blocks
    # (the sandbox and the bench's guests go).
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
