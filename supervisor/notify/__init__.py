"""The notify wing: every way the daemon tells the owner something.

Owns the alert outbox (`alerts`: dedup, repeat, resolved, the hourly cap, retries per channel),
the message shape and channel interface (`channels`), the channels themselves (`mail` over SMTP,
`apprise`, the signed `webhook`) and every text a person reads (`mails/`, pure functions of facts).
Which channels a config asks for is built by supervisor.daemon.channels, beside the daemon.

Pure: `mails` (the package). Shell: `alerts`, `channels`, `mail`, `apprise`, `webhook`.
May import: the core only. Imported by: every other wing and the daemon.
"""

PURE = ("mails",)
