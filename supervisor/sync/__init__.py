"""The sync wing: every selected checkpoint and adapter off the machine, verified by content.

Owns the engine (`engine`: watch, scan, upload, final sync), what is selected and when a folder is
complete (`policy`, `complete`, `scan`; `walk` reads the folders), the persisted record of what the target holds
(`ledger`, `manifest`), retries and the target's health (`backoff`, `targethealth`), and one target per kind of
`sync.target` behind one interface (`targets/`: S3, the Hugging Face Hub, rsync over SSH, local).
A single checkpoint file rewritten as it goes up is sent from a snapshot (`snapshot`, its folders
`snapdir`), and the saves the target lacks are counted (`saves`) and told (`targethealth`).
`python -m supervisor.sync` is the one-shot CLI; `stamp` answers its no-change pass without the engine.

Pure: `complete`, `formats` (each trainer's rule), `backoff`, `retention`, `names`, `parts`, `manifest_doc`,
`policy`, `unselected` (what looks
like training output and no include selects; `unreached` lists the folders the walk skips). Shell: everything
else (`final` too: it reads the ledger and the target's answers while it decides).
May import: the core, notify, training. Imported by: the daemon, resume, cluster.
"""

PURE = ("complete", "formats", "backoff", "retention", "names", "parts", "manifest_doc", "policy", "unselected")
