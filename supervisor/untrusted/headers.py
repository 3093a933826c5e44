"""The headers that say whether a weights file is whole: safetensors and the zip end record of a
torch archive. Pure: given the bytes read; nothing but Unreadable escapes."""

from __future__ import annotations

import struct

from supervisor.untrusted.readers import Unreadable, finite_int, json_object

# The safetensors format's own cap on its header (the reference reader refuses larger ones).
SAFETENSORS_HEADER_MAX = 100 * 1000 * 1000
# Headers up to this size are parsed to check the file's length; a larger one (100,000 tensors in
# one file; none seen in the wild) is left to the quiet period: parsing 100 MB of JSON costs about
# 1 GB and 12 s, at every change of the file, which anyone who can write the folder could force.
SAFETENSORS_PARSE_MAX = 16 << 20
_OFFSET_MAX = 1 << 62

ZIP_LOCAL_MAGIC = b"PK\x03\x04"
ZIP_EOCD_MAGIC = b"PK\x05\x06"
ZIP_TAIL = 22 + 65535  # end-of-central-directory record plus the longest comment


def safetensors_header_len(first8: bytes) -> int | None:
    """The header length the first 8 bytes announce; None when they cannot be a safetensors file."""
    if len(first8) < 8:
        return None
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    return n if 0 < n <= SAFETENSORS_HEADER_MAX else None


def safetensors_end(header: bytes) -> int:
    """The end of the data the header's tensors claim (the largest `data_offsets` end), counted
    from the end of the header; Unreadable when the header is not a safetensors header."""
    meta = json_object(header, limit=SAFETENSORS_PARSE_MAX, depth=8, what="the safetensors header")
    end = 0
    for k, v in meta.items():
        if k == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise Unreadable(f"the safetensors header's entry {k[:60]!r} has no data_offsets pair")
        a = finite_int(offsets[0], hi=_OFFSET_MAX, what="a data offset")
        b = finite_int(offsets[1], hi=_OFFSET_MAX, what="a data offset")
        if b < a:
            raise Unreadable(f"the safetensors header's entry {k[:60]!r} ends before it starts")
        end = max(end, b)
    return end


def zip_ends_whole(tail: bytes) -> bool:
    """True when `tail` (the last bytes of a zip file, up to ZIP_TAIL) ends with a consistent
    end-of-central-directory record: torch.save's archive format is only whole once it is."""
    tail = bytes(tail[-ZIP_TAIL:])
    i = tail.rfind(ZIP_EOCD_MAGIC)
    while i != -1:
        if len(tail) - i >= 22:
            (comment_len,) = struct.unpack("<H", tail[i + 20:i + 22])
            if i + 22 + comment_len == len(tail):
                return True
        i = tail.rfind(ZIP_EOCD_MAGIC, 0, i)
    return False
