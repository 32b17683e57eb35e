"""`pgcarve etcd-certificate`: certificates from the fleet CA for an etcd on real hosts.

A member's certificate serves (clients and peers check its addresses) and dials (members connect
to each other); a client's (the manager, an operator's etcdctl) only proves who it is. Each is
written to a directory with the fleet CA's certificate beside it, as etcd's --trusted-ca-file.
The sandbox makes its own (pgcarve.sandbox.etcd).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pgcarve.cli.display import console
from pgcarve.cli.fleet_commands import open_fleet
from pgcarve.control.state_check import prepare_state
from pgcarve.guest.tls import FleetCA, write_key_and_certificate
from pgcarve.settings import Settings
from pgcarve.statedir.layout import make_fleet_ca_if_new


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cert = sub.add_parser("etcd-certificate", help="issue an etcd member's or client's certificate from the fleet CA")
    cert.add_argument("name", help="member name (e.g. db1), or the client's name with --client (its common name)")
    cert.add_argument("--ip", action="append", default=[], help="an address the member answers on (repeat)")
    cert.add_argument("--dns", action="append", default=[], help="a DNS name the member answers to (repeat)")
    cert.add_argument("--client", action="store_true", help="a client certificate (clientAuth only, no addresses)")
    cert.add_argument("--out", required=True, help="directory for NAME.pem, NAME.key (0600) and ca.pem")
    cert.set_defaults(func=cmd_etcd_certificate)


def _fleet_ca(args: argparse.Namespace, settings: Settings) -> FleetCA:
    """The fleet CA; for a new fleet made here (etcd comes before the first `pgcarve up`). With a hosts
    file, "new" is checked on the hosts as `pgcarve up` checks it; without one, on the state directory."""
    ca = FleetCA(settings.paths.tls_dir)
    if ca.exists():
        return ca
    if settings.hosts_file_path(args.hosts_file).exists():
        fleet = open_fleet(args, settings)
        try:
            made = prepare_state(fleet)
        finally:
            fleet.close()
    else:
        made = [what for what in [make_fleet_ca_if_new(settings.paths)] if what]
    for what in made:
        console.print(f"made {what}")
    return ca


def cmd_etcd_certificate(args: argparse.Namespace, settings: Settings) -> int:
    ca = _fleet_ca(args, settings)
    if args.client:
        issued = ca.issue_certificate(common_name=args.name, dns_names=args.dns, ip_addresses=args.ip,
                                      server=False, client=True)
    else:
        issued = ca.issue_certificate(common_name=args.name, dns_names=args.dns, ip_addresses=args.ip,
                                      server=True, client=True)
    out = Path(args.out)
    cert_file, key_file = write_key_and_certificate(out, args.name, issued)
    shutil.copyfile(ca.cert_file, out / "ca.pem")
    console.print(f"wrote {cert_file}, {key_file} (0600) and {out / 'ca.pem'} (the fleet CA in {ca.directory})")
    return 0
