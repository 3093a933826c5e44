"""Config validation: every malformed file names its key, one line per problem, and both
`supervisorctl check-config` and `train-supervisord` (real subprocesses) exit 2 on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor import config as C
from supervisor.durations import format_bytes, format_duration, format_hms, parse_duration, parse_size

EMAIL = '[email]\nto = ["me@example.com"]\nsmtp_host = "smtp.example.com"\n'

# (name, file text, the line expected among the problems (a prefix is enough))
BAD: list[tuple[str, str, str]] = [
    ("duration_word", '[idle]\nwarn_after = "soon"\n', 'idle.warn_after: expected a duration like "2h", got "soon"'),
    ("duration_bare_number", "[idle]\nwarn_after = 7200\n", 'idle.warn_after: expected a duration like "2h", got 7200'),
    ("duration_no_unit", '[idle]\nstop_after_warning = "30"\n', 'idle.stop_after_warning: expected a duration'),
    ("typo_key", '[idle]\nwarn_afer = "2h"\n', "idle.warn_afer: unknown key (did you mean idle.warn_after?)"),
    ("typo_section", '[idel]\nwarn_after = "2h"\n', "idel: unknown key (did you mean idle?)"),
    ("unknown_top_level", 'price = 3.9\n', "price: unknown key"),
    ("unknown_subtable", '[idle.extra]\nx = 1\n', "idle.extra: unknown key"),
    ("section_as_value", 'idle = "2h"\n', 'idle: expected a [idle] table, got "2h"'),
    ("poll_zero", '[gpu]\npoll_interval = "0"\n', 'gpu.poll_interval: must be at least 100ms, got "0"'),
    ("percent_over_100", "[idle]\ngpu_util_threshold = 150\n", "idle.gpu_util_threshold: must be at most 100, got 150"),
    ("bad_choice", '[stop]\naction = "shutdown"\n',
     'stop.action: expected one of auto, provider, poweroff, command, ec2, dry-run, got "shutdown"'),
    ("command_action_without_command", '[stop]\naction = "command"\n',
     'stop.command: required when stop.action = "command"'),
    ("bool_as_string", '[training]\nautostart = "yes"\n', 'training.autostart: expected true or false, got "yes"'),
    ("autostart_without_command", "[training]\nautostart = true\n", "training.autostart: needs training.command"),
    ("int_as_float", "[training]\nmax_restarts = 1.5\n", "training.max_restarts: expected a whole number, got 1.5"),
    ("negative_int", "[training]\nmax_restarts = -1\n", "training.max_restarts: must be at least 0, got -1"),
    ("tmux_unsafe_session", '[training]\nsession = "run.1"\n', "training.session: only letters, digits"),
    ("env_bad_name", '[training]\nenv = { "1BAD" = "x" }\n', "training.env.1BAD: not a valid environment variable name"),
    ("env_not_string", "[training]\nenv = { CUDA_VISIBLE_DEVICES = 0 }\n",
     "training.env.CUDA_VISIBLE_DEVICES: expected a string, got 0"),
    ("relative_path", '[training]\nworkdir = "workspace"\n', 'training.workdir: expected an absolute path, got "workspace"'),
    ("target_scheme", '[sync]\ntarget = "ftp://host/x"\n', "sync.target: unsupported scheme"),
    ("target_bucket", '[sync]\ntarget = "s3://B_/x"\n', "sync.target: not a valid S3 bucket name"),
    ("watch_not_list", '[sync]\ntarget = "/backup"\nwatch = "/workspace/out"\n',
     'sync.watch: expected a list of strings, got "/workspace/out"'),
    ("watch_relative", '[sync]\ntarget = "/backup"\nwatch = ["out"]\n', 'sync.watch[0]: expected an absolute path, got "out"'),
    ("watch_without_target", '[sync]\nwatch = ["/workspace/out"]\n', "sync.target: required when sync.watch lists folders"),
    ("final_sync_without_target", '[stop]\nfinal_sync = ["/workspace/out"]\n',
     "sync.target: required when stop.final_sync lists folders"),
    ("size_word", '[sync]\npart_size = "lots"\n', 'sync.part_size: expected a size like "64M", got "lots"'),
    ("size_float", "[sync]\npart_size = 1.5\n", 'sync.part_size: expected a size like "64M", got 1.5'),
    ("size_too_small", '[sync]\npart_size = "1M"\n', 'sync.part_size: must be at least 5.0 MiB, got "1M"'),
    ("url_without_scheme", '[sync]\nendpoint_url = "minio:9000"\n',
     'sync.endpoint_url: expected an http:// or https:// URL, got "minio:9000"'),
    ("email_without_to", '[email]\nsmtp_host = "smtp.example.com"\n', "email.to: at least one address is required"),
    ("email_without_host", '[email]\nto = ["me@example.com"]\n', "email.smtp_host: required in [email]"),
    ("email_bad_address", '[email]\nto = ["me at example.com"]\nsmtp_host = "h"\n',
     'email.to[0]: not an email address: "me at example.com"'),
    ("email_bad_from", EMAIL + 'from = "Me <me@example.com>"\n', "email.from: not an email address"),
    ("email_security", EMAIL + 'security = "tls"\n', 'email.security: expected one of starttls, ssl, none, got "tls"'),
    ("email_port", EMAIL + "smtp_port = 70000\n", "email.smtp_port: must be at most 65535, got 70000"),
    ("email_user_without_password", EMAIL + 'username = "me"\n', "email.password_file: required with email.username"),
    ("email_cleartext_login", EMAIL + 'security = "none"\nusername = "me"\npassword_file = "/etc/pw"\n',
     'email.security: "none" would send the password for email.username in clear'),
    ("email_unknown_key", EMAIL + 'password = "hunter2"\n', "email.password: unknown key (did you mean email.password_file?)"),
    ("price_as_string", 'price_per_hour = "3.90"\n', 'price_per_hour: expected a number, got "3.90"'),
    ("price_nan", "price_per_hour = nan\n", "price_per_hour: expected a finite number, got nan"),
    ("cost_cap_without_price", "max_idle_cost = 10.0\n", "max_idle_cost: needs price_per_hour"),
    ("currency", 'currency = "euro"\n', 'currency: expected a 3-letter code like EUR, got "euro"'),
    ("socket_relative", 'socket = "control.sock"\n', 'socket: expected an absolute path, got "control.sock"'),
    ("socket_too_long", f'socket = "/{"x" * 120}"\n', "socket: path longer than 100 bytes"),
    ("log_level", 'log_level = "verbose"\n', 'log_level: expected one of debug, info, warning, error, got "verbose"'),
    ("control_chars_stay_on_one_line", '[training]\nsession = "a\\nb"\n', r'training.session: only letters, digits, '),
    ("not_toml", "[idle]\nwarn_after = 2h\n", "not valid TOML"),
]


def test_there_are_enough_cases():
    assert len(BAD) >= 20 and len({n for n, _, _ in BAD}) == len(BAD)


@pytest.mark.parametrize(("name", "text", "expected"), BAD, ids=[b[0] for b in BAD])
def test_parse_names_the_key(name, text, expected, monkeypatch):
    monkeypatch.delenv(C.ENV_VAR, raising=False)
    monkeypatch.delenv("TRAIN_SUPERVISOR_SMTP_PASSWORD", raising=False)
    with pytest.raises(C.ConfigError) as ei:
        C.parse(text, "bad.toml")
    problems = ei.value.problems
    assert any(p.startswith(expected) or (name == "not_toml" and expected in p) for p in problems), problems
    assert all("\n" not in p and "\r" not in p for p in problems)


def test_every_problem_is_reported_at_once():
    text = ('currency = "euro"\n[idle]\nwarn_after = "soon"\nwarn_afer = "1h"\n'
            '[stop]\naction = "halt"\n[sync]\nwatch = ["rel"]\n')
    with pytest.raises(C.ConfigError) as ei:
        C.parse(text)
    keys = sorted(p.split(":")[0] for p in ei.value.problems)
    assert keys == ["currency", "idle.warn_afer", "idle.warn_after", "stop.action", "sync.target", "sync.watch[0]"]


# --- the same files through the real executables ---------------------------------------------

def _exe(name: str) -> str:
    p = Path(sys.executable).with_name(name)
    found = str(p) if p.exists() else shutil.which(name)
    assert found, f"{name} is not installed next to {sys.executable} (pip install -e .)"
    return found


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_SUPERVISOR_")}
    env.pop("NOTIFY_SOCKET", None)
    return env


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad-configs")
    out = {}
    for name, text, _ in BAD:
        out[name] = d / f"{name}.toml"
        out[name].write_text(text)
    return out


def _run_all(argv_for, files: dict[str, Path]) -> dict[str, subprocess.CompletedProcess]:
    """Run one process per file, a few at a time: each is a fresh Python start."""
    def one(name: str) -> tuple[str, subprocess.CompletedProcess]:
        return name, subprocess.run(argv_for(files[name]), capture_output=True, text=True, timeout=60, env=_env())

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, files))


@pytest.fixture(scope="module")
def check_config_results(bad_files):
    ctl = _exe("supervisorctl")
    return _run_all(lambda p: [ctl, "check-config", str(p)], bad_files)


@pytest.fixture(scope="module")
def daemon_results(bad_files):
    d = _exe("train-supervisord")
    return _run_all(lambda p: [d, "--config", str(p)], bad_files)


def _expect_line(stderr: str, name: str, expected: str) -> None:
    lines = [line.strip() for line in stderr.splitlines()]
    assert any(line.startswith(expected) or (name == "not_toml" and expected in line) for line in lines), stderr


@pytest.mark.parametrize(("name", "text", "expected"), BAD, ids=[b[0] for b in BAD])
def test_check_config_exits_2_naming_the_key(name, text, expected, check_config_results):
    r = check_config_results[name]
    assert r.returncode == 2, (r.stdout, r.stderr)
    _expect_line(r.stderr, name, expected)
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("name", "text", "expected"), BAD, ids=[b[0] for b in BAD])
def test_daemon_refuses_to_start(name, text, expected, daemon_results):
    r = daemon_results[name]
    assert r.returncode == 2, (r.stdout, r.stderr)
    _expect_line(r.stderr, name, expected)
    assert "Traceback" not in r.stderr


def test_check_config_all_problems_one_line_each(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[idle]\nwarn_after = "soon"\nstop_after_warning = "later"\n[gpu]\npoll_intervall = "5s"\n')
    r = subprocess.run([_exe("supervisorctl"), "check-config", str(p)], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2
    assert r.stderr.splitlines() == ['idle.warn_after: expected a duration like "2h", got "soon"',
                                     'idle.stop_after_warning: expected a duration like "2h", got "later"',
                                     "gpu.poll_intervall: unknown key (did you mean gpu.poll_interval?)"]


def test_check_config_accepts_a_good_file_and_the_env_var(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(SPEC_EXAMPLE)
    ctl = _exe("supervisorctl")
    r = subprocess.run([ctl, "check-config", str(p)], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    r = subprocess.run([ctl, "check-config"], capture_output=True, text=True, timeout=60,
                       env={**_env(), C.ENV_VAR: str(p)})
    assert r.returncode == 0, r.stderr
    r = subprocess.run([ctl, "check-config", str(tmp_path / "missing.toml")], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2 and "missing.toml" in r.stderr


# --- good configs ---------------------------------------------------------------------------

SPEC_EXAMPLE = '''
state_dir = "/var/lib/train-supervisor"
socket = "/run/train-supervisor/control.sock"
socket_group = "train"            # optional: who besides root may use supervisorctl
price_per_hour = 3.90             # optional: enables cost figures and max_idle_cost
currency = "EUR"

[training]
command = "python train.py"       # run by a shell inside tmux
workdir = "/workspace"
session = "train"                 # tmux session name
log = "/workspace/train.log"
env = { HF_HOME = "/workspace/hf" }
restart = "never"                 # never | on-failure
on_finish = "stop"                # stop | idle | none
finish_grace = "10m"
autostart = false                 # start `command` when the daemon starts (once per boot)

[gpu]
poll_interval = "5s"

[sync]
target = "s3://bucket/run1"       # s3://bucket/prefix | user@host:path | /local/path
endpoint_url = ""                 # S3-compatible endpoint, optional
watch = ["/workspace/out"]
include = ["checkpoint-*/**", "**/adapter_model.safetensors", "**/adapter_config.json"]
exclude = []
quiet_period = "30s"

[idle]
warn_after = "2h"
stop_after_warning = "1h"
gpu_util_threshold = 5            # percent, judged over the rolling window
jupyter_url = ""                  # e.g. http://127.0.0.1:8888, optional
jupyter_token_file = ""

[stop]
action = "poweroff"               # poweroff | command | ec2 | dry-run
command = ""                      # for action = "command"
final_sync = ["/workspace/out"]
stop_even_if_sync_fails = false

[email]                           # optional: without it alerts go to the journal and `supervisorctl alerts`
to = ["me@example.com"]
from = "supervisor@gpu-box"
smtp_host = "smtp.example.com"
smtp_port = 587
security = "starttls"             # starttls | ssl | none
username = ""
password_file = ""
'''


def test_spec_example_parses():
    cfg = C.parse(SPEC_EXAMPLE, "spec")
    assert cfg.source == "spec" and cfg.currency == "EUR" and cfg.price_per_hour == 3.9
    assert cfg.socket_group == "train"
    assert cfg.training.command == "python train.py" and cfg.training.env == {"HF_HOME": "/workspace/hf"}
    assert cfg.training.finish_grace == 600 and cfg.gpu.poll_interval == 5
    assert cfg.sync.target == "s3://bucket/run1" and cfg.sync.watch == ["/workspace/out"]
    assert cfg.sync.quiet_period == 30
    assert cfg.idle.warn_after == 7200 and cfg.idle.stop_after_warning == 3600
    assert cfg.idle.gpu_util_threshold == 5.0
    assert cfg.stop.final_sync == ["/workspace/out"]
    assert cfg.email is not None and cfg.email.from_ == "supervisor@gpu-box" and cfg.email.security == "starttls"


def test_empty_file_is_all_defaults():
    cfg = C.parse("")
    assert cfg.email is None and cfg.idle.warn_after == 7200 and cfg.stop.action == "auto"
    assert cfg.training.session == "train" and cfg.sync.part_size == 8 * 1024 * 1024


@pytest.mark.parametrize(("text", "attr", "value"), [
    ('[idle]\nwarn_after = "1h30m"', ("idle", "warn_after"), 5400.0),
    ('[idle]\nwarn_after = "90s"', ("idle", "warn_after"), 90.0),
    ('[idle]\nwarn_after = "1.5h"', ("idle", "warn_after"), 5400.0),
    ('[idle]\nwarn_after = "1d"', ("idle", "warn_after"), 86400.0),
    ('[idle]\nwarn_after = "0"', ("idle", "warn_after"), 0.0),
    ('[gpu]\npoll_interval = "500ms"', ("gpu", "poll_interval"), 0.5),
    ('[sync]\npart_size = "8MiB"', ("sync", "part_size"), 8 * 1024 * 1024),
    ('[sync]\npart_size = 10485760', ("sync", "part_size"), 10485760),
    ('[sync]\nbandwidth_limit = "1G"', ("sync", "bandwidth_limit"), 1024**3),
    ('[sync]\ntarget = "me@backup.example.com:/srv/runs"', ("sync", "target"), "me@backup.example.com:/srv/runs"),
    ('[sync]\ntarget = "/mnt/backup/"', ("sync", "target"), "/mnt/backup/"),
    ('[idle]\ngpu_util_threshold = 7.5', ("idle", "gpu_util_threshold"), 7.5),
    ('[training]\nsession = "run-1_a"', ("training", "session"), "run-1_a"),
    ('[stop]\naction = "command"\ncommand = "runpodctl stop pod $RUNPOD_POD_ID"', ("stop", "action"), "command"),
])
def test_good_values(text, attr, value):
    cfg = C.parse(text)
    assert getattr(getattr(cfg, attr[0]), attr[1]) == value


def test_password_env_var_satisfies_username(monkeypatch):
    monkeypatch.setenv("TRAIN_SUPERVISOR_SMTP_PASSWORD", "x")
    cfg = C.parse(EMAIL + 'username = "me"\n')
    assert cfg.email.username == "me" and cfg.email.password_file == ""


def test_from_dict_matches_parse():
    assert C.from_dict({"idle": {"warn_after": "3h"}}).idle.warn_after == 10800


def test_load(tmp_path, monkeypatch):
    monkeypatch.delenv(C.ENV_VAR, raising=False)
    missing = tmp_path / "nope.toml"
    with pytest.raises(C.ConfigError, match="config file not found"):
        C.load(str(missing))
    monkeypatch.setattr(C, "DEFAULT_PATH", str(missing))
    assert C.load().source == "<defaults>"  # a fresh image without a config still runs
    good = tmp_path / "c.toml"
    good.write_text('[idle]\nwarn_after = "3h"\n')
    monkeypatch.setenv(C.ENV_VAR, str(good))
    assert C.load().idle.warn_after == 10800 and C.load().source == str(good)
    monkeypatch.setenv(C.ENV_VAR, str(missing))
    with pytest.raises(C.ConfigError, match="not found"):
        C.load()
    with pytest.raises(C.ConfigError, match="cannot read config file"):
        C.load(str(tmp_path))  # a directory
    latin = tmp_path / "l.toml"
    latin.write_bytes(b'currency = "\xe9"\n')
    with pytest.raises(C.ConfigError, match="cannot read config file"):
        C.load(str(latin))


# --- durations and sizes --------------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("2h", 7200), ("90s", 90), ("1h30m", 5400), ("10m", 600), ("1d", 86400), ("250ms", 0.25),
    ("0", 0), ("1.5h", 5400), (" 2H ", 7200), ("1h 30m", 5400), ("0s", 0),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "30", "-1h", "h", "2x", "1h-30m", "2 hours", "1e3s", "inf"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (42, "42s"), (90, "1m30s"), (3900, "1h05m"), (7200, "2h00m"), (273600, "3d04h"),
    (None, "unknown"), (-1, "unknown"), (float("nan"), "unknown"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(0, 30 * 86400))
def test_format_then_parse_round_trips(s):
    back = parse_duration(format_duration(s))
    # exact below an hour; past it the display drops seconds (and minutes past a day)
    assert back == s if s < 3600 else 0 <= s - back < (60 if s < 86400 else 3600)


def test_format_hms():
    assert format_hms(3723) == "1:02:03" and format_hms(-5) == "0:00:00"


@pytest.mark.parametrize(("text", "n"), [
    ("512M", 512 * 1024**2), ("8MiB", 8 * 1024**2), ("1G", 1024**3), ("1.5K", 1536), ("100", 100),
    (100, 100), ("2 GB", 2 * 1024**3), ("1t", 1024**4), ("0", 0),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "lots", "-1M", "1X", True, -5, "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(None) == "unknown" and format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(5 * 1024**4) == "5.0 TiB"


def test_a_target_with_nothing_watched_watches_the_output_dir_or_the_workdir_or_is_refused():
    from supervisor.config import from_dict, nothing_watched
    from supervisor.config.checks import command_output_dir

    cfg = from_dict({"training": {"command": "python train.py --output_dir out/tiny --lr 1e-4",
                                  "workdir": "/workspace"}, "sync": {"target": "/backup"}})
    assert cfg.sync.watch == ["/workspace/out/tiny"] and "output_dir" in cfg.sync.watch_default
    cfg = from_dict({"training": {"command": "python train.py", "workdir": "/workspace"},
                     "sync": {"target": "/backup"}})
    assert cfg.sync.watch == ["/workspace"] and cfg.sync.watch_default == "training.workdir"
    cfg = from_dict({"training": {"command": "python train.py"}, "sync": {"target": "/backup"}})
    assert cfg.sync.watch == [] and nothing_watched(cfg)[0].startswith("sync.watch: empty")
    given = from_dict({"sync": {"target": "/backup", "watch": ["/w/o"]}, "training": {"workdir": "/x"}})
    assert given.sync.watch == ["/w/o"] and not given.sync.watch_default and not nothing_watched(given)
    assert command_output_dir("accelerate launch t.py --output-dir=/o/r", "") == "/o/r"
    assert command_output_dir("python t.py --output_dir $OUT", "/w") == ""
    assert command_output_dir("python t.py --output_dir 'unclosed", "/w") == ""
