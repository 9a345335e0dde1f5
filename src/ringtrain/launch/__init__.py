"""ringrun: the launcher. Imports no torch, so starting a job stays fast."""

from __future__ import annotations

__all__: list[str] = []
