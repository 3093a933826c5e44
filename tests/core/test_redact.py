"""supervisor.redact: a secret value never survives; what is not a secret stays readable."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from supervisor.redact import MASK, redact, redact_obj, secret_name

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"


@pytest.mark.parametrize("text, want", [
    ("vastai stop instance 7 --api-key 5f3c9a", "vastai stop instance 7 --api-key ***"),
    ("runpodctl stop pod $RUNPOD_POD_ID --apiKey=XYZ123", "runpodctl stop pod $RUNPOD_POD_ID --apiKey=***"),
    ("python train.py --hub_token abc --push_to_hub", "python train.py --hub_token *** --push_to_hub"),
    ("cmd --token=abc --other x", "cmd --token=*** --other x"),
    ("cmd --password 'a b c' --x 1", "cmd --password *** --x 1"),
    ('cmd --secret "a \\" b" next', "cmd --secret *** next"),
    ("cmd -p 8080 --pass hunter2", "cmd -p 8080 --pass ***"),
    ("cmd --auth user:pw", "cmd --auth ***"),
    ("cmd --client-secret s --access-key k --private_key pk", "cmd --client-secret *** --access-key *** --private_key ***"),
    ("API_KEY=abc python train.py", "API_KEY=*** python train.py"),
    ("export HF_TOKEN=abc; export WANDB_API_KEY='x y'", "export HF_TOKEN=***; export WANDB_API_KEY=***"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG aws s3 ls", "AWS_SECRET_ACCESS_KEY=*** aws s3 ls"),
    ("dict(password='pw', n=1)", "dict(password=*** n=1)"),  # the comma goes too: it may be the secret's
    ("cmd --password a,b{c}[d] --x 1", "cmd --password *** --x 1"),
    ("https://user:pa55@host.example/x", "https://user:***@host.example/x"),
    ("git clone https://x-access-token:p@ss@github.com/o/r", "git clone https://x-access-token:***@github.com/o/r"),
    ("https://h/o?X-Amz-Credential=AK%2F1&X-Amz-Signature=ff00&x=1",
     "https://h/o?X-Amz-Credential=***&X-Amz-Signature=***&x=1"),
    ("https://h/api?token=abc&page=2", "https://h/api?token=***&page=2"),
    ("curl -u me:pw https://x", "curl -u me:*** https://x"),
    ("curl --user=me:pw https://x", "curl --user=me:*** https://x"),
    ('curl -H "Authorization: Bearer abc.def" x', 'curl -H "Authorization: Bearer ***" x'),
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
    ("X-Api-Key: k123", "X-Api-Key: ***"),
    ("got Bearer eyAbCdEf from the server", "got Bearer *** from the server"),
    ('{"api_key": "v1", "n": 1}', '{"api_key": "***", "n": 1}'),
    ("{'hf_token': 'v1'}", "{'hf_token': '***'}"),
    (f"login with {HF} now", "login with *** now"),
    ("id AKIAIOSFODNN7EXAMPLE", "id ***"),
    ("ghp_" + "a" * 36, MASK),
    ("github_pat_" + "A1_" * 10, MASK),
    ("glpat-" + "x" * 20, MASK),
    ("xoxb-1234-5678-abcdefghij", MASK),
    ("sk-proj-" + "Z" * 40, MASK),
    ("AIza" + "B" * 35, MASK),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", MASK),
])
def test_redacts(text, want):
    assert redact(text) == want


@pytest.mark.parametrize("text", [
    "python train.py --max_tokens 512 --max_new_tokens 64 --tokenizer meta-llama/Llama-3 --output_dir /out",
    "TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=0,1 HF_HOME=/workspace/hf python x.py",
    "key=checkpoint-1/model.safetensors",  # an S3 object key, in the sync engine's logs
    "--token-file /run/secrets/hf --password_file /etc/pw --hf_token_path /x --auth-type basic",
    "AWS_ACCESS_KEY_ID_FILE=/x --key-id 7",
    "s3://bucket/run1 me@gpu-box:/backup/run1 hf://me/model /mnt/out",
    "ssh -i ~/.ssh/id_ed25519 -p 2222 me@host",
    "sha1 da39a3ee5e6b4b0d3255bfef95601890afd80709 step 1200 loss 0.42 tokens/s 1530",
    "sudo supervisorctl keepalive 2h; supervisorctl sync --wait",
    "a basic run, with a pass rate of 90% and 3 passes",
    "",
])
def test_leaves_what_is_not_a_secret(text):
    assert redact(text) == text


@pytest.mark.parametrize("name, secret", [
    ("--api-key", True), ("--apiKey", True), ("API_KEY", True), ("hub_token", True), ("HF_TOKEN", True),
    ("AWS_SECRET_ACCESS_KEY", True), ("X-Amz-Signature", True), ("password", True), ("db_passwd", True),
    ("--auth", True), ("webhook_secret", True), ("openaiApiKey", True), ("accesstoken", True),
    ("max_tokens", False), ("tokenizer", False), ("key", False), ("--keep-last", False),
    ("hf_token_file", False), ("password_file", False), ("AWS_ACCESS_KEY_ID", False), ("auth_type", False),
    ("tokens_per_s", False), ("keepalive_until", False), ("signal", False), ("", False),
    ("PWD", False), ("OLDPWD", False), ("--db-pwd", True),
])
def test_secret_name(name, secret):
    assert secret_name(name) is secret


def test_redact_obj_masks_by_key_and_by_value_and_keeps_the_shape():
    status = {"training": {"command": "train --hub_token abc", "state": "RUNNING", "pid": 7,
                           "progress": {"tokens_per_s": 1530.5, "loss": None}},
              "env": {"HF_TOKEN": "plain-looking", "HF_HOME": "/hf"},
              "alerts": [{"subject": "stop: run `vastai stop instance 1 --api-key k9`", "n": 1}],
              "tuple": ("API_KEY=z", 3)}
    out = redact_obj(status)
    assert out["training"] == {"command": "train --hub_token ***", "state": "RUNNING", "pid": 7,
                               "progress": {"tokens_per_s": 1530.5, "loss": None}}
    assert out["env"] == {"HF_TOKEN": MASK, "HF_HOME": "/hf"}
    assert out["alerts"][0]["subject"] == "stop: run `vastai stop instance 1 --api-key ***`"
    assert out["tuple"] == ("API_KEY=***", 3)
    assert status["env"]["HF_TOKEN"] == "plain-looking"  # a copy; the input is untouched
    json.dumps(out)


# --- the property: whatever the secret, it is not in the output --------------------------------------

_word = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+=:@%~^!*,{}[]/?#$"),
                min_size=6, max_size=40)
_spaced = st.text(st.characters(blacklist_characters="'\"\\\n\r\x00", blacklist_categories=("Cs",)),
                  min_size=6, max_size=40)

UNQUOTED = [
    "vastai stop instance 7 --api-key {v}",
    "vastai stop instance 7 --api-key={v} --raw",
    "python train.py --hub_token {v} --max_tokens 5",
    "runpodctl --apiKey {v}",
    "API_KEY={v} python train.py",
    "export HF_TOKEN={v}; python x.py",
    "env AWS_SECRET_ACCESS_KEY={v} aws s3 ls",
    "curl -H 'Authorization: Bearer {v}' https://x",
    "curl -H 'Authorization: Basic {v}' https://x",
    "https://h/x?token={v}&b=1",
    "https://h/x?X-Amz-Signature={v}",
    "curl -u me:{v} https://x",
    "pw: --password={v}",
]
QUOTED = [
    "cmd --password '{v}' --x 1",
    'cmd --secret "{v}" next',
    "PASSWORD='{v}' cmd",
    'HF_TOKEN="{v}" cmd',
    '{{"api_key": "{v}", "n": 1}}',
    "{{'client_secret': '{v}'}}",
]


def _check(template: str, v: str) -> None:
    text = template.format(v=v)
    assume(v not in template.format(v=""))  # the value must not be a piece of the template itself
    assume(not v.startswith("-"))
    assert v not in redact(text), (text, redact(text))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(UNQUOTED), _word)
@example("vastai stop instance 7 --api-key {v}", "abc:def@ghi")
def test_property_unquoted_secret_never_survives(template, v):
    _check(template, v)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(QUOTED), _spaced)
@example("cmd --password '{v}' --x 1", "a b; rm -rf / & echo")
def test_property_quoted_secret_never_survives(template, v):
    _check(template, v)


@settings(max_examples=200, deadline=None)
@given(st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"), min_size=6,
               max_size=30).filter(lambda p: not p.startswith("-") and "@" not in p))
def test_property_url_password_never_survives(v):
    assume(v not in "https://user:@host.example/path")
    text = f"rsync to https://user:{v}@host.example/path now"
    assert v not in redact(text)


@settings(max_examples=200, deadline=None)
@given(st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"),
               min_size=34, max_size=40), st.sampled_from(["{t}", "log: {t}.", "x={t}", "'{t}'", "({t})"]))
def test_property_hf_tokens_never_survive_anywhere(body, around):
    token = "hf_" + body
    assert token not in redact(around.format(t=token))
    assert body not in redact(around.format(t=token))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_property_redact_is_total_and_idempotent(text):
    once = redact(text)
    assert redact(once) == once


@pytest.mark.parametrize("unit", ["x", "a=", "-", " --a", "'", '"', "http://", "a:", "x://a:", " --token='",
                                  " -u a:", "eyJaaaaaaaaa.", "Authorization: ", '"a":', "a.b-c_d"])
def test_no_pattern_backtracks_on_hostile_input(unit):
    """64 KiB (a whole control request) of a pattern's own prefix, repeated: linear (tens of ms), where a
    backtracking pattern takes minutes. The bound is loose on purpose: this guards against quadratic."""
    import time

    from supervisor.redact import _redact

    text = unit * (65536 // len(unit))
    t0 = time.perf_counter()
    _redact(text)
    assert time.perf_counter() - t0 < 3.0


def test_the_working_folder_in_the_environment_is_not_taken_for_a_password():
    """A daemon started from /workspace has PWD=/workspace: registered as a secret, it masked every
    path under it in every mail and status line (the fresh machine's demo showed `***/examples`)."""
    from supervisor.config import from_dict
    from supervisor.daemon.channels import register_secrets
    from supervisor.redact import forget_registered

    try:
        register_secrets(from_dict({}), env={"PWD": "/workspace", "OLDPWD": "/root/src", "DB_PWD": "hunter2pw!"})
        assert redact("cd /workspace/out && ls /root/src") == "cd /workspace/out && ls /root/src"
        assert "hunter2pw!" not in redact("mysql -p hunter2pw!")
    finally:
        forget_registered()
