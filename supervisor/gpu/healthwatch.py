"""The GPU health shell: reads the health fields through the one NVML probe, asks
supervisor.gpu.health for the verdict, keeps it for status and metrics, and sends the alerts.

- `preflight(when)`: at daemon start (in the background, with the burn-in when one is configured)
  and before each training start (`check_start`, the Training's before_start hook). BAD or DEGRADED
  is an alert sent at once; with health.on_bad = "refuse" a BAD machine starts no training
  (TrainingError says why), with "stop" the daemon's stop callback stops the machine (the alert is
  queued first, and the stop sequence flushes alerts before its action).
- `poll()`: the duty. At rest it refreshes the verdict; during a run it looks for new
  uncorrectable ECC errors, a sustained slowdown with the utilisation dropping, and the run slower
  than at its start while a GPU throttles (rates from the progress tracker, handed in as `rate`).
  A lost GPU is the GPU monitor's alert (gpu:failed); here it only turns the verdict BAD.
- The GPU count of the first boot is kept in state_dir (`health.json`): health.expect_gpus = 0 means
  "as many as the first time".
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import structlog

from supervisor.config import HealthConfig, TrainingConfig
from supervisor.context import Context
from supervisor.gpu import health as H
from supervisor.gpu.nvml import NvmlProbe
from supervisor.interfaces import Duty, TrainingView, Verb
from supervisor.notify.mails import health as words
from supervisor.states import TRAINING_ALIVE, TrainingState
from supervisor.status import Block
from supervisor.status.health import HealthBlock
from supervisor.training.job import TrainingError, start_env
from supervisor.training.runner import as_user
from supervisor.training.safeopen import open_to_others, user_ids
from supervisor.training.tmux import server_env, transient_service, under_systemd

log = structlog.get_logger("health")

# The burn-in, run by the training's own Python: a bf16 matmul on every GPU at once for `seconds`.
BURN_IN = r"""
import json, sys, threading, time
try:
    import torch
except Exception as e:
    print(json.dumps({"skipped": f"torch is not importable ({type(e).__name__})"})); sys.exit(0)
if not torch.cuda.is_available():
    print(json.dumps({"skipped": "torch sees no CUDA device"})); sys.exit(0)
seconds = float(sys.argv[1]); n = 8192; out = {}
def run(i):
    d = torch.device("cuda", i)
    a = torch.randn(n, n, device=d, dtype=torch.bfloat16); b = torch.randn(n, n, device=d, dtype=torch.bfloat16)
    for _ in range(3): a @ b
    torch.cuda.synchronize(d)
    t0 = time.perf_counter(); k = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10): a @ b
        torch.cuda.synchronize(d); k += 10
    out[i] = 2 * n ** 3 * k / (time.perf_counter() - t0) / 1e12
ts = [threading.Thread(target=run, args=(i,)) for i in range(torch.cuda.device_count())]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"tflops": out, "torch": torch.__version__}))
"""

# How the burn-in's Python starts: the environment arrives on stdin, never in argv (which every local
# user reads in /proc) nor in a transient unit's properties (which `systemctl show` prints to anyone);
# the Python then runs the burn-in in a fresh exec of itself with exactly that environment (the
# loader reads LD_LIBRARY_PATH only at a process's start).
BOOT = ("import json, os, sys; e = json.loads(sys.stdin.read()); "
        "os.execve(sys.executable, [sys.executable, '-c', sys.argv[1], *sys.argv[2:]], e)")


class HealthWatch:
    def __init__(self, ctx: Context, conf: HealthConfig, job: TrainingConfig, probe: NvmlProbe, training: TrainingView | None = None, *,
                 rate: Callable[[], tuple[int | None, float | None]] | None = None,
                 stop_machine: Callable[[str, str], object] | None = None, gpu_every: float = 5.0):
        self.ctx = ctx
        self.cfg = conf
        self.every = max(1.0, min(60.0, 3 * gpu_every))   # live faults: every third GPU poll, 1 s to 1 min
        self.job = job      # the training's env, workdir and user: the burn-in runs as the training would
        self.probe = probe
        self.training = training
        self.rate = rate
        self.stop_machine = stop_machine
        self._lock = threading.Lock()
        self._verdict: H.Verdict | None = None
        self._facts: H.HealthFacts | None = None
        self._checked_at: float | None = None
        self._at_rest = True
        self._when = ""
        self._live = H.LiveState()
        self._live_run: int | None = None
        self._live_active: dict[str, H.LiveFinding] = {}
        self._rate_start: tuple[int, float] | None = None
        self._burn: dict[str, Any] = {"state": "off" if not self.cfg.burn_in else "pending"}
        self._refused = ""
        self._stop_asked = False
        saved = ctx.store.load("health", None)
        self._first: dict = saved if isinstance(saved, dict) else {}

    # --- expectations ---------------------------------------------------------------------------
    def expect(self) -> tuple[int | None, str]:
        if self.cfg.expect_gpus:
            return self.cfg.expect_gpus, "health.expect_gpus"
        n = self._first.get("first_count")
        if isinstance(n, int) and n > 0:
            return n, "the count at first boot"
        return None, ""

    def _remember_first(self, facts: H.HealthFacts) -> None:
        if isinstance(self._first.get("first_count"), int) or not facts.count:
            return
        self._first = {**self._first, "first_count": facts.count, "first_at": self.ctx.clock.time()}
        try:
            self.ctx.store.save("health", self._first)
        except OSError as e:
            log.error("health_state_save_failed", error=str(e))

    def _state(self) -> TrainingState | None:
        """The training's state; None when it cannot be read (judged as under load: no rest-only faults)."""
        if self.training is None:
            return TrainingState.STOPPED
        try:
            return self.training.info().state
        except Exception:  # noqa: BLE001
            log.exception("training_info_failed")
            return None

    def _alive(self) -> bool:
        state = self._state()
        return state is None or state in TRAINING_ALIVE

    # --- the preflight ----------------------------------------------------------------------------
    def preflight(self, when: str = "on request", *, burn_in: bool = False, alert: bool = True) -> H.Verdict:
        facts = self.probe.health()
        self._remember_first(facts)
        at_rest = not self._alive()
        if burn_in and self.cfg.burn_in and facts.gpus:
            self._burn_in_once(at_rest)
        expect, _ = self.expect()
        v = H.judge(facts, expect, at_rest=at_rest, burn_in=self._burn.get("tflops"))
        with self._lock:
            self._verdict, self._facts, self._at_rest, self._when = v, facts, at_rest, when
            self._checked_at = self.ctx.clock.time()
        log.info("gpu_health", when=when, verdict=v.verdict, reasons=v.reasons(), unknown=len(v.unknown))
        if alert and v.verdict in (H.BAD, H.DEGRADED):
            self._alert(v, facts, when)
        if v.verdict == H.BAD and self.cfg.on_bad == "stop" and self.stop_machine and not self._stop_asked:
            if not at_rest:
                # a run re-adopted after a daemon restart: the alert says it; stopping would cut its work
                log.error("gpu_health_bad_not_stopping", why="a training is running")
                return v
            self._stop_asked = True
            log.error("gpu_health_bad_stopping", reasons=v.reasons())
            self.stop_machine("gpu_bad", "; ".join(v.reasons()))
        return v

    def boot(self, then: Callable[[], None] | None = None) -> None:
        """The daemon-start preflight, in the background (the burn-in takes its seconds); `then` runs
        after it (the daemon's autostart, when a burn-in must not share the GPUs with the run)."""
        threading.Thread(target=self._boot, args=(then,), name="health-preflight", daemon=True).start()

    def _boot(self, then: Callable[[], None] | None) -> None:
        try:
            self.preflight("at daemon start", burn_in=True)
        except Exception:  # noqa: BLE001 - a preflight bug must not stop the daemon
            log.exception("health_preflight_failed")
        if then is not None:
            then()

    def check_start(self) -> None:
        """Before each training start (the Training's hook): a BAD machine with on_bad = "refuse" or
        "stop" starts nothing, and the TrainingError says why."""
        if self._burn.get("state") == "running":
            raise TrainingError(f"the GPU burn-in (health.burn_in = {self.cfg.burn_in:g}s) is still running; "
                                "no training started, start again in a moment")
        v = self.preflight("before the training start")
        if v.verdict == H.BAD and self.cfg.on_bad in ("refuse", "stop"):
            first = v.reasons()[0] if v.reasons() else "BAD"
            self._refused = (f"GPU health is BAD ({'; '.join(v.reasons())}); no training started "
                             f"(health.on_bad = \"{self.cfg.on_bad}\"); see `supervisorctl health`")
            log.error("training_refused_gpu_bad", reason=first)
            raise TrainingError(self._refused)
        self._refused = ""

    def _alert(self, v: H.Verdict, facts: H.HealthFacts, when: str) -> None:
        mail = words.preflight(words.Preflight(v.verdict, H.advice(v), when, self.cfg.on_bad, facts.driver_version,
                                               facts.cuda_version, facts.count, len(v.unknown)))
        sev = "critical" if v.verdict == H.BAD else "warning"
        key = "health:" + v.verdict + ":" + "|".join(sorted(f"{f.gpu}:{f.check}" for f in v.findings))
        self.ctx.alerts.event(key, "gpu_health", sev, mail.subject, mail.body)

    # --- burn-in ----------------------------------------------------------------------------------
    def _burn_in_once(self, at_rest: bool) -> None:
        """Once per boot (a daemon restart reuses this boot's result), and never beside a live run."""
        boot, _ = self.ctx.clock.boot()
        saved = self._first.get("burn_in")
        if boot and self._first.get("burn_in_boot") == boot and isinstance(saved, dict):
            self._burn = {**saved, "tflops": {int(k): v for k, v in (saved.get("tflops") or {}).items()}} \
                if saved.get("tflops") else saved
            return
        if not at_rest:
            self._burn = {"state": "skipped", "note": "a training is running on the GPUs"}
            return
        self._run_burn_in(self.cfg.burn_in)
        self._first = {**self._first, "burn_in_boot": boot, "burn_in": self._burn}
        try:
            self.ctx.store.save("health", self._first)
        except OSError as e:
            log.error("health_state_save_failed", error=str(e))

    def _run_burn_in(self, seconds: float) -> None:
        """The training's Python runs the load test as the training would run: the job's own
        environment (jobenv: never a secret of the daemon's), as training.user, and under systemd in a
        transient service of its own (outside this unit's sandbox and memory cap, as the training).
        Nothing of another user's ever runs as root: no drop to training.user, no burn-in."""
        self._burn = {"state": "running", "seconds": seconds}
        env, _ = start_env(self.job, dict, None)
        # every GPU of the machine, numbered as NVML numbers them (PCI bus order, not CUDA's fastest-first)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        py = _training_python(self.job.workdir, env.get("PATH"))
        if not py:
            self._skip("no python3 in the training's workdir venv or PATH")
            return
        who = _burn_in_identity(self.job.user, env, set(self.job.env))
        if isinstance(who, str):
            self._skip(f"{who}; no burn-in rather than the training's Python as another user")
            return
        if who is None:
            why = _not_roots_alone(py, self.job.workdir or None, env)
            if why:
                self._skip(f"would run {py} as root ({why}); set training.user to run it as the training's user")
                return
        argv = [py, "-c", BOOT, BURN_IN, str(seconds)]
        popen: dict[str, Any] = {"env": env, "cwd": self.job.workdir or None}
        if under_systemd():
            name = who["name"] if who else None
            argv = burn_in_service(argv, user=name, workdir=self.job.workdir or None, max_s=seconds + 120)
            popen = {"env": server_env(os.environ)}
        elif who:
            popen.update(user=who["user"], group=who["group"], extra_groups=who["extra_groups"])
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 150,
                               input=json.dumps(env), **popen)
            out = json.loads((r.stdout.strip().splitlines() or ["{}"])[-1])
            if not isinstance(out, dict):
                raise ValueError(f"not a JSON object: {str(out)[:80]}")
        except (OSError, subprocess.TimeoutExpired, ValueError, RecursionError) as e:
            self._burn = {"state": "failed", "note": f"{type(e).__name__}: {e}"[:300]}
            log.warning("burn_in_failed", error=str(e))
            return
        if "skipped" in out:
            self._burn = {"state": "skipped", "note": f"{out['skipped']} in the training's environment ({py})"[:300]}
        elif isinstance(out.get("tflops"), dict):
            try:
                tflops = {int(k): round(float(v), 1) for k, v in out["tflops"].items()}
                if not all(math.isfinite(v) for v in tflops.values()):
                    raise ValueError("not finite")
            except (TypeError, ValueError, OverflowError):
                tflops = None
            torch = out.get("torch")
            self._burn = {"state": "done", "seconds": seconds, "torch": torch[:40] if isinstance(torch, str) else None,
                          "tflops": tflops} if tflops is not None else \
                {"state": "failed", "note": "the burn-in printed no usable TFLOP/s"}
        else:
            self._burn = {"state": "failed", "note": f"exit {r.returncode}: {r.stderr[-300:]}"}
        log.info("burn_in", **{k: v for k, v in self._burn.items() if k != "tflops"}, tflops=self._burn.get("tflops"))

    def _skip(self, note: str) -> None:
        self._burn = {"state": "skipped", "note": note}
        log.warning("burn_in_skipped", reason=note)

    # --- the duty ---------------------------------------------------------------------------------
    def poll(self) -> None:
        facts = self.probe.health()
        self._remember_first(facts)
        state = self._state()
        alive = state is None or state in TRAINING_ALIVE
        expect, _ = self.expect()
        v = H.judge(facts, expect, at_rest=not alive, burn_in=self._burn.get("tflops"))
        with self._lock:
            self._verdict, self._facts, self._at_rest = v, facts, not alive
            self._checked_at = self.ctx.clock.time()
        run_id, rate = self._rate()
        if state != TrainingState.RUNNING:
            self._end_live()
            return
        if run_id != self._live_run:
            self._end_live()
            self._live_run = run_id
        if rate and run_id is not None and (self._rate_start is None or self._rate_start[0] != run_id):
            self._rate_start = (run_id, rate)
        start = self._rate_start[1] if self._rate_start and self._rate_start[0] == run_id else None
        self._live, found = H.live(self._live, facts, self.ctx.clock.monotonic(), rate_start=start, rate_now=rate)
        self._live_alerts(found)

    def _rate(self) -> tuple[int | None, float | None]:
        if self.rate is None:
            return None, None
        try:
            return self.rate()
        except Exception:  # noqa: BLE001
            log.exception("progress_rate_failed")
            return None, None

    def _live_alerts(self, found: list[H.LiveFinding]) -> None:
        now_keys = {f.key for f in found}
        for f in found:
            mail = words.live([words.LiveFault(f.gpu, f.what, f.advice)])
            if f.key.startswith("ecc_new:"):
                # one mail per new count, not a condition: each new error is news
                self.ctx.alerts.event(f"health:live:{f.key}:{f.what}", "gpu_health", "critical",
                                      mail.subject, mail.body)
            else:
                self.ctx.alerts.fire(f"health:live:{f.key}", "gpu_health", "warning", mail.subject, mail.body)
        for k in set(self._live_active) - now_keys:
            if not k.startswith("ecc_new:"):
                self.ctx.alerts.resolve(f"health:live:{k}")
        self._live_active = {f.key: f for f in found}

    def _end_live(self) -> None:
        for k in self._live_active:
            if not k.startswith("ecc_new:"):
                self.ctx.alerts.resolve(f"health:live:{k}")
        self._live_active = {}
        self._live = H.LiveState()
        self._live_run = None

    # --- status -----------------------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            v, facts, at = self._verdict, self._facts, self._checked_at
            at_rest, when = self._at_rest, self._when
        expect, source = self.expect()
        out: dict[str, Any] = {"verdict": None, "checked_at": at, "at_rest": at_rest, "on_bad": self.cfg.on_bad,
                               "expect_gpus": expect, "expect_source": source or None,
                               "burn_in": dict(self._burn), "refused": self._refused or None,
                               "live": [{"key": f.key, "gpu": f.gpu, "what": f.what, "advice": f.advice}
                                        for f in self._live_active.values()]}
        if v is None or facts is None:
            return out
        out.update(v.to_dict())
        out.update(preflight=when or None, driver_version=facts.driver_version, cuda_version=facts.cuda_version,
                   nvml_error=facts.error, gpus=[asdict(g) for g in facts.gpus])
        return out

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("health", self.every, self.poll),)

    def status_blocks(self) -> tuple[Block, ...]:
        return (HealthBlock.of(self.status()),)

    def verbs(self) -> dict[str, Verb]:
        return {"health": self._on_request}

    def _on_request(self, a: dict) -> dict:
        self.preflight("on request", alert=False)
        return self.status()


def _training_python(workdir: str, path: str | None) -> str | None:
    """The Python the training most likely runs: a venv in its workdir (.venv/, venv/), else python3
    (or python) on the PATH its environment sets."""
    for venv in (".venv", "venv"):
        cand = os.path.join(workdir, venv, "bin", "python") if workdir else ""
        if cand and os.access(cand, os.X_OK):
            return cand
    return shutil.which("python3", path=path) or shutil.which("python", path=path)


def _burn_in_identity(user: str, env: dict[str, str], from_config: set[str]) -> dict[str, Any] | str | None:
    """Who the burn-in runs as: {} for the daemon's own user (a daemon not run as root drops nothing),
    the Popen arguments (and "name") of training.user's drop, None for root (no training.user, or one
    that is uid 0), or a string saying why it cannot run at all. HOME/USER/LOGNAME in `env` follow
    the user, as the job's do (runner.as_user)."""
    if os.geteuid() != 0:
        return {}
    if not user:
        return None
    ids = user_ids(user)
    if ids is None:
        return f"training.user {user!r} does not exist"
    if ids[0] == 0:
        return None
    drop = as_user(user, env, from_config)
    try:
        import pwd
        drop["name"] = pwd.getpwuid(ids[0]).pw_name
    except KeyError:
        drop["name"] = str(ids[0])
    return drop


def _not_roots_alone(py: str, workdir: str | None, env: dict[str, str]) -> str:
    """Why running `py` as root would run something a user other than root controls ("" when
    nothing does): the interpreter itself, its venv (bin, the venv folder, site-packages: what
    `import torch` reads), the workdir (`python -c` puts its cwd first on sys.path), PYTHONPATH's
    folders; each must be root's and writable by root alone, and so must every folder above them
    (a root-owned sticky folder such as /tmp excepted: nobody else can move root's entries in it)."""
    folders = [os.path.dirname(py)]
    venv = os.path.dirname(os.path.dirname(py))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        folders.append(venv)
        for lib in ("lib", "lib64"):
            base = os.path.join(venv, lib)
            try:
                names = sorted(os.listdir(base))
            except OSError:
                continue
            for n in names:
                folders.append(os.path.join(base, n))
                folders.append(os.path.join(base, n, "site-packages"))
    if workdir:
        folders.append(workdir)
    folders += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for path in [py, *folders]:
        why = _others_control(path)
        if why:
            return why
    return ""


def _others_control(path: str) -> str:
    """"" when only root can change `path` (and so what it names), else which part another can."""
    path = os.path.abspath(path)
    real = os.path.realpath(path)
    for p in dict.fromkeys([path, real]):
        parts = [x for x in p.split(os.sep) if x]
        cur = os.sep
        for name in parts[:-1]:
            cur = os.path.join(cur, name)
            try:
                st = os.stat(cur)
            except FileNotFoundError:
                break   # a folder that is not there holds nothing to run (a PYTHONPATH entry, lib64)
            except OSError as e:
                return f"{cur}: {e.strerror}"
            if open_to_others(st) and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
                return f"{cur} is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        else:
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            except OSError as e:
                return f"{p}: {e.strerror}"
            if open_to_others(st):
                return f"{p} is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
    return ""


def burn_in_service(argv: list[str], *, user: str | None, workdir: str | None, max_s: float) -> list[str]:
    """The burn-in as a transient service of its own (systemd-run --wait --pipe): outside the daemon's
    unit, so neither its sandbox (NoNewPrivileges would stop CUDA's setuid nvidia-modprobe) nor its
    memory cap falls on the training's Python; `user` is dropped to by systemd (User=, with the
    user's groups), the output comes back on the pipe, and RuntimeMaxSec ends it if we stop waiting."""
    props = [f"RuntimeMaxSec={int(max_s)}"]
    if workdir:
        props.append(f"WorkingDirectory={workdir}")
    if user:
        props.append(f"User={user}")
    return transient_service(f"train-supervisor-burn-in-{os.getpid()}-{time.time_ns() // 1_000_000}",
                             "train-supervisor GPU burn-in", argv, properties=props, wait=True, pipe=True)
