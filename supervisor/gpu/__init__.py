"""The GPU wing: what the GPUs and the host's memory and disk are doing to the training.

Owns the NVML probe (`nvml`, the only module that imports pynvml), the rolling GPU window and its
alerts (`monitor`), out-of-memory detection in the log and the kernel (`oom`: `classify` is pure,
the watcher around it a shell) and host memory and disk space (`hostcheck`).

Pure: none whole (`oom.classify` is). Shell: `nvml`, `monitor`, `oom`, `hostcheck`.
May import: the core, notify, training. Imported by: the daemon.
"""

PURE = ()
