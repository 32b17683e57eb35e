"""Commands in a guest through its QEMU guest agent (virt/agent.py), against a stand-in for the
agent that answers guest-exec and guest-exec-status as qemu-ga does."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from pgcarve.errors import GuestCommandFailed
from pgcarve.virt import agent
from pgcarve.virt.host import LibvirtHost


class FakeAgent:
    def __init__(self, polls_before_exit: int, exit_code: int = 0, out: str = "", err: str = "") -> None:
        self.polls_before_exit = polls_before_exit
        self.exit_code, self.out, self.err = exit_code, out, err
        self.started: list[dict[str, Any]] = []

    def __call__(self, _dom: object, command: str, timeout: int, flags: int) -> str:
        doc = json.loads(command)
        if doc["execute"] == "guest-exec":
            self.started.append(doc["arguments"])
            return json.dumps({"return": {"pid": 4242}})
        assert doc == {"execute": "guest-exec-status", "arguments": {"pid": 4242}}
        if self.polls_before_exit > 0:
            self.polls_before_exit -= 1
            return json.dumps({"return": {"exited": False}})
        return json.dumps({"return": {"exited": True, "exitcode": self.exit_code,
                                      "out-data": base64.b64encode(self.out.encode()).decode(),
                                      "err-data": base64.b64encode(self.err.encode()).decode()}})


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> LibvirtHost:
    monkeypatch.setattr(agent, "POLL_S", 0.01)
    lv = LibvirtHost("h0", "test:///default")
    monkeypatch.setattr(LibvirtHost, "conn", property(lambda _self: type("C", (), {"lookupByName": lambda _s, n: n})()))
    return lv


def test_a_command_runs_as_the_user_asked_and_its_output_comes_back(host: LibvirtHost,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAgent(polls_before_exit=2, out='[{"name": "pgc-01"}]', err="")
    monkeypatch.setattr(agent.libvirt_qemu, "qemuAgentCommand", fake)
    result = agent.run_in_guest(host, "pgc-01", ["tool", "--stanza=pgc-01", "info"], 5, user="postgres")
    assert result.exit_code == 0 and json.loads(result.stdout) == [{"name": "pgc-01"}]
    assert fake.started == [{"path": agent.RUN_AS, "arg": ["-u", "postgres", "--", "tool", "--stanza=pgc-01", "info"],
                             "capture-output": True}]


def test_a_failure_keeps_its_exit_code_and_words(host: LibvirtHost, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent.libvirt_qemu, "qemuAgentCommand", FakeAgent(0, exit_code=56, err="ERROR: [056]"))
    result = agent.run_in_guest(host, "pgc-01", ["/usr/bin/tool"], 5)
    assert (result.exit_code, result.stderr) == (56, "ERROR: [056]")


def test_a_command_still_running_at_its_deadline_is_an_error(host: LibvirtHost,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent.libvirt_qemu, "qemuAgentCommand", FakeAgent(polls_before_exit=10**6))
    with pytest.raises(GuestCommandFailed, match="still running after 0 s"):
        agent.run_in_guest(host, "pgc-01", ["/usr/bin/sleep", "99"], 0.05)
