#!/usr/bin/env bash
# The README's demo: the tiny CPU trainer under train-supervisord in tmux, with a local sync target,
# a dry-run stop action and alerts to the local alert log. Nothing here touches the real machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
DEMO="${DEMO_DIR:-/tmp/train-supervisor-demo}"
STEPS="${DEMO_STEPS:-160}"
STEP_TIME="${DEMO_STEP_TIME:-0.25}"

command -v tmux >/dev/null || { echo "demo needs tmux (apt-get install tmux)"; exit 1; }
if [ -S "$DEMO/control.sock" ]; then
  "$PY" -m supervisor.cli --socket "$DEMO/control.sock" stop >/dev/null 2>&1 || true
fi
pkill -f "supervisor.daemon --config $DEMO/config.toml" 2>/dev/null || true
tmux -S "$DEMO/state/tmux.sock" kill-server 2>/dev/null || true
rm -rf "$DEMO"
mkdir -p "$DEMO/out" "$DEMO/remote"
ABS_PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
cat > "$DEMO/config.toml" <<TOML
# demo config: written by examples/demo.sh
state_dir = "$DEMO/state"
socket = "$DEMO/control.sock"
price_per_hour = 3.90
currency = "EUR"

[training]
command = "$ABS_PY $PWD/examples/tiny_trainer.py --output $DEMO/out --steps $STEPS --step-time $STEP_TIME --save-steps 40 --save-total-limit 2"
workdir = "$DEMO"
log = "$DEMO/train.log"
on_finish = "stop"
finish_grace = "15s"

[sync]
target = "$DEMO/remote"
watch = ["$DEMO/out"]
quiet_period = "2s"
rescan_interval = "5s"

[idle]
warn_after = "1h"
stop_after_warning = "30m"

[stop]
action = "dry-run"
final_sync = ["$DEMO/out"]
TOML

ctl() { "$PY" -m supervisor.cli --config "$DEMO/config.toml" "$@"; }
echo "== check-config"; ctl check-config "$DEMO/config.toml"
echo "== starting train-supervisord (log: $DEMO/daemon.log)"
TRAIN_SUPERVISOR_NO_SCOPE=1 nohup "$PY" -m supervisor.daemon --config "$DEMO/config.toml" >"$DEMO/daemon.log" 2>&1 &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; [ $? -eq 4 ] || break; sleep 0.2; done
echo "== supervisorctl start"; ctl start
deadline=$(( $(date +%s) + 300 ))
while :; do
  echo; echo "== supervisorctl status  ($(date +%H:%M:%S))"
  ctl status || true
  if ctl status --json | "$PY" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["stop"].get("phase")=="done" else 1)'; then
    break
  fi
  [ "$(date +%s)" -lt "$deadline" ] || { echo "demo timed out"; exit 1; }
  sleep 3
done
echo; echo "== supervisorctl alerts"; ctl alerts
echo; echo "== what reached the sync target ($DEMO/remote)"
for d in "$DEMO"/remote/*/; do
  printf '  %-22s %3s files  %s\n' "$(basename "$d")/" "$(find "$d" -type f | wc -l)" \
    "$([ -f "$d/_MANIFEST.json" ] && echo "manifest written last: complete" || echo "no manifest: incomplete")"
done
echo; echo "== the dry-run stop that would have powered the machine off"
grep -h '"machine_stopped"' "$DEMO/daemon.log" | tail -n 1 || true
echo; echo "demo done: the trainer ran in tmux, every checkpoint reached the target with its manifest,"
echo "and the daemon made the final verified sync and recorded the (dry-run) stop."
