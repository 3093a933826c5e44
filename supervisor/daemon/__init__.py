"""train-supervisord: the list of wings (wings.py), the house that builds them in the order their
needs give and runs their duties and threads (main.py), the control socket, the alert channels and
systemd's notify protocol.

The top of the house, with the cli package: it may import every wing; no wing imports it."""
