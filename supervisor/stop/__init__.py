"""The stop wing: every reason to stop the machine goes through one sequence and one rule table, and
the stop itself goes through the provider that bills for the machine.

The table (`supervisor.states.STOP_RULES`, one row per `StopReason`) says for each reason whether
it warns first, whether activity cancels it, whether keepalive moves it, which reasons it takes over
from, and whether it may cut the final sync short. `sequence` holds the reasons that still stand and
decides, as pure functions, which one leads the stop and when a new one takes a stop over; the idle
machine keeps them in idle.json. `runner` is the one shell every wing calls to ask for a stop with a
reason and a sentence (GPU health, the money caps, and the reasons to come: a lost node, waste).

`providers/` knows each provider (RunPod, vast.ai, Lambda, AWS, GCP, Azure; OCI, Nebius,
DigitalOcean, Hetzner warned about): where this machine is, what a stop means there and what still
bills. `choose` decides what stop.action means here; `confirm` is the one-call-per-attempt state
machine that reads the provider's state back until it says not billed; `carry` runs it.

Pure: `sequence`, `choose`, `confirm`, `providers.base`. Shell: `runner`, `carry`, `resolve`, `providers`.
May import: the core. Imported by: idle, the daemon, check-config.
"""

PURE = ("rules", "sequence", "choose", "confirm", "providers.base")
