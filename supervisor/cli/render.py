"""The human `supervisorctl status` screen, from the same dict `status --json` prints: each block
reads itself back and says its own lines (supervisor/status/); this module only puts them in order."""

from __future__ import annotations

from supervisor.status import Block, View
from supervisor.status.alerts import AlertsBlock, NotifyBlock
from supervisor.status.cluster import ClusterBlock
from supervisor.status.disk import DiskBlock
from supervisor.status.gpu import Gpu, GpusBlock, WasteBlock
from supervisor.status.health import HealthBlock
from supervisor.status.idle import IdleBlock
from supervisor.status.misc import OrchestratorBlock
from supervisor.status.money import BudgetBlock
from supervisor.status.resume import ResumeBlock
from supervisor.status.spot import PreemptionBlock
from supervisor.status.sync import SyncBlock, TargetInfo
from supervisor.status.training import DaemonBlock, TrainingBlock
from supervisor.timefmt import stamp

# The screen's order, top to bottom.
SCREEN: tuple[type[Block], ...] = (
    TrainingBlock, GpusBlock, WasteBlock, SyncBlock, DiskBlock, IdleBlock, BudgetBlock, PreemptionBlock, HealthBlock,
    ResumeBlock, ClusterBlock, AlertsBlock, NotifyBlock, OrchestratorBlock, DaemonBlock,
)


def render_status(st: dict) -> str:
    v = View(st)
    return "\n".join(line for cls in SCREEN for line in v.block(cls).lines(v))


def _lines(cls: type[Block], st: dict) -> list[str]:
    v = View(st)
    return v.block(cls).lines(v)


# --- one block's lines from a status dict (what tests, benches and other screens call) ------------------


def training_line(st: dict) -> str:
    """supervisord's shape: name padded, state padded to 10, then details."""
    v = View(st)
    return v.block(TrainingBlock).head(v.now)


def progress_line(st: dict) -> str:
    """`progress  [######--------------]  1200/3750  32.0%  ...`, from `training.progress` and `cost`."""
    v = View(st)
    return v.block(TrainingBlock).progress_line(v)


def gpu_lines(st: dict) -> list[str]:
    """One line per GPU from `gpus`; empty when there are none (render_status then shows gpu_error)."""
    return [g.line() for g in GpusBlock.from_json(st).gpus]


def gpu_line(g: dict) -> str:
    """`GPU0 NVIDIA H100 80GB HBM3  util  97%  mem 71.2/80.0 GiB  train pid 1234 70.1 GiB`"""
    return Gpu.read(g).line()


def target_info_lines(info: dict) -> list[str]:
    return TargetInfo.read(info).lines()


def sync_lines(st: dict) -> list[str]:
    return _lines(SyncBlock, st)


def disk_lines(st: dict) -> list[str]:
    return _lines(DiskBlock, st)


def idle_lines(st: dict) -> list[str]:
    return _lines(IdleBlock, st)


def budget_lines(st: dict) -> list[str]:
    return _lines(BudgetBlock, st)


def preemption_lines(st: dict) -> list[str]:
    return _lines(PreemptionBlock, st)


def health_lines(st: dict) -> list[str]:
    return _lines(HealthBlock, st)


def resume_lines(st: dict) -> list[str]:
    return _lines(ResumeBlock, st)


def cluster_lines(st: dict) -> list[str]:
    return _lines(ClusterBlock, st)


def notify_lines(st: dict) -> list[str]:
    return _lines(NotifyBlock, st)


# --- the other screens: `supervisorctl alerts` and `supervisorctl health` --------------------------------

_DELIVERY = ("mailed", "not_mailed", "mail_failed")


def _delivery_note(d: dict) -> str:
    if d.get("what") == "mailed":
        return f"mailed {stamp(d.get('at', 0))}"
    if d.get("what") == "not_mailed":
        return f"not mailed: {d.get('reason') or 'no [email] configured'}"
    return f"mail failed: {d.get('error') or '?'}"


def render_alerts(res: dict) -> str:
    """One line per alert, with what became of its mail folded in: the log records an alert and
    its delivery separately, and two lines with the same subject read as two alerts."""
    recent = res.get("recent", [])
    lines: list[list] = []  # [entry, delivery entry or None]
    for a in recent:
        if a.get("what") in _DELIVERY:
            subj = a.get("subject", "")
            for line in reversed(lines):
                e = line[0]
                if (e.get("what") not in _DELIVERY and e.get("key") == a.get("key")
                        and subj in (e.get("subject"), f"RESOLVED: {e.get('subject')}")):
                    if line[1] is None or line[1].get("what") == "mail_failed":
                        line[1] = a
                        break
            else:
                lines.append([a, None])  # a reminder, or its alert is older than the list
            continue
        lines.append([a, None])
    out = []
    for a, d in lines:
        t = stamp(a.get("at", 0))
        what = a.get("what", "")
        if d is not None:
            extra = f"  ({_delivery_note(d)})"
        elif what in _DELIVERY:
            extra = f"  ({a['error']})" if a.get("error") else (f"  ({a['reason']})" if a.get("reason") else "")
        else:
            extra = ""
        via = f" [{a['channel']}]" if a.get("channel") and a.get("channel") != "email" else ""
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{via}{extra}")
    return "\n".join(out) if out else "no alerts"


_HEALTH_COLUMNS = (("ecc_mode", "ECC"), ("ecc_uncorrected_volatile", "unc.vol"), ("ecc_uncorrected_aggregate", "unc.agg"),
                   ("retired_pending", "retire.pend"), ("remap_pending", "remap.pend"), ("remap_failed", "remap.fail"),
                   ("pcie_gen", "gen"), ("pcie_gen_max", "gen.max"), ("pcie_width", "width"),
                   ("pcie_width_max", "width.max"), ("throttle", "clk.events"), ("temp_c", "temp C"),
                   ("power_w", "power W"), ("persistence", "persist"), ("nvlink_down", "nvlink.down"),
                   ("nvlink_up", "nvlink.up"))


def _cell(k: str, v) -> str:
    if v is None:
        return "?"
    if isinstance(v, bool):
        return "on" if v and k in ("ecc_mode", "persistence") else "off" if k in ("ecc_mode", "persistence") \
            else "yes" if v else "no"
    if k == "throttle":
        return hex(v)
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def render_health(h: dict) -> str:
    """`supervisorctl health`: the verdict, what to do, and every field per GPU ("?" = unknown)."""
    lines = [f"verdict   {h.get('verdict') or 'not checked yet'}"
             + (f" ({h.get('preflight')})" if h.get("preflight") else "")]
    if h.get("advice"):
        lines += [f"  {ln}" for ln in h["advice"].splitlines()]
    exp = h.get("expect_gpus")
    lines.append(f"gpus      {h.get('count') if h.get('count') is not None else 'none'}"
                 + (f" of {exp} expected ({h.get('expect_source')})" if exp else " (no expectation set)")
                 + f"; driver {h.get('driver_version') or '?'}, CUDA {h.get('cuda_version') or '?'}")
    if h.get("nvml_error"):
        lines.append(f"nvml      {h['nvml_error']}")
    for g in h.get("gpus") or []:
        if g.get("error"):
            lines.append(f"GPU {g['index']}     {g.get('name') or ''}: {g['error']}")
            continue
        cells = ", ".join(f"{label} {_cell(k, g.get(k))}" for k, label in _HEALTH_COLUMNS)
        lines.append(f"GPU {g['index']}     {g.get('name') or ''}: {cells}")
    b = h.get("burn_in") or {}
    if b.get("state") not in (None, "off"):
        tf = b.get("tflops") or {}
        lines.append(f"burn-in   {b.get('state')}" + (f": {b['note']}" if b.get("note") else "")
                     + (": " + ", ".join(f"GPU {i} {v} TFLOP/s" for i, v in sorted(tf.items(), key=lambda x: int(x[0])))
                        if tf else ""))
    for n in h.get("notes") or []:
        lines.append(f"note      {n}")
    for f in h.get("live") or []:
        lines.append(f"live      {'GPU ' + str(f['gpu']) + ': ' if f.get('gpu') is not None else ''}{f.get('what')}"
                     f" — {f.get('advice')}")
    if h.get("refused"):
        lines.append(f"refused   {h['refused']}")
    lines.append(f"on_bad    {h.get('on_bad')}")
    return "\n".join(lines)
