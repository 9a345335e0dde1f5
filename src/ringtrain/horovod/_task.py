"""What each process of an ``hvd.run`` job runs: load the function, call it, print its
value between the job's markers (:mod:`ringtrain.horovod.runner`)."""

from __future__ import annotations

import base64
import os
import pickle
import sys

from ringtrain.horovod.runner import CHUNK, FUNC_ENV, FUNC_FILE_ENV, TOKEN_ENV

__all__ = ["main"]


def _load() -> bytes:
    inline = os.environ.get(FUNC_ENV)
    if inline:
        return base64.b64decode(inline)
    path = os.environ.get(FUNC_FILE_ENV, "")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise SystemExit(
            f"hvd.run: cannot read the job's function from {path} ({err.strerror}): it was "
            "written in the launching host's working directory; run from a directory every "
            "host shares, or keep the function and its arguments under 96 KiB pickled") from None


def _rank() -> int:
    import ringtrain.horovod as hvd

    if hvd.is_initialized():
        return hvd.rank()
    for name in ("HOROVOD_RANK", "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def main() -> int:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        print("ringtrain.horovod._task runs inside hvd.run; call hvd.run(func, num_proc=...)",
              file=sys.stderr)
        return 2
    func, args, kwargs = pickle.loads(_load())
    value = func(*args, **kwargs)
    try:
        data = pickle.dumps(value)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle

        data = cloudpickle.dumps(value)
    text = base64.b64encode(data)
    pieces = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [b""]
    rank = _rank()
    out = sys.stdout.buffer
    sys.stdout.flush()
    for i, piece in enumerate(pieces):
        out.write(f"{token}{rank}:{i}:{len(pieces)}:".encode() + piece + b"\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
