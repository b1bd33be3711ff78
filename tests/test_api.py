"""The public API, pinned: ``cupaged.__all__`` and the signature of every public function,
class and method it names (``reference``'s functions too), against ``api_snapshot.json``.
A change to the API shows here as a diff; when it is meant, regenerate the snapshot with
``python3 tests/test_api.py > tests/api_snapshot.json`` and say so in the commit."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("api_snapshot.json")


def _signature(f) -> str:
    try:
        return str(inspect.signature(f))
    except (TypeError, ValueError):
        return "?"


def _members(cls) -> dict:
    out = {}
    for name, v in sorted(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(v, property):
            out[name] = "property"
        elif isinstance(v, (staticmethod, classmethod)) or callable(v):
            out[name] = _signature(getattr(v, "__func__", v))
    return out


def public_api() -> dict:
    import cupaged

    api = {"__all__": sorted(cupaged.__all__)}
    for name in sorted(cupaged.__all__):
        obj = getattr(cupaged, name)
        if inspect.isclass(obj):
            api[name] = {"bases": [b.__name__ for b in obj.__bases__], **_members(obj)}
        elif inspect.ismodule(obj):
            api[name] = {n: _signature(f) for n, f in sorted(vars(obj).items())
                         if not n.startswith("_") and inspect.isfunction(f)
                         and f.__module__ == obj.__name__}
        elif callable(obj):
            api[name] = _signature(obj)
        else:
            api[name] = repr(obj)
    return api


def test_the_public_api_is_as_pinned():
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(public_api()))
    changed = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    assert not changed, {k: (want.get(k), got.get(k)) for k in changed}


if __name__ == "__main__":
    json.dump(public_api(), sys.stdout, indent=1, sort_keys=True)
    print()
