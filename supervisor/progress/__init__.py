"""The progress wing: how far the run is, how fast it goes, and whether it is stuck.

Owns parsing what trainers print and write (`parse`), one run's progress record and the figures
derived from it (`record`), rates/ETA/cost (`rate`), the step-based stall decision (`stall`), and
their shells: the live tracker on the training log (`tracker`), the stall alert (`stallwatch`) and
the py-spy stacks it gathers (`stacks`).

Pure: `parse`, `record`, `rate`, `stall`. Shell: `tracker`, `stallwatch`, `stacks`.
May import: the core, notify, training. Imported by: idle, the daemon.
"""

PURE = ("parse", "record", "rate", "stall")
