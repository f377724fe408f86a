"""Golden timeline renderings: the CLI lines and the run page's rows of a recorded run with setup
(one a heredoc) and verify (one passing, one failing), compared exactly with the stored files.

``tests/golden/setup-verify.events.json`` are the events of a real run (namespaces sandbox,
replayed turns). After an intended change of the rendering, rewrite the expected files with
``EPHEMERAL_UPDATE_GOLDEN=1 pytest tests/test_golden_timeline.py`` and review their diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ephemeral.api import view
from ephemeral.api.pages import env
from ephemeral.cli.output import out, print_event
from ephemeral.events import Event
from tests.goldenlog import assert_golden_log

GOLDEN = Path(__file__).resolve().parent / "golden"
EVENTS = [
    Event.model_validate(e) for e in json.loads((GOLDEN / "setup-verify.events.json").read_text())
]


def _cli() -> str:
    with out.capture() as captured:
        for n, ev in enumerate(EVENTS, 1):
            print_event(ev, n)
    return captured.get()


def _html() -> str:
    macro = env.get_template("_macros.html.j2").module.timeline_row  # type: ignore[attr-defined]
    t0 = EVENTS[0].at
    return "".join(str(macro(view.timeline_row(ev, t0))) for ev in EVENTS)


@pytest.mark.parametrize(
    ("render", "name"), [(_cli, "setup-verify.cli.txt"), (_html, "setup-verify.html")]
)
def test_setup_and_verify_render_like_the_golden_files(render, name: str) -> None:  # type: ignore[no-untyped-def]
    got = render()
    path = GOLDEN / name
    if os.environ.get("EPHEMERAL_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()


def test_the_golden_cli_lines_show_command_exit_duration_and_output() -> None:
    """What the golden file must hold, said once more in words: a reviewer updating it sees
    these fail if the setup/verify details are lost."""
    text = _cli()
    assert "Setup: $ cat > notes.txt <<'EOF' … (+3 lines)  → exit 0 · 11 ms" in text
    assert "       $ first line\n       $ second line\n       $ EOF\n" in text  # heredoc lines
    assert "Setup: $ echo ready  → exit 0 · 11 ms" in text and "out| ready" in text
    assert "Verify: $ grep -c line notes.txt  → exit 0 · 14 ms" in text and "out| 2" in text
    assert "Verify: $ test -f missing.txt" in text and "→ exit 1" in text
    assert "err| missing.txt was not written" in text
    html = _html()
    assert html.count('<code class="cmd">') == 5  # 2 setup + 1 shell + 2 verify
    assert "cat &gt; notes.txt &lt;&lt;&#39;EOF&#39;\nfirst line\nsecond line\nEOF</code>" in html
    assert '<span class="exit bad">exit 1</span>' in html


def test_the_golden_log_of_the_recorded_run_and_that_it_sees_a_lost_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tests/goldenlog.py pins what a log holds (types and payload keys; the runs, sessions and
    agent runs of tests/run, tests/sessions and tests/gateway each check theirs): a payload key
    that goes missing, or an event that moves, is a difference."""
    assert_golden_log("setup-verify", EVENTS)
    monkeypatch.delenv("EPHEMERAL_UPDATE_GOLDEN", raising=False)  # the changed logs: compared
    lost = [e.model_copy(update={"data": dict(e.data)}) for e in EVENTS]
    next(e for e in lost if e.type == "verify.executed").data.pop("exit_code")
    with pytest.raises(AssertionError, match="differs"):
        assert_golden_log("setup-verify", lost)
    moved = [EVENTS[1], EVENTS[0], *EVENTS[2:]]
    with pytest.raises(AssertionError, match="differs"):
        assert_golden_log("setup-verify", moved)
