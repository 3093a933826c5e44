"""HostCheck (host memory) and DiskFloor (disk space): their alerts, on this machine's real psutil figures (thresholds
chosen so the outcome is certain) and on scripted figures for the thresholds' edges."""

from __future__ import annotations

from collections import namedtuple

from supervisor.disk.floor import DiskFloor
from supervisor.gpu.hostcheck import HostCheck
from tests.fixtures.nvml import GIB, make_ctx

VM = namedtuple("VM", "total available")
DU = namedtuple("DU", "total used free")


def keys(ctx) -> set[str]:
    return {a["key"] for a in ctx.alerts.active()}


def test_real_memory_and_disk_fine(tmp_path, clock):
    ctx = make_ctx(tmp_path, clock, {"alerts": {"host_mem_min_pct": 0.0, "disk_free_min_pct": 0.0}})
    out = HostCheck(ctx, ctx.config.alerts).poll()
    assert out["memory"]["total_bytes"] > 0 and 0 <= out["memory"]["available_pct"] <= 100
    disks = DiskFloor(ctx, ctx.config.alerts, [str(tmp_path)]).poll()
    assert disks and disks[0]["total_bytes"] > 0
    assert keys(ctx) == set()


def test_real_memory_low_raises_and_resolves(tmp_path, clock):
    ctx = make_ctx(tmp_path, clock, {"alerts": {"host_mem_min_pct": 100.0}})
    h = HostCheck(ctx, ctx.config.alerts)
    h.poll()
    assert keys(ctx) == {"host:mem_low"}
    (a,) = ctx.alerts.active()
    assert a["kind"] == "host_mem_low" and "host memory almost exhausted" in a["subject"]
    ctx.config.alerts.host_mem_min_pct = 0.0
    h.poll()
    assert keys(ctx) == set()


def test_real_disk_low_raises_once_per_filesystem(tmp_path, clock):
    (tmp_path / "out").mkdir()
    ctx = make_ctx(tmp_path, clock, {"alerts": {"disk_free_min_pct": 100.0, "host_mem_min_pct": 0.0,
                                                "disk_paths": [str(tmp_path / "out")]}})
    h = DiskFloor(ctx, ctx.config.alerts, [str(tmp_path), str(tmp_path / "not-created-yet" / "checkpoints")])
    out = h.poll()
    assert len(out) == 1 and len(out[0]["paths"]) == 3  # one filesystem, one alert
    (a,) = ctx.alerts.active()
    assert a["kind"] == "disk_full" and "disk almost full" in a["subject"] and str(tmp_path / "out") in a["subject"]
    body = [r for r in ctx.alerts.recent() if r["what"] == "raised"][0]["body"]
    assert "save_total_limit" in body
    ctx.config.alerts.disk_free_min_pct = 0.0
    h.poll()
    assert keys(ctx) == set()


def test_memory_threshold_with_margin(tmp_path, clock):
    avail = [4.0]
    ctx = make_ctx(tmp_path, clock, {"alerts": {"host_mem_min_pct": 5.0}})
    h = HostCheck(ctx, ctx.config.alerts, virtual_memory=lambda: VM(100 * GIB, avail[0] * GIB))
    h.poll()
    assert keys(ctx) == {"host:mem_low"}
    (a,) = ctx.alerts.active()
    assert "4.0 GiB of 100.0 GiB available (4.0%)" in a["subject"]
    body = [r for r in ctx.alerts.recent() if r["what"] == "raised"][0]["body"]
    assert "dataloader_num_workers" in body and "OOM killer" in body
    avail[0] = 5.5   # above the threshold, within the margin: still low
    h.poll()
    assert keys(ctx) == {"host:mem_low"}
    avail[0] = 6.5
    h.poll()
    assert keys(ctx) == set()


def test_disk_threshold_with_margin(tmp_path, clock):
    free = [4.0]
    ctx = make_ctx(tmp_path, clock, {"alerts": {"disk_free_min_pct": 5.0, "host_mem_min_pct": 0.0}})
    h = DiskFloor(ctx, ctx.config.alerts, [str(tmp_path)], disk_usage=lambda p: DU(100 * GIB, (100 - free[0]) * GIB, free[0] * GIB))
    h.poll()
    assert keys(ctx) == {f"disk:low:{tmp_path}"}
    free[0] = 5.9
    h.poll()
    assert keys(ctx) == {f"disk:low:{tmp_path}"}
    free[0] = 7.0
    h.poll()
    assert keys(ctx) == set()


def test_a_broken_probe_is_logged_and_tried_again(tmp_path, clock):
    def boom():
        raise OSError("no /proc/meminfo")

    ctx = make_ctx(tmp_path, clock, {"alerts": {"host_mem_min_pct": 100.0}})
    assert HostCheck(ctx, ctx.config.alerts, virtual_memory=boom).poll() == {"memory": None}
    assert keys(ctx) == set()


def test_unusable_paths_are_skipped(tmp_path, clock):
    def du(p):
        raise PermissionError(p)

    ctx = make_ctx(tmp_path, clock, {"alerts": {"disk_free_min_pct": 100.0, "host_mem_min_pct": 0.0}})
    assert DiskFloor(ctx, ctx.config.alerts, [str(tmp_path)], disk_usage=du).poll() == []
    assert keys(ctx) == set()


def test_a_filesystem_the_disk_wing_watches_gets_one_alert_not_two(tmp_path, clock):
    from supervisor.disk.watch import DiskWatch

    ctx = make_ctx(tmp_path, clock, {"alerts": {"disk_free_min_pct": 100.0}})
    disk = DiskWatch(ctx, ctx.config.disk, None, [str(tmp_path / "out")], free_min_pct=100.0)
    h = DiskFloor(ctx, ctx.config.alerts, [str(tmp_path / "out"), str(tmp_path / "state")], covered=disk.covers)
    disk.poll()
    assert h.poll()  # still measured and shown
    (a,) = ctx.alerts.active()
    assert a["kind"] == "disk_forecast" and a["subject"].startswith("disk almost full")
    ctx.config.alerts.disk_free_min_pct = disk.free_min_pct = 0.0
    disk.poll()
    h.poll()
    assert keys(ctx) == set()
