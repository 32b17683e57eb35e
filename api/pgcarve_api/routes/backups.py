"""An instance's backups: take one (an operation), list them with the recoverable window."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, status

from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.schemas import BackupIn, BackupOut, BackupsOut, OperationAccepted, WindowOut

router = APIRouter(prefix="/v1", tags=["backups"], dependencies=[ReadAuth])


@router.post("/instances/{name}/backups", response_model=OperationAccepted, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[MutationAuth])
def take_backup(name: str, body: BackupIn, service: ServiceDep) -> OperationAccepted:
    """Take a backup of the instance (default full). Runs as an operation (GET /v1/operations/{id}):
    its steps are the stanza, an archiving check, the backup, and its result names the backup."""
    op = service.backups.request(name, body.type)
    return OperationAccepted(operation=op.id, status=op.status, kind=op.kind)


@router.get("/instances/{name}/backups", response_model=BackupsOut)
def list_backups(name: str, service: ServiceDep) -> BackupsOut:
    """The instance's backups as the repository has them, oldest first, its archived WAL and its
    recoverable window. Read from the repository on every request (through the primary)."""
    catalog = service.backups.catalog_of(name)
    window = catalog.window
    return BackupsOut(
        instance=catalog.name, status=catalog.status,
        backups=[BackupOut(**{**asdict(b), "type": b.type.value}) for b in catalog.backups],
        wal=[{"archive_id": r.archive_id, "first": r.first, "last": r.last} for r in catalog.wal],
        window=WindowOut(**asdict(window)) if window is not None else None)
