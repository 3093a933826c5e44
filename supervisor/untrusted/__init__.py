"""Bytes the daemon does not own: the one way to read them.

The daemon runs as root and reads what the training user writes (checkpoints, trainer_state.json,
tracker files) and what a target hands back (manifests, heartbeats, run records). Any of it may be
hostile or merely broken: JSON nested 100,000 deep (RecursionError), `1e999` (an inf that makes
`int()` raise OverflowError), a safetensors header promising `1e999` bytes, a rank number in a
file name that would make a loop run for ever. None of those is a ValueError, so a reader that
catches ValueError lets them through and one file stops every sync pass.

Every reader here returns its declared result or raises `Unreadable` (a ValueError whose message
says why), whatever the input; nothing else ever escapes (tests/core/test_untrusted_fuzz.py holds them
to it with random and mutated real files). A caller that parses such bytes goes through these.
"""

from supervisor.untrusted.headers import (
    SAFETENSORS_HEADER_MAX,
    SAFETENSORS_PARSE_MAX,
    ZIP_EOCD_MAGIC,
    ZIP_LOCAL_MAGIC,
    ZIP_TAIL,
    safetensors_end,
    safetensors_header_len,
    zip_ends_whole,
)
from supervisor.untrusted.readers import (
    DEPTH_MAX,
    INT_MAX,
    Unreadable,
    finite_float,
    finite_int,
    float_or_none,
    int_or_none,
    json_doc,
    json_object,
    text,
)

__all__ = [
    "DEPTH_MAX", "INT_MAX", "SAFETENSORS_HEADER_MAX", "SAFETENSORS_PARSE_MAX", "ZIP_EOCD_MAGIC",
    "ZIP_LOCAL_MAGIC", "ZIP_TAIL", "Unreadable", "finite_float", "finite_int", "float_or_none", "int_or_none", "json_doc", "json_object",
    "safetensors_end", "safetensors_header_len", "text", "zip_ends_whole",
]
from supervisor.untrusted import records  # noqa: E402 - tracker records: bounded framing (lines, TFRecord, W&B log, protobuf)

__all__ += ["records"]
