"""Values ringtrain writes to the job's store carry an HMAC with the job's secret.

The rendezvous store is a TCP server without authentication: on a shared host any
local user can connect to it and read, set or delete keys (docs/launch.md). ringrun
gives every rank a per-job secret (``RINGTRAIN_JOB_SECRET``, in the environment only, as
the rank numbers travel); what ringtrain itself writes there (stall reports, exit
marks, the first-step signatures, the rendezvous outcome) is sealed with it, and a
value that does not verify is ignored as if absent. Without a secret (a launcher other
than ringrun) values are written plain. Pure functions, no torch.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["Signer"]

_TAG_LEN = 32  # hex characters of the HMAC-SHA256 kept: 128 bits


class Signer:
    def __init__(self, secret: str = "") -> None:
        self._key = secret.encode() if secret else b""

    @property
    def active(self) -> bool:
        return bool(self._key)

    def _tag(self, key: str, value: str) -> str:
        # The store key is part of the message: a sealed value cannot be replayed
        # under another key (rank 1's report as rank 2's).
        return hmac.new(self._key, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()[:_TAG_LEN]

    def seal(self, key: str, value: str) -> str:
        if not self._key:
            return value
        return f"{self._tag(key, value)}:{value}"

    def open(self, key: str, raw: bytes | str) -> str | None:
        """The value, or None when it was not sealed with this job's secret."""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if not self._key:
            return text
        tag, sep, value = text.partition(":")
        if not sep or not hmac.compare_digest(tag, self._tag(key, value)):
            return None
        return value
