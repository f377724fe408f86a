"""The guest agent reads and writes frames with json's C parts instead of ``import json`` (a
boot under gVisor pays for every module imported): the frames must be what json would make and
read, bad input must be a ValueError as json's is, and the agent must start without json or re."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ephemeral.settings import REPO_ROOT

AGENT = REPO_ROOT / "sandbox_images" / "default" / "guest" / "agent.py"


def _agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guest_agent_codec_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


AGENT_MOD = _agent()

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=1 << 62, max_value=1 << 80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_the_agent_uses_the_fast_codec_here() -> None:
    # json's own functions would be the fallback: on this Python the C parts must be in use,
    # or the test below compares json with itself
    assert AGENT_MOD.json_loads is not json.loads
    assert getattr(AGENT_MOD.json_dumps, "__module__", None) == AGENT_MOD.__name__


@settings(max_examples=300, deadline=None)
@given(_values)
def test_frames_are_written_and_read_as_json_does(value: Any) -> None:
    text = AGENT_MOD.json_dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert _same(AGENT_MOD.json_loads(text), json.loads(text))
    assert _same(AGENT_MOD.json_loads(f" \n{text}\t\r"), value)


@pytest.mark.parametrize(
    "bad", ["", " ", "{", '{"a":}', "[1,]", "{}x", "{} {}", "nul", '"\\x"', "\ufeff{}", "'a'"]
)
def test_what_json_refuses_the_agent_refuses_with_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError):
        json.loads(bad)
    with pytest.raises(ValueError):
        AGENT_MOD.json_loads(bad)


def test_an_unserialisable_value_is_a_type_error_as_in_json() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        AGENT_MOD.json_dumps({"a": object()})


def test_the_agent_starts_without_importing_json_or_re() -> None:
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('agent', {str(AGENT)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "before = set(sys.modules)\n"
        "spec.loader.exec_module(mod)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(eval(out))  # a printed list of module names
    assert not loaded & {"json", "re", "enum", "collections", "functools", "signal"}, loaded
