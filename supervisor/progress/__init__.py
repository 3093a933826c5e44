"""The progress wing: how far the run is, how fast it goes, and whether it is stuck.

Owns parsing what trainers print and write (`parse` for the HF Trainer and TSUP lines, `steplines`
for Lightning's bars and printed step counters, both handing out an `observation`), one run's progress record and the figures
derived from it (`record`), rates/ETA/cost (`rate`), the step-based stall decision (`stall`), what
the experiment trackers write (`trackfiles`: TensorBoard event files, the MLflow file store), and
their shells: the live tracker on the training log (`tracker`), the trackers' files found and read
incrementally (`trackers`), the stall alert (`stallwatch`) and the py-spy stacks it gathers (`stacks`).

Pure: `observation`, `parse`, `steplines`, `record`, `rate`, `stall`, `trackfiles`. Shell: `tracker`, `trackers`, `stallwatch`, `stacks`.
May import: the core, notify, training. Imported by: idle, the daemon.
"""

PURE = ("observation", "parse", "steplines", "record", "rate", "stall", "trackfiles")
