"""One word per concept (docs/architecture.md, "Words"), checked on the source where a checker can.

A run's statuses and kinds are spelled once, in ``ephemeral/lifecycle.py`` (``RunStatus``,
``RunKind``). A comparison of a ``status`` or ``kind`` with a string literal that is one of
their values (``row.kind == "session"``, ``status in ("queued", "running")``) bypasses them:
a renamed or added status would leave it silently comparing against a word no row holds. Every
such comparison in the package (flows and tasks included) fails here, unless it compares a
status that is not a run's, listed in ``NOT_A_RUN`` with what it is.

Words that once named several concepts name one now, and an identifier (a name the code defines
or reads: function, class, attribute, variable, argument) that spells one of them is listed in
``SPELLED`` with what it means there: *hold* is a model call's worst case held inside its run's
reservation (the gateway's), *claim* a host's slot grant (``run.claimed``). The other holds
listed are plain English outside a run's words (a lock, bytes held back). A new identifier
spelled so fails here until it is listed, so a second concept under either word is seen, and
so are the renamed ones (``HostWorker._hold``, ``Runtime.holding`` and ``hold_leases``,
``ledger.hold``, ``claim_zdr_output``, ``ledger.claim_idempotency``, ``facts.claim``). ``Exit``
is a run's exit only (``ephemeral/engine/exits.py``); the CLI's is ``ExitCode``.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

from ephemeral.lifecycle import RunKind, RunStatus
from ephemeral.settings import REPO_ROOT

ROOTS = ("ephemeral", "flows", "tasks")
HOME = "ephemeral/lifecycle.py"  # where the words are defined
VOCABULARY = {"status": {s.value for s in RunStatus}, "kind": {k.value for k in RunKind}}
# Comparisons of statuses that are not a run's, by file and source text: what they compare.
NOT_A_RUN = {
    ("ephemeral/sandbox/qmp.py", "status in ('failed', 'cancelled')"): "QEMU's migration status",
    ("ephemeral/cli/prebuild.py", "o.status == 'failed'"): "a prebuild outcome's status",
    ("ephemeral/cli/prebuild.py", "out.status == 'failed'"): "a prebuild outcome's status",
    ("ephemeral/cli/prebuild.py", "out.status != 'failed'"): "a prebuild outcome's status",
    (
        "ephemeral/harbor/task_image.py",
        "outcome.status == 'failed'",
    ): "a prebuild outcome's status",
}


def package_files() -> list[tuple[str, Path]]:
    """Every Python file of the package once (``ephemeral/flows`` is a link to ``flows``)."""
    seen: dict[Path, str] = {}
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            seen.setdefault(path.resolve(), path.relative_to(REPO_ROOT).as_posix())
    return sorted((rel, path) for path, rel in seen.items())


def _field(node: ast.expr) -> str | None:
    """``status`` or ``kind`` when ``node`` reads one: ``x.status``, ``status``,
    ``x["status"]``, ``x.get("status")``, ``getattr(x, "status", None)``."""
    name: object = None
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = node.slice.value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        name = node.args[0].value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    ):
        name = node.args[1].value
    return name if name in VOCABULARY else None


def _strings(node: ast.expr) -> set[str]:
    """The string literals ``node`` is: one, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        }
    return set()


def literal_comparisons(source: str) -> list[tuple[int, str]]:
    """Each comparison of a run's status or kind with a literal of its vocabulary."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, b in itertools.pairwise(operands):
            for reader, other in ((a, b), (b, a)):
                field = _field(reader)
                if field is not None and _strings(other) & VOCABULARY[field]:
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_run_statuses_and_kinds_are_spelled_by_their_enums() -> None:
    wrong = [
        f"{rel}:{line}: {text}"
        for rel, path in package_files()
        if rel != HOME
        for line, text in literal_comparisons(path.read_text())
        if (rel, text) not in NOT_A_RUN
    ]
    assert not wrong, "use RunStatus / RunKind (ephemeral/lifecycle.py):\n" + "\n".join(wrong)


def test_every_exception_is_still_in_the_code() -> None:
    """An entry of NOT_A_RUN whose comparison is gone would excuse the next one written there."""
    texts = {
        (rel, text)
        for rel, path in package_files()
        for _, text in literal_comparisons(path.read_text())
    }
    assert set(NOT_A_RUN) <= texts, set(NOT_A_RUN) - texts


def test_the_checker_sees_each_spelling() -> None:
    bad = """
if row.kind == "session": pass
if "queued" != row.status: pass
if status in ("provisioning", "running"): pass
if obj["status"] == "succeeded": pass
if obj.get("kind") == "run": pass
if getattr(row, "kind", None) == "session": pass
"""
    assert [line for line, _ in literal_comparisons(bad)] == [2, 3, 4, 5, 6, 7]
    good = """
if row.kind == RunKind.SESSION: pass
if row.status in OPEN_STATUSES: pass
if row.status == "paused": pass
if env.kind == "dockerfile": pass
if row.name == "queued": pass
"""
    assert literal_comparisons(good) == []


# How each word is spelled in an identifier's words (``_hold``, ``hold_leases``, ``_Held``).
SPELLINGS = {
    "hold": {"hold", "holds", "held", "holding", "holder", "holders"},
    "claim": {"claim", "claims", "claimed", "claiming"},
}
# Every identifier spelling one, by file and name: what it means there.
SPELLED = {
    "hold": {
        ("ephemeral/broker/gateway.py", "hold"): "a model call's hold (Words: hold)",
        ("ephemeral/broker/egress.py", "held"): "a plain-HTTP response head kept until whole",
        ("ephemeral/broker/redact.py", "hold"): "how many bytes the redactor keeps back",
        ("ephemeral/broker/redact.py", "_held"): "the bytes the redactor keeps back",
        ("ephemeral/build_proxy.py", "_holder"): "the process keeping a network namespace",
        ("ephemeral/sandbox/build_sandbox.py", "HOLDER_SH"): "a process keeping a user namespace",
        ("ephemeral/sandbox/dockerfile/layers.py", "HOLDER_SH"): "the same, imported",
        ("ephemeral/sandbox/namespaces.py", "held"): "the fd locking a uid range",
        ("ephemeral/sandbox/build_area.py", "_hold"): "take a build area's file lock",
        ("ephemeral/flock.py", "held"): "a file lock held for a block",
        ("ephemeral/records/compaction.py", "held"): "the same (flock.held)",
        ("ephemeral/oci/store.py", "held"): "whether the store's file lock is held",
        ("ephemeral/harbor/backend.py", "_Held"): "a loop's shared runtime and its users",
        ("ephemeral/harbor/backend.py", "held"): "the same",
        ("ephemeral/harbor/environment.py", "_holding"): "whether a trial uses the shared runtime",
        ("ephemeral/inspect_provider/provider.py", "hold"): "one more user of a loop's backend",
    },
    "claim": {
        ("ephemeral/sessions/host.py", "_claiming"): "placed sessions being claimed here",
        ("ephemeral/sessions/placement.py", "_claimed"): "whether a host claimed the session",
    },
}


def identifiers(source: str) -> set[str]:
    """Every name ``source`` defines or reads."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rsplit(".", 1)[-1])
    return names


def spelled(source: str, word: str) -> set[str]:
    """The identifiers of ``source`` one of whose words (snake_case or CamelCase) is ``word``."""
    return {
        name
        for name in identifiers(source)
        if {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)} & SPELLINGS[word]
    }


def test_hold_and_claim_each_name_one_concept() -> None:
    wrong = [
        f"{rel}: {name} (spells {word!r})"
        for rel, path in package_files()
        for word in SPELLINGS
        for name in sorted(spelled(path.read_text(), word))
        if (rel, name) not in SPELLED[word]
    ]
    assert not wrong, "one word per concept (docs/architecture.md, Words):\n" + "\n".join(wrong)


def test_every_spelling_listed_is_still_in_the_code() -> None:
    """A listed identifier that is gone would excuse the next one of its name in that file."""
    found = {
        (rel, name)
        for rel, path in package_files()
        for word in SPELLINGS
        for name in spelled(path.read_text(), word)
    }
    listed = {key for keys in SPELLED.values() for key in keys}
    assert listed <= found, listed - found


def test_the_identifier_checker_sees_each_spelling() -> None:
    bad = """
class HostWorker:
    async def _hold(self, task_run): self._held[task_run.id] = task_run.name
runtime.holding = set()
await runtime.hold_leases(30)
await ledger.hold(conn, org_id=org, amount=1)
earlier = await ledger.claim_idempotency(conn, key=key)
value = await store.facts.claim("seal_key", mine)
def claim_zdr_output(self, row): pass
class _Held: pass
"""
    assert spelled(bad, "hold") == {"_hold", "_held", "holding", "hold_leases", "hold", "_Held"}
    assert spelled(bad, "claim") == {"claim_idempotency", "claim", "claim_zdr_output"}
    good = """
threshold = PLACEHOLDER_KEY
await runtime.renew_leases(30)
await ledger.reserve(conn, org_id=org, amount=1)
emit("run.claimed", {"host": host})
"""
    assert spelled(good, "hold") == set() and spelled(good, "claim") == set()


def test_exit_is_a_runs_exit_only() -> None:
    """``Exit`` is how a run ends (ephemeral/engine/exits.py); the CLI's exit status is
    ``ExitCode`` (ephemeral/cli/exit_codes.py), and typer's ``typer.Exit`` is typer's."""
    where = [
        rel
        for rel, path in package_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "Exit"
    ]
    assert where == ["ephemeral/engine/exits.py"]
