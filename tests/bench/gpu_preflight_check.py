"""Print the GPU health preflight of this machine, as the daemon would judge it, without a daemon.

For a session (or a person) on a machine with real NVIDIA GPUs: it runs the same code as the daemon
(supervisor.gpu.healthwatch.HealthWatch over the one NVML wrapper, supervisor.gpu.nvml), prints the
`supervisorctl health` screen, then the `health` block of `status --json`, then how long the NVML
reading took. Nothing is written outside a temporary state_dir, no alert is sent, nothing is stopped.

    python tests/bench/gpu_preflight_check.py                     # the preflight
    python tests/bench/gpu_preflight_check.py --expect-gpus 8     # judge the count against 8
    python tests/bench/gpu_preflight_check.py --burn-in 10s       # + 10 s bf16 matmul per GPU (needs torch)
    python tests/bench/gpu_preflight_check.py --nvml-library /path/libnvidia-ml.so.1   # another library

Needs the project's dependencies (nvidia-ml-py, structlog...): run it with the project's venv, e.g.
`.venv/bin/python tests/bench/gpu_preflight_check.py`. The burn-in runs `python3` from PATH (the
"training's environment" here is this shell's): put a Python with torch first on PATH for it.
Exit status: 0 OK, 1 BAD, 3 DEGRADED or UNKNOWN (as `supervisorctl health`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from supervisor.cli.render import render_health  # noqa: E402
from supervisor.clock import SystemClock  # noqa: E402
from supervisor.config import from_dict  # noqa: E402
from supervisor.context import Context  # noqa: E402
from supervisor.gpu.healthwatch import HealthWatch  # noqa: E402
from supervisor.gpu.nvml import NvmlProbe  # noqa: E402
from supervisor.notify.alerts import Alerts  # noqa: E402
from supervisor.statefile import StateStore  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--expect-gpus", type=int, default=0, help="GPUs this machine must have (default: no expectation)")
    ap.add_argument("--burn-in", default="0s", help='e.g. "10s": a matmul on every GPU (torch from PATH)')
    ap.add_argument("--nvml-library", default="", help="load this libnvidia-ml instead of the system's")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-preflight-") as d:
        cfg = from_dict({"state_dir": d, "gpu": {"nvml_library": args.nvml_library},
                         "health": {"expect_gpus": args.expect_gpus, "burn_in": args.burn_in}})
        clock = SystemClock()
        ctx = Context(clock, StateStore(d), Alerts(cfg.alerts, clock, None, background=False))
        probe = NvmlProbe(args.nvml_library)
        w = HealthWatch(ctx, cfg.health, cfg.training, probe, None)
        t0 = time.perf_counter()
        probe.health()  # the first reading initialises NVML: timed apart
        t_init = time.perf_counter() - t0
        t0 = time.perf_counter()
        w.preflight("by hand (gpu_preflight_check.py)", burn_in=bool(cfg.health.burn_in), alert=False)
        t_check = time.perf_counter() - t0
        st = w.status()
        probe.close()
    if not args.json_only:
        print(render_health(st))
        print()
    print(json.dumps(st, indent=2, sort_keys=True, default=str))
    if not args.json_only:
        print(f"\nNVML init + first reading {t_init * 1000:.1f} ms; preflight "
              f"{t_check * 1000:.1f} ms{' (with the burn-in)' if cfg.health.burn_in else ''}")
    return {"OK": 0, "BAD": 1}.get(st.get("verdict") or "", 3)


if __name__ == "__main__":
    sys.exit(main())
