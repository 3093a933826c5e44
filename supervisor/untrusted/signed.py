"""Documents the nodes of a run sign with their shared secret (`cluster.key_file`): heartbeats and
run-wide records on the sync target. Pure (hmac is arithmetic).

Whoever can write the bucket could otherwise keep a dead node "finished" (the survivors hang at
full price), get a live node stopped, or plant records that send the nodes to different units.
With a key, a document counts only when its `sig` is the HMAC-SHA256, under that key, of its kind
and the rest of the document in one canonical form (sorted keys, no spaces: what json.dumps gives
for the same values on every node); `hmac.compare_digest` compares. Without a key every document
counts and `sig` is not looked at: the bucket is trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIG = "sig"
KEY_MIN = 16  # bytes: a shorter secret is guessed


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes signed: the document without its signature, keys sorted, no spaces."""
    body = {k: v for k, v in doc.items() if k != SIG}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def signature(key: bytes, kind: str, doc: dict[str, Any]) -> str:
    return hmac.new(key, kind.encode() + b"\n" + canonical(doc), hashlib.sha256).hexdigest()


def seal(key: bytes | None, kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The document with its signature (unchanged without a key)."""
    if not key:
        return doc
    return {**doc, SIG: signature(key, kind, doc)}


def check(key: bytes | None, kind: str, doc: dict[str, Any]) -> str:
    """"" when the document counts; else why not ("unsigned", "wrongly signed")."""
    if not key:
        return ""
    sig = doc.get(SIG)
    if not isinstance(sig, str) or not sig:
        return "unsigned (cluster.key_file is set: only documents signed with it count)"
    try:
        want = signature(key, kind, doc)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return "wrongly signed (its values cannot be put in the signed form)"
    if not hmac.compare_digest(want.encode(), sig.encode("ascii", "replace")):
        return "wrongly signed (not with this run's cluster.key_file)"
    return ""


def key_of(data: bytes) -> bytes:
    """The secret in a key file's bytes: its first non-empty line, stripped. ValueError when it
    is shorter than KEY_MIN bytes."""
    line = next((ln.strip() for ln in data.splitlines() if ln.strip()), b"")
    if len(line) < KEY_MIN:
        raise ValueError(f"the key is {len(line)} bytes long; at least {KEY_MIN} are needed "
                         "(e.g. `openssl rand -hex 32`)")
    return line
