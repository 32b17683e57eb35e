"""`POST /v1/advice` as an operation: the advice runs on the operation queue's worker (one
operation at a time, so a scale waits for it), its progress goes to the operation, and each
finished run is kept in the state directory (advice/<operation>.json and .html) for the API and
the dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pgcarve.advice.advisor import run_advice
from pgcarve.advice.plan import AdviceRequest, plan_advice
from pgcarve.advice.report import render_html
from pgcarve.control.operations import Operation
from pgcarve.control.service import ManagerService
from pgcarve.errors import NotFound

KIND = "advice"
RUN_ID = re.compile(r"^[0-9a-f]{12}$")  # an operation id


class AdviceStore:
    """Finished advice runs, one JSON document and one HTML page per operation."""

    def __init__(self, directory: Path):
        self.directory = directory

    def save(self, run_id: str, doc: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{run_id}.html").write_text(render_html(doc))
        (self.directory / f"{run_id}.json").write_text(json.dumps(doc, indent=1))

    def _path(self, run_id: str, suffix: str) -> Path:
        path = self.directory / f"{run_id}{suffix}"
        if not RUN_ID.match(run_id) or not path.exists():
            raise NotFound(f"no advice run {run_id!r}")
        return path

    def get(self, run_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self._path(run_id, ".json").read_text())
        return doc

    def page(self, run_id: str) -> str:
        return self._path(run_id, ".html").read_text()

    def summaries(self) -> list[dict[str, Any]]:
        """Every kept run, newest first: when, which host, the verdict."""
        found = []
        for path in self.directory.glob("*.json") if self.directory.exists() else ():
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            verdict = doc.get("verdict", {})
            found.append({"id": path.stem, "host": doc.get("plan", {}).get("host"),
                          "started_at": doc.get("started_at"), "finished_at": doc.get("finished_at"),
                          "word": verdict.get("word"), "headline": verdict.get("headline"),
                          "reason": verdict.get("reason"), "caveat": verdict.get("caveat"),
                          "host_left_as_it_was": doc.get("host_left_as_it_was"),
                          "report": f"/v1/advice/{path.stem}/report"})
        return sorted(found, key=lambda d: str(d.get("finished_at") or ""), reverse=True)


def request_of(params: dict[str, object]) -> AdviceRequest:
    """An operation's params back as the request (only the API's fields: no --image over HTTP)."""
    fields = ("host", "max_instances", "seconds", "repeat", "clients", "spare")
    return AdviceRequest(**{k: params[k] for k in fields if k in params})  # type: ignore[arg-type]


def register(service: ManagerService, store: AdviceStore) -> None:
    """Let the service's operation queue run advice operations."""

    def run(op: Operation) -> str:
        # Checked again: the host may have changed since the request was accepted.
        plan = plan_advice(service.fleet, request_of(op.params))

        def step(done: int, total: int, what: str) -> None:
            service.operations.update(op, progress=round(min(0.99, done / total if total else 0.0), 3), message=what)

        doc = run_advice(service.fleet, plan, step=step)
        doc["operation"] = op.id
        store.save(op.id, doc)
        verdict = doc.get("verdict", {})
        service.operations.update(op, result={"word": verdict.get("word"), "headline": verdict.get("headline"),
                                              "host_left_as_it_was": doc.get("host_left_as_it_was"),
                                              "report": f"/v1/advice/{op.id}/report"})
        if not doc.get("host_left_as_it_was"):
            raise RuntimeError("the advice left something behind: " + "; ".join(doc.get("left_behind", [])))
        return str(verdict.get("text") or "no verdict")

    service.operations.runners[KIND] = run
