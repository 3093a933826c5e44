"""The resume wing: a run continues on the next machine from its newest verified checkpoint.

Owns choosing the unit to restore from the target's manifests (`choose`: newest complete by step,
partial, damaged and manifest-less units skipped and named), the restore itself (`restore`:
download into the original place under the watched folder, every file checked against its
manifest's sha256, fallback to the unit before on a damaged object, the files recorded in the
sync ledger as on the target), and the daemon's gate before a training start (`gate`: restore when
the watched folders hold no complete checkpoint, retry with backoff while the target is
unreachable, `TRAIN_SUPERVISOR_RESUME_FROM` for the training).

Pure: `choose`. Shell: `restore`, `gate`, `local`.
May import: the core, notify, training, sync. Imported by: the daemon, the CLI.
"""

PURE = ("choose",)
