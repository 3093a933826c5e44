"""The sync wing: every selected checkpoint and adapter off the machine, verified by content.

Owns the engine (`engine`: one worker that watches, scans, uploads and runs the final sync; `answers`
answers the callers who wait on it), what is selected (`policy`), the scan's decisions (`scan`; `walk`
reads the folders; `unreached` lists the folders the walk skips), the persisted record of what the target
holds (`ledger`, `manifest`), retries and the target's health (`backoff`, `targethealth`), and a checkpoint
deleted or stuck before it left (`lost`). A single checkpoint file rewritten as it goes up is sent from a
snapshot (`snapshot`, its folders `snapdir`), and the saves the target lacks are counted (`saves`) and told
(`targethealth`). What a trainer's save is and when it is whole is the saves wing's (formats, complete,
manifest_doc, parts); the bytes on the target are the store's. `python -m supervisor.sync` is the
one-shot CLI (its body in cli/sync_once.py).

Pure: `backoff`, `retention`, `policy`. Shell: everything else (`final` too: it reads the ledger and the
target's answers while it decides).
May import: the core, notify, training, store, saves. Imported by: the daemon, resume, cluster, disk.
"""

PURE = ("backoff", "retention", "policy")
