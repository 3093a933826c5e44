"""What every provider module offers, and the words they share. Pure: data and arithmetic, no I/O.

A provider module (runpod.py, vast.py, ...) holds its `INFO` (what a stop and a poweroff mean there,
what still bills, its credential: the facts docs/providers.md tabulates) and a `connect()` that
returns a `Provider`: the one object that may call the provider's API, with the credential inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StopActionError(Exception):
    """The action ran and did not stop the machine; the message says why (idle.stop re-exports it)."""


class ProviderError(StopActionError):
    """A call to the provider did not do what was asked. `kind`:
    - "refused": the provider answered 4xx (a key without the right, an unknown instance); `answer` is
      its body, scrubbed of secrets;
    - "failed": nothing was done (the connection was refused, the name did not resolve, a 5xx);
    - "unknown": the request went out and no answer came (a timeout): it may have been carried out."""

    def __init__(self, what: str, kind: str = "failed", code: int | None = None, answer: str = ""):
        super().__init__(what)
        self.kind, self.code, self.answer = kind, code, answer


class NoCredential(Exception):
    """The provider is known, but what its API needs (a key, an instance id, an identity) is not here."""


@dataclass(frozen=True)
class Info:
    """The fixed facts of one provider, from its own documentation (FIELD-NOTES, fifth round)."""

    name: str                 # the config word: runpod | vast | lambda | aws | gcp | azure | oci | ...
    label: str                # "RunPod"
    noun: str                 # what it calls a machine: "pod", "instance", "VM"
    found_by: str             # how detect.py finds it
    poweroff_ends_billing: bool | None  # a guest poweroff ends compute billing there
    poweroff_means: str       # what a guest poweroff does there, in words
    can_stop: bool            # the API has a stop that ends compute billing (Lambda: only terminate)
    api: bool                 # this version calls its API (False: detected and warned about only)
    stop_ends: str            # what its stop ends: "ends GPU billing"
    stop_keeps: str           # what still bills after its stop
    terminate_keeps: str      # what still bills after terminate ("" = nothing)
    credential: str           # where the credential comes from
    fix: str                  # the setting that makes the stop end billing, when the default cannot


@dataclass(frozen=True)
class Found:
    """A provider this machine belongs to, and how that was found."""

    name: str
    detected_by: str          # "env RUNPOD_POD_ID", "DMI chassis_asset_tag", "stop.provider"
    instance: str = ""        # its id there, when the finding tells it


@dataclass(frozen=True)
class State:
    """The provider's own word for the machine, and what it means for the bill."""

    word: str                 # "EXITED", "stopped", "PowerState/deallocated", "gone (404)"
    stopped: bool             # compute no longer bills
    gone: bool = False        # the machine no longer exists (terminated, deleted)


@dataclass(frozen=True)
class Facts:
    """What the provider's API says about this machine (describe): all optional."""

    price_per_hour: float | None = None   # USD, the machine's own hourly price
    still_billed: str = ""                # after a stop, with the money where the API tells it
    still_billed_terminate: str = ""      # after terminate
    instance_words: str = ""              # "pod abc (1 x RTX 4090)"


class Provider(Protocol):
    """One provider's API for this machine. Each call is exactly one request to the provider."""

    info: Info
    instance: str

    def describe(self) -> Facts: ...

    def stop(self) -> str: ...

    def terminate(self) -> str: ...

    def state(self) -> State: ...


STOPPED_VOLUME_USD_GB_MONTH = 0.20   # RunPod: a stopped pod's volume (twice the running rate)
DAYS_PER_MONTH = 30.0


def per_day(usd_per_hour: float) -> str:
    return f"about {usd_per_hour * 24:.2f} USD/day"


def gb_month_per_day(gb: float, usd_per_gb_month: float) -> str:
    return f"about {gb * usd_per_gb_month / DAYS_PER_MONTH:.2f} USD/day"


def number(v: object) -> float | None:
    """A finite non-negative number from a provider's JSON (RunPod sends costPerHr as "0.74")."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, int | float) and v == v and 0 <= v < 1e9:
        return float(v)
    return None
