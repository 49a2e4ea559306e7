"""A restricted unpickler for the flow_grpo / verl-omni pickle protocol (used by the HTTP scorer client and by the
standalone scorer server, which imports it from here: `http_scorer` depends on `omni_async`, never the reverse).

It admits only what pickle's own opcodes build: dicts, lists, tuples, sets, str, bytes, bytearray-free numbers,
booleans and None. Any global lookup (``find_class``), which is how every pickle gadget (``__reduce__`` to
``os.system``, ``eval``, ...) reaches code, is refused before anything is called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any


class UnsafePickleError(ValueError):
    """The pickle asks for something other than plain containers, strings, bytes and numbers."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise UnsafePickleError(
            f"pickle refers to {module}.{name}; only plain dict/list/tuple/str/bytes/number payloads are accepted"
        )

    def persistent_load(self, pid):
        raise UnsafePickleError("pickle uses persistent ids; only plain payloads are accepted")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads`` restricted to plain data; raises :class:`UnsafePickleError` (or ``pickle`` errors)."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # truncated / corrupt streams: one error type for the caller
        raise UnsafePickleError(f"not a readable pickle: {type(e).__name__}: {e}") from None
