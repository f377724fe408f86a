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
