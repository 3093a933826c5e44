"""Words about the machine's GPU health: the preflight verdict (BAD or DEGRADED, with what to do)
and the faults seen during a run. The facts come from supervisor.gpu.health as plain strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.notify.mails import Mail

ON_BAD = {
    "alert": "Nothing else is done (health.on_bad = \"alert\"): a training may still start on it.",
    "refuse": "No training starts on this machine while it stays BAD (health.on_bad = \"refuse\"); "
              "`supervisorctl start` and `run` say why.",
    "stop": "The machine is being stopped now (health.on_bad = \"stop\"): a bad box bills for nothing.",
}


@dataclass(frozen=True)
class Preflight:
    verdict: str                 # BAD | DEGRADED
    advice: str                  # one line per GPU: facts — what to do
    when: str                    # "at daemon start" | "before the training start"
    on_bad: str
    driver: str | None = None
    cuda: str | None = None
    gpus: int | None = None
    unknown: int = 0


def preflight(p: Preflight) -> Mail:
    first = p.advice.splitlines()[0] if p.advice else p.verdict
    body = [f"GPU health check {p.when}: {p.verdict}.", "", p.advice or "(no details)", ""]
    if p.verdict == "BAD":
        body.append("BAD means this machine will fail or corrupt a run: a crash, a NaN or hours at half "
                    "speed, all billed.")
        body.append(ON_BAD.get(p.on_bad, ""))
    else:
        body.append("DEGRADED means it works, but slower or with a risk named above.")
    facts = [f"{p.gpus} GPU(s)" if p.gpus is not None else "", f"driver {p.driver}" if p.driver else "",
             f"CUDA {p.cuda}" if p.cuda else ""]
    body += ["", "Machine: " + ", ".join(x for x in facts if x)]
    if p.unknown:
        body.append(f"{p.unknown} field(s) this GPU or driver does not report were left out (unknown, not a fault).")
    body.append("Details: supervisorctl health (docs/health.md).")
    return Mail(f"GPU health {p.verdict}: {first}"[:150], "\n".join(body))


@dataclass(frozen=True)
class LiveFault:
    gpu: int | None
    what: str
    advice: str


def live(faults: Sequence[LiveFault]) -> Mail:
    lines = [f"{'GPU ' + str(f.gpu) + ': ' if f.gpu is not None else ''}{f.what} — {f.advice}" for f in faults]
    return Mail(f"GPU fault during the run: {lines[0]}"[:150] if lines else "GPU fault during the run",
                "\n".join(lines) + "\n\nSynced checkpoints are safe (supervisorctl status shows the newest). "
                "Details: supervisorctl health.")
