"""The fleet wing: fitting into the tools people already run for many machines.

Owns the Prometheus exposition and its listener/textfile (`metrics`), the bounded HTTP listener under
it (`listener`) and the idle verdict and
one-line-per-host views (`hosts`: `idle-check`, `status --host`). Both read the `status --json`
dict and nothing else.

Pure: none whole (`metrics.exposition` and the `hosts` verdicts are). Shell: `metrics`, `listener`, `hosts`.
May import: the core only. Imported by: the daemon and the CLI.
"""

PURE = ()
