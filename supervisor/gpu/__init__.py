"""The GPU wing: what the GPUs and the host's memory are doing to the training.

Owns the NVML probe (`nvml`, the only module that imports pynvml), the rolling GPU window and its
alerts (`monitor`), out-of-memory detection in the log and the kernel (`oom`: `classify` is pure,
the watcher around it a shell), host memory (`hostcheck`; disk space is the disk wing's), and GPU health: the
verdict OK / DEGRADED / BAD and the faults during a run (`health`, pure) with its preflight, alerts
and burn-in (`healthwatch`), and GPU memory held for nothing (`waste`, pure; `wastewatch`: the alert
and, when asked, the `waste` stop).

Pure: `health`, `waste` (and `oom.classify`). Shell: `nvml`, `monitor`, `oom`, `hostcheck`,
`healthwatch`, `wastewatch`.
May import: the core, notify, training. Imported by: the daemon.
"""

PURE = ("health", "waste")
