#!/usr/bin/env bash
# Install train-supervisor from the checkout this script lives in:
#   - the tools the daemon runs: tmux (the training runs in it), rsync and ssh (user@host:path
#     targets), CA certificates, python3-venv; installed with apt when missing,
#   - its own venv in /opt/train-supervisor (never pip into the system Python),
#   - the systemd unit in /etc/systemd/system, enabled for boot,
#   - a commented default config in /etc/train-supervisor/config.toml (only if there is none),
#   - /usr/local/bin/supervisorctl pointing into the venv, and train-supervisor-start, which runs
#     the daemon where systemd is not PID 1 (RunPod, vast.ai, most containers).
# Meant for image builds (no systemd running: the unit is enabled offline) as well as live
# machines and containers. Idempotent: run it again to upgrade; a running daemon is restarted,
# the training keeps running (see KillMode in the unit).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: systemd/install.sh [options]
  --prefix DIR     install below DIR instead of / (staging, tests); paths stay literal, so the
                   unit's ExecStart becomes DIR/opt/train-supervisor/bin/train-supervisord
  --python PY      interpreter for the venv (default: python3; needs 3.11+)
  --group NAME     create system group NAME (if missing) and, in a newly written config,
                   let its members use supervisorctl (socket_group)
  --pip-arg ARG    pass ARG to pip install (repeatable), e.g. --pip-arg=--no-index
  --no-enable      do not enable the unit
  --no-apt         never install system packages; only check that they are there
  --now            also start the daemon now (live machines; without systemd through
                   train-supervisor-start)
  -h, --help       this text
EOF
}

log() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

PREFIX=""
PYTHON="python3"
GROUP=""
ENABLE=1
START=0
APT=1
PIP_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
    --prefix=*) PREFIX="${1#*=}"; shift ;;
    --python) PYTHON="${2:?--python needs an interpreter}"; shift 2 ;;
    --python=*) PYTHON="${1#*=}"; shift ;;
    --group) GROUP="${2:?--group needs a name}"; shift 2 ;;
    --group=*) GROUP="${1#*=}"; shift ;;
    --pip-arg) PIP_ARGS+=("${2:?--pip-arg needs an argument}"); shift 2 ;;
    --pip-arg=*) PIP_ARGS+=("${1#*=}"); shift ;;
    --no-enable) ENABLE=0; shift ;;
    --no-apt) APT=0; shift ;;
    --now) START=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

if [ -n "$PREFIX" ]; then
  mkdir -p "$PREFIX"
  PREFIX="$(cd "$PREFIX" && pwd)"
  [ "$PREFIX" != "/" ] || PREFIX=""
fi
if [ -n "$GROUP" ] && ! [[ "$GROUP" =~ ^[a-z_][a-z0-9_-]*$ ]]; then
  die "--group: not a valid group name: $GROUP"
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$REPO/pyproject.toml" ] && [ -d "$REPO/supervisor" ] || die "run me from a train-supervisor checkout ($REPO)"

VENV="$PREFIX/opt/train-supervisor"
ETC="$PREFIX/etc/train-supervisor"
CONFIG="$ETC/config.toml"
UNIT_DIR="$PREFIX/etc/systemd/system"
UNIT="train-supervisor.service"
BIN_DIR="$PREFIX/usr/local/bin"
SYSTEMD_RUNNING=0
if [ -z "$PREFIX" ] && [ -d /run/systemd/system ]; then SYSTEMD_RUNNING=1; fi

# --- Python and the venv ---------------------------------------------------------------------
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (install Python 3.11+ or pass --python)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "needs Python 3.11 or newer; $PYTHON is $("$PYTHON" -V 2>&1)"

# --- the tools the daemon runs ------------------------------------------------------------------
# tmux is required: the training runs in it, and without it the first `supervisorctl run` fails.
# rsync and ssh carry checkpoints to user@host:path targets; the CA bundle lets S3 and SMTP check
# TLS certificates. Installed with apt where this runs as root on the machine itself (a container
# image has empty package lists: they are fetched first); otherwise only checked.
have() { command -v "$1" >/dev/null 2>&1; }
need=()
have tmux || need+=(tmux)
have rsync || need+=(rsync)
have ssh || need+=(openssh-client)
if have apt-get && [ ! -s /etc/ssl/certs/ca-certificates.crt ]; then need+=(ca-certificates); fi
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)

apt_install() {
  local out
  out="$(mktemp)"
  export DEBIAN_FRONTEND=noninteractive
  if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
    log "fetching the package lists first (apt-get update: they are empty here)"
    apt-get update -qq >"$out" 2>&1 || { tail -n 5 "$out" >&2; rm -f "$out"; return 1; }
  fi
  if ! apt-get install -y -qq --no-install-recommends "$@" >"$out" 2>&1; then
    # stale lists (404 for a superseded version): fetch them again and retry once
    log "apt-get install failed; fetching the package lists and retrying"
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"; } >"$out" 2>&1; then
      tail -n 8 "$out" >&2
      rm -f "$out"
      return 1
    fi
  fi
  rm -f "$out"
}

if [ ${#need[@]} -gt 0 ]; then
  if [ -z "$PREFIX" ] && [ "$APT" = 1 ] && [ "$(id -u)" = 0 ] && have apt-get; then
    log "installing ${need[*]} (apt)"
    apt_install "${need[@]}" || die "could not install ${need[*]} with apt-get (its last lines are above);" \
      "install them by hand (tmux runs the training, rsync and ssh carry checkpoints to user@host targets)" \
      "and run install.sh again"
  else
    why="not root"; [ "$(id -u)" = 0 ] && why="no apt-get"; [ "$APT" = 0 ] && why="--no-apt"
    [ -z "$PREFIX" ] || why="--prefix"
    hint="install ${need[*]} (Debian/Ubuntu: apt-get install ${need[*]}; Fedora/RHEL: dnf install ${need[*]})"
    if [[ " ${need[*]} " == *" python3-venv "* ]]; then
      die "$PYTHON has no venv module; $hint"
    elif [[ " ${need[*]} " == *" tmux "* ]] && [ -z "$PREFIX" ]; then
      die "tmux is not installed, and the training runs in tmux ($why); $hint"
    else
      log "warning: missing ${need[*]} ($why): $hint"
    fi
  fi
fi

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  log "using the existing venv $VENV"
else
  # Missing, or its interpreter is gone (the system Python was upgraded): build it afresh.
  log "creating the venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv --clear "$VENV"
fi
log "installing train-supervisor from $REPO"
# Built from a copy of what the package consists of, so the build leaves nothing (build/,
# *.egg-info) in the checkout. A local directory is always rebuilt and reinstalled by pip: an
# upgrade with an unchanged version number still gets the new code.
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
cp -R "$REPO/pyproject.toml" "$REPO/supervisor" "$SRC/"
for f in README.md LICENSE; do [ ! -e "$REPO/$f" ] || cp "$REPO/$f" "$SRC/"; done
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "$SRC"
"$VENV/bin/train-supervisord" --version >/dev/null || die "the installed train-supervisord does not run"

# --- supervisorctl on PATH ---------------------------------------------------------------------
mkdir -p "$BIN_DIR"
LINK="$BIN_DIR/supervisorctl"
if [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
  # Most likely PyPI's unrelated `supervisor` (supervisord): never clobber it.
  log "warning: $LINK exists and is not ours; use $VENV/bin/supervisorctl"
else
  ln -sfn "$VENV/bin/supervisorctl" "$LINK"
fi

# --- train-supervisor-start, for machines without systemd as PID 1 --------------------------------
install -m 0755 "$REPO/systemd/train-supervisor-start" "$VENV/bin/train-supervisor-start"
LINK="$BIN_DIR/train-supervisor-start"
if [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
  log "warning: $LINK exists and is not ours; use $VENV/bin/train-supervisor-start"
else
  ln -sfn "$VENV/bin/train-supervisor-start" "$LINK"
fi

# --- the group ---------------------------------------------------------------------------------
if [ -n "$GROUP" ]; then
  if [ -n "$PREFIX" ]; then
    log "not creating group $GROUP under --prefix (create it in the image: groupadd --system $GROUP)"
  elif getent group "$GROUP" >/dev/null; then
    log "group $GROUP exists"
  else
    groupadd --system "$GROUP"
    log "created group $GROUP (add users with: usermod -aG $GROUP USER)"
  fi
fi

# --- config (written once, never overwritten) ---------------------------------------------------
mkdir -p "$ETC"
if [ -e "$CONFIG" ]; then
  log "keeping the existing $CONFIG"
else
  tmp="$(mktemp "$ETC/.config.toml.XXXXXX")"
  "$VENV/bin/python" - "$GROUP" >"$tmp" <<'PY'
import sys
from importlib.resources import files

text = files("supervisor").joinpath("default-config.toml").read_text(encoding="utf-8")
group = sys.argv[1]
if group:
    text = text.replace('#socket_group = ""', f'socket_group = "{group}"', 1)
sys.stdout.write(text)
PY
  chmod 0644 "$tmp"
  mv "$tmp" "$CONFIG"
  log "wrote the commented default config $CONFIG"
fi

# --- the unit ----------------------------------------------------------------------------------
mkdir -p "$UNIT_DIR"
tmp="$(mktemp "$UNIT_DIR/.$UNIT.XXXXXX")"
sed "s#^ExecStart=/opt/train-supervisor/#ExecStart=$VENV/#" "$REPO/systemd/$UNIT" >"$tmp"
chmod 0644 "$tmp"
if cmp -s "$tmp" "$UNIT_DIR/$UNIT"; then
  rm -f "$tmp"
else
  mv "$tmp" "$UNIT_DIR/$UNIT"
  log "installed $UNIT_DIR/$UNIT"
fi

if [ "$ENABLE" = 1 ]; then
  if [ "$SYSTEMD_RUNNING" = 1 ]; then
    systemctl daemon-reload
    systemctl enable --quiet "$UNIT"
    if systemctl is-active --quiet "$UNIT"; then
      systemctl restart "$UNIT"  # upgrade: the training lives outside the unit and keeps running
      log "restarted the running daemon"
    elif [ "$START" = 1 ]; then
      systemctl start "$UNIT"
      log "started $UNIT"
    else
      log "enabled $UNIT; start it now with: systemctl start train-supervisor"
    fi
  elif command -v systemctl >/dev/null; then
    # No systemd running (an image build, a container, --prefix): enable offline for next boot.
    if out="$(systemctl --root="${PREFIX:-/}" enable "$UNIT" 2>&1)"; then
      log "enabled $UNIT for the next boot (systemd is not running here)"
    else
      log "systemctl --root=${PREFIX:-/} enable failed ($out); linking by hand"
      mkdir -p "$UNIT_DIR/multi-user.target.wants"
      ln -sfn "/etc/systemd/system/$UNIT" "$UNIT_DIR/multi-user.target.wants/$UNIT"
    fi
  else
    mkdir -p "$UNIT_DIR/multi-user.target.wants"
    ln -sfn "/etc/systemd/system/$UNIT" "$UNIT_DIR/multi-user.target.wants/$UNIT"
    log "enabled $UNIT for the next boot (no systemctl here: linked by hand)"
  fi
else
  log "not enabled (--no-enable); later: systemctl enable --now train-supervisor"
fi

# --- a config the daemon would refuse is reported now, not at boot -----------------------------
if ! "$VENV/bin/supervisorctl" check-config "$CONFIG" >/dev/null; then
  die "$CONFIG has problems (listed above); the daemon will not start until they are fixed"
fi

# --- without systemd as PID 1: how the daemon runs here --------------------------------------------
if [ -z "$PREFIX" ] && [ "$SYSTEMD_RUNNING" = 0 ]; then
  if "$VENV/bin/train-supervisor-start" --restart >/dev/null 2>&1; then
    log "restarted the daemon that train-supervisor-start runs (the training keeps running)"
  elif [ "$START" = 1 ]; then
    "$VENV/bin/train-supervisor-start"
  else
    log "systemd is not running here (a container?): start the daemon from the image's start script with"
    log "    train-supervisor-start"
    log "(it restarts the daemon when it fails and does nothing when it already runs; see the README)"
  fi
  action="$("$VENV/bin/python" -c 'import sys; from supervisor.config import load; print(load(sys.argv[1]).stop.action)' "$CONFIG" 2>/dev/null || true)"
  if [ "$action" = poweroff ]; then
    log "note: stop.action = \"poweroff\" needs systemd; in a container set [stop] action = \"command\" with the"
    log "      provider's stop command, e.g. runpodctl stop pod \$RUNPOD_POD_ID or vastai stop instance \$CONTAINER_ID"
  fi
fi
log "done: $("$VENV/bin/train-supervisord" --version) in $VENV; config $CONFIG OK"
