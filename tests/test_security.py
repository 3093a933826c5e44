"""Hostile use of the real daemon: garbage on the socket."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_deeply_nested_request_to_the_real_daemon_gets_an_error_reply(make_daemon, tmp_path):
    d = make_daemon({"stop": {"action": "dry-run"},
                     "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")}})
    for payload, needle in ((b"[" * 60000 + b"\n", "nested too deeply"),
                            (b'{"cmd": "status", "args": {"n": ' + b"9" * 5000 + b"}}\n", "not JSON"),
                            (b'{"cmd": "keepalive", "args": {"duration": ' + b"[" * 20000 + b"\n",
                             "nested too deeply")):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(10)
        c.connect(d.socket)
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        reply = json.loads(c.makefile("rb").readline())
        c.close()
        assert reply["ok"] is False and needle in reply["error"], reply
    assert d.req("ping")["pong"] is True
