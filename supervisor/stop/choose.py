"""What `stop.action` means on this machine, decided once from what was found. Pure.

"auto" (the default): the provider's own stop where a provider is known and its credential is at
hand; else a poweroff where that ends billing (AWS EBS, GCP); else a poweroff with a warning that
names what keeps billing and the setting that fixes it. On a provider with no stop state (Lambda)
only `mode = "terminate"` ends billing: until the owner sets it, the warning says so.
"provider" always means the provider's API (a `problem`, which check-config refuses, when none is
usable); "ec2" is "provider" on AWS; "poweroff", "command" and "dry-run" are as written.

`terminate_allowed` holds terminate back unless every selected file is verified on the target: a
cap or stop_even_if_sync_fails never destroys unsynced work (the provider's stop runs instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.stop.providers.base import Facts, Found, Info

PROVIDER_ACTIONS = ("auto", "provider", "ec2")


@dataclass(frozen=True)
class Plan:
    configured: str                  # stop.action as written
    action: str                      # what runs: provider | poweroff | command | dry-run
    mode: str = "stop"               # stop.mode
    found: Found | None = None
    info: Info | None = None
    provider: Any = None             # the Provider (it holds the credential: never shown, never saved)
    facts: Facts | None = None       # what its API told (describe), None when not asked or it failed
    credential_why: str = ""         # why there is no Provider ("" when there is one, or none was wanted)
    warning: str = ""                # what keeps billing and the setting that fixes it
    problem: str = ""                # action = "provider" that cannot work: check-config refuses it

    @property
    def price_per_hour(self) -> float | None:
        return self.facts.price_per_hour if self.facts else None

    @property
    def instance_words(self) -> str:
        if self.facts and self.facts.instance_words:
            return self.facts.instance_words
        inst = getattr(self.provider, "instance", "") or (self.found.instance if self.found else "")
        return f"{self.info.noun} {inst}" if self.info and inst else ""

    def ends_billing(self) -> bool | None:
        if self.action == "provider":
            return True
        if self.action == "poweroff":
            return self.info.poweroff_ends_billing if self.info else None
        return False if self.action == "dry-run" else None

    def still_billed(self) -> str:
        i, f = self.info, self.facts
        if i is None or self.action not in ("provider", "poweroff"):
            return ""
        if self.action == "provider" and self.mode == "terminate":  # the API's own facts, when it was asked
            return f.still_billed_terminate if f else f"{i.terminate_keeps} still billed" if i.terminate_keeps else ""
        if self.action == "provider" or i.poweroff_ends_billing:
            return f.still_billed if f and f.still_billed else f"{i.stop_keeps} still billed"
        return f"the whole {i.noun} bills on"

    def via(self) -> str:
        if self.action == "provider":
            return f"{self.info.label} API" if self.info else "the provider's API"
        return {"command": "stop.command", "dry-run": "dry-run"}.get(self.action, "poweroff")

    def ends_words(self) -> str:
        if self.action == "provider" and self.info:
            return ("terminated once the final sync is verified (ends every charge)" if self.mode == "terminate"
                    else self.info.stop_ends or "ends billing")
        ends = self.ends_billing()
        if self.action == "dry-run":
            return "nothing is stopped"
        if self.action == "command":
            return "as the command does"
        return "ends compute billing" if ends else "does NOT end billing here" if ends is False else \
            "whether that ends billing here is not known"

    def line(self) -> str:
        """"RunPod API, pod abc (ends GPU billing; 50 GB volume still billed, about 0.33 USD/day)"."""
        where = f", {self.instance_words}" if self.instance_words else \
            f", {self.info.label}" if self.info and self.action != "provider" else ""
        still = self.still_billed()
        return f"{self.via()}{where} ({self.ends_words()}{'; ' + still if still else ''})"

    def block(self) -> dict:
        """status --json stop.provider."""
        inst = getattr(self.provider, "instance", "") or (self.found.instance if self.found else "")
        return {"name": self.found.name if self.found else None,
                "label": self.info.label if self.info else "",
                "detected_by": self.found.detected_by if self.found else "",
                "instance": inst or None, "mode": self.mode, "action": self.action, "via": self.via(),
                "ends_billing": self.ends_billing(), "still_billed": self.still_billed(),
                "price_per_hour": self.price_per_hour, "line": self.line(), "warning": self.warning,
                "problem": self.problem, "credential": "" if self.provider is not None or not self.credential_why
                else f"missing: {self.credential_why}"}


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeio" else "a"


def decide(configured: str, mode: str, found: Found | None, info: Info | None, has_provider: bool,
           credential_why: str = "") -> tuple[str, str, str]:
    """(the action that runs, the warning, the problem) for `stop.action = configured`."""
    if configured in ("command", "dry-run"):
        return configured, "", ""
    if configured == "poweroff":
        if info is not None and info.poweroff_ends_billing is False:
            return "poweroff", (f"stop.action = \"poweroff\": on {info.label} a poweroff {info.poweroff_means}; "
                                f"{info.stop_keeps} keeps billing. Set stop.action = \"auto\" with {info.fix}"
                                if info.api else f"stop.action = \"poweroff\": on {info.label} a poweroff "
                                f"{info.poweroff_means}. Set {info.fix}"), ""
        return "poweroff", "", ""
    if configured in ("provider", "ec2"):
        if info is None:
            return "provider", "", "stop.action = \"provider\": no provider known here (env and DMI name none); " \
                                   "set stop.provider"
        if not info.api:
            return "provider", "", f"stop.action = \"provider\": {info.label} is not called by this version; set {info.fix}"
        if not info.can_stop and mode != "terminate":
            return "provider", "", f"stop.action = \"provider\": {info.label} has no stop state; set {info.fix}"
        if not has_provider:
            return "provider", "", f"stop.action = \"provider\": {info.label}: {credential_why or 'no credential'}"
        return "provider", "", ""
    # auto
    if info is None:
        return "poweroff", "", ""
    where = f"this is {_article(info.label)} {info.label} {info.noun} ({found.detected_by if found else 'named'})"
    if info.api and has_provider and (info.can_stop or mode == "terminate"):
        return "provider", "", ""
    if info.api and has_provider:  # no stop state, mode "stop"
        return "poweroff", (f"stop.action = \"auto\": {where}; {info.label} has no stop state, billing runs until the "
                            f"{info.noun} is terminated, and a poweroff leaves it billing. Set {info.fix}"), ""
    if info.poweroff_ends_billing:
        if mode == "terminate":
            return "poweroff", (f"stop.mode = \"terminate\": {where}, but its API cannot be used "
                                f"({credential_why or 'no credential'}): the machine is only powered off and "
                                f"{info.stop_keeps} bill on. Set {info.fix}"), ""
        return "poweroff", "", ""
    why = f", but its API cannot be used ({credential_why})" if info.api and credential_why else ""
    fix = "" if not info.can_stop and mode == "terminate" else f" Set {info.fix}"
    return "poweroff", (f"stop.action = \"auto\": {where}{why}: the stop falls back to a poweroff, which there "
                        f"{info.poweroff_means}.{fix}"), ""


def terminate_allowed(synced: dict | None, forced: str) -> str:
    """"" when terminate may run (the last final sync verified every selected file and nothing forced
    the stop past it), else why not, in words."""
    if forced:
        return f"the stop goes ahead without a verified final sync ({forced})"
    if not synced:
        return "no final sync has verified the work on the target"
    if not synced.get("ok"):
        return f"the final sync did not verify ({synced.get('error') or 'not verified'})"
    if synced.get("unsynced"):
        return f"{len(synced['unsynced'])} files are not verified on the target"
    return ""
