#!/usr/bin/env bash
# The README's demo: the tiny CPU trainer under train-supervisord in tmux, with a local sync target,
# a dry-run stop action and alerts to the local alert log. Nothing here touches the real machine.
# The first run installs what the demo needs and nothing more: tmux and python3-venv (apt, when
# missing) and train-supervisor with its runtime dependencies in .venv (not the test extra).
# PY=/path/to/python skips that setup and uses an interpreter that already has the package.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO="${DEMO_DIR:-/tmp/train-supervisor-demo}"
STEPS="${DEMO_STEPS:-160}"
STEP_TIME="${DEMO_STEP_TIME:-0.25}"
t0=$(date +%s)

if [ -z "${PY:-}" ]; then
  echo "== setup: tmux, python3-venv and .venv with train-supervisor (nothing when already there)"
  bash .ci/system-deps demo
  bash .ci/venv demo
  PY=.venv/bin/python
  echo "== setup done in $(( $(date +%s) - t0 )) s"
fi
command -v tmux >/dev/null || { echo "demo needs tmux (apt-get install tmux)" >&2; exit 1; }
ABS_PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
ctl() { "$ABS_PY" -m supervisor.cli --config "$DEMO/config.toml" "$@"; }
training_state() {
  ctl status --json 2>/dev/null | "$ABS_PY" -c 'import json,sys; print(json.load(sys.stdin)["training"]["state"])' 2>/dev/null || true
}

# A previous run that was interrupted: end its training, daemon and tmux server (by pid, never by name).
if [ -f "$DEMO/config.toml" ]; then
  ctl stop >/dev/null 2>&1 || true
fi
if [ -f "$DEMO/daemon.pid" ]; then
  kill "$(cat "$DEMO/daemon.pid")" 2>/dev/null || true
fi
tmux -S "$DEMO/state/tmux.sock" kill-server 2>/dev/null || true
rm -rf "$DEMO"
mkdir -p "$DEMO/out" "$DEMO/remote"
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

echo "== check-config"; ctl check-config "$DEMO/config.toml"
echo "== starting train-supervisord (log: $DEMO/daemon.log)"
TRAIN_SUPERVISOR_NO_SCOPE=1 nohup "$ABS_PY" -m supervisor.daemon --config "$DEMO/config.toml" >"$DEMO/daemon.log" 2>&1 &
DAEMON=$!
echo "$DAEMON" >"$DEMO/daemon.pid"
finished=0
cleanup() {
  # Interrupted (Ctrl-C): the training is asked to stop too; the runner in tmux outlives a daemon.
  if [ "$finished" = 0 ]; then
    if ctl stop >/dev/null 2>&1; then
      for _ in $(seq 50); do
        case "$(training_state)" in STARTING|RUNNING|STOPPING) sleep 0.2 ;; *) break ;; esac
      done
    fi
  fi
  kill "$DAEMON" 2>/dev/null || true
  rm -f "$DEMO/daemon.pid"
}
trap cleanup EXIT
for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; [ $? -eq 4 ] || break; sleep 0.2; done
echo "== supervisorctl start"; ctl start
deadline=$(( $(date +%s) + 300 ))
while :; do
  echo; echo "== supervisorctl status  ($(date +%H:%M:%S))"
  ctl status || true
  if ctl status --json | "$ABS_PY" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["stop"].get("phase")=="done" else 1)'; then
    break
  fi
  [ "$(date +%s)" -lt "$deadline" ] || { echo "demo timed out"; exit 1; }
  sleep 3
done
echo; echo "== supervisorctl alerts"; ctl alerts
echo; echo "== what reached the sync target ($DEMO/remote)"
# in step order (a plain glob would list checkpoint-120 before checkpoint-40)
find "$DEMO/remote" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort -V | while read -r d; do
  printf '  %-22s %3s files  %s\n' "$d/" "$(find "$DEMO/remote/$d" -type f | wc -l)" \
    "$([ -f "$DEMO/remote/$d/_MANIFEST.json" ] && echo "manifest written last: complete" || echo "no manifest: incomplete")"
done
echo; echo "== the dry-run stop that would have powered the machine off"
grep -h '"machine_stopped"' "$DEMO/daemon.log" | tail -n 1 || true
finished=1
echo; echo "demo done in $(( $(date +%s) - t0 )) s: the trainer ran in tmux, every checkpoint reached the target with its manifest,"
echo "and the daemon made the final verified sync and recorded the (dry-run) stop."
