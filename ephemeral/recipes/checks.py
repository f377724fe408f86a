"""Checks: what a recipe expects of each of its runs, and their verdicts.

A check is a one-key mapping in a recipe's ``checks:`` list (DESIGN §5)::

    - output_contains: "Could not resolve host"
    - output_matches: "\\b2 3 5 7\\b"          # Python regex, re.MULTILINE
    - shell: {command_matches: "curl", exit_code_not: 0}   # or exit_code: N; stdout_contains: "…"
    - max_cost_micros: 10000
    - max_duration_seconds: 60
    - status: succeeded
    - verify: {exit_code: 0}                     # the run's verify commands (see below)
    - output_json_schema: {type: object, required: [answer]}   # output (or its ```json block)

Each variant judges a finished run from the run object (DESIGN §3) and its events (DESIGN §4)
and says why, naming what it saw, so a failing eval can be read without opening the run.
A malformed or incomplete run never raises here: the check fails with the reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from ephemeral.lifecycle import TERMINAL_STATUSES, RunStatus
from ephemeral.money.amounts import usd

MAX_PATTERN_CHARS = 1_000
_EXCERPT = 60

Run = Mapping[str, Any]  # the run object of DESIGN §3
Events = Sequence[Mapping[str, Any]]  # its events, DESIGN §4


def _terminal(status: RunStatus) -> RunStatus:
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"must be a status a run ends in: {', '.join(sorted(TERMINAL_STATUSES))}")
    return status


# A recipe is YAML, so the status arrives as a string: the enum is matched by value.
TerminalStatus = Annotated[RunStatus, Field(strict=False), AfterValidator(_terminal)]


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    check: str
    passed: bool
    reason: str


def _short(text: str, limit: int = _EXCERPT) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None


def _regex(v: str) -> str:
    if len(v) > MAX_PATTERN_CHARS:
        raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
    _compile(v)
    return v


def _output(run: Mapping[str, Any]) -> str | None:
    out = run.get("output")
    return out if isinstance(out, str) else None


class _Check(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def label(self) -> str:
        raise NotImplementedError

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        raise NotImplementedError

    def evaluate(self, run: Run, events: Events) -> CheckResult:
        passed, reason = self.judge(run, events)
        return CheckResult(check=self.label(), passed=passed, reason=reason)


class OutputContains(_Check):
    output_contains: str = Field(min_length=1, max_length=10_000)

    def label(self) -> str:
        return f"output_contains: {_short(self.output_contains)}"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        out = _output(run)
        if out is None:
            return False, "the run has no output"
        at = out.find(self.output_contains)
        if at < 0:
            return False, f"not in the output ({len(out)} chars, starts {_short(out)!r})"
        return True, f"found at offset {at}"


class OutputMatches(_Check):
    output_matches: str = Field(min_length=1)

    @field_validator("output_matches")
    @classmethod
    def _valid(cls, v: str) -> str:
        return _regex(v)

    def label(self) -> str:
        return f"output_matches: /{_short(self.output_matches)}/"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        out = _output(run)
        if out is None:
            return False, "the run has no output"
        m = _compile(self.output_matches).search(out)
        if m is None:
            return False, f"no match in the output ({len(out)} chars, starts {_short(out)!r})"
        return True, f"matched {_short(m.group(0))!r} at offset {m.start()}"


class ShellCondition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    command_matches: str = Field(min_length=1)
    exit_code: int | None = Field(default=None, ge=0, le=255)
    exit_code_not: int | None = Field(default=None, ge=0, le=255)
    stdout_contains: str | None = Field(default=None, min_length=1)

    @field_validator("command_matches")
    @classmethod
    def _valid(cls, v: str) -> str:
        return _regex(v)

    @model_validator(mode="after")
    def _one_exit_condition(self) -> ShellCondition:
        if self.exit_code is not None and self.exit_code_not is not None:
            raise ValueError("give exit_code or exit_code_not, not both")
        return self

    def wanted(self) -> str:
        if self.exit_code is not None:
            return f"{self.exit_code}"
        if self.exit_code_not is not None:
            return f"not {self.exit_code_not}"
        return "any"

    def exit_ok(self, code: object) -> bool:
        if self.exit_code is None and self.exit_code_not is None:
            return True
        if not isinstance(code, int) or isinstance(code, bool):
            return False  # no exit code (killed at its deadline) satisfies no exit condition
        if self.exit_code is not None:
            return code == self.exit_code
        return code != self.exit_code_not


class ShellCheck(_Check):
    shell: ShellCondition

    def label(self) -> str:
        parts = [f"command_matches /{_short(self.shell.command_matches, 40)}/"]
        if self.shell.exit_code is not None or self.shell.exit_code_not is not None:
            parts.append(f"exit code {self.shell.wanted()}")
        if self.shell.stdout_contains is not None:
            parts.append(f"stdout_contains {_short(self.shell.stdout_contains, 30)!r}")
        return "shell: " + ", ".join(parts)

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        pattern = _compile(self.shell.command_matches)
        shells = [
            data
            for e in events
            if e.get("type") == "shell.executed" and isinstance(data := e.get("data"), Mapping)
        ]
        if not shells:
            return False, "no shell command was run"
        commands = [d for d in shells if isinstance(d.get("command"), str)]
        if not commands:
            return False, "shell commands were not recorded (zero data retention)"
        matched = [d for d in commands if pattern.search(d["command"])]
        if not matched:
            return False, (
                f"no shell command matched /{_short(self.shell.command_matches, 40)}/ "
                f"(ran {len(commands)}, last {_short(commands[-1]['command'])!r})"
            )
        for d in matched:
            if self.shell.exit_ok(d.get("exit_code")) and self._stdout_ok(d):
                return True, f"{_short(d['command'])!r} exited {d.get('exit_code')}"
        first = matched[0]
        if not self.shell.exit_ok(first.get("exit_code")):
            return False, (
                f"{_short(first['command'])!r}: exit code {first.get('exit_code')}, "
                f"wanted {self.shell.wanted()}"
            )
        stdout = first.get("stdout")
        seen = _short(stdout) if isinstance(stdout, str) else "nothing recorded"
        return False, (
            f"{_short(first['command'])!r}: stdout lacks "
            f"{_short(self.shell.stdout_contains or '', 30)!r} (saw {seen!r})"
        )

    def _stdout_ok(self, data: Mapping[str, Any]) -> bool:
        want = self.shell.stdout_contains
        stdout = data.get("stdout")
        return want is None or (isinstance(stdout, str) and want in stdout)


class VerifyCondition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    command_matches: str | None = Field(default=None, min_length=1)
    exit_code: int | None = Field(default=None, ge=0, le=255)
    stdout_contains: str | None = Field(default=None, min_length=1)

    @field_validator("command_matches")
    @classmethod
    def _valid(cls, v: str | None) -> str | None:
        return None if v is None else _regex(v)


class VerifyCheck(_Check):
    """The run's verify commands (``verify.executed``): every one that matches must have the
    exit code and the stdout wanted (each condition optional). A grader that did not run, or
    was skipped, fails the check."""

    verify: VerifyCondition

    def label(self) -> str:
        parts = []
        if self.verify.command_matches is not None:
            parts.append(f"command_matches /{_short(self.verify.command_matches, 40)}/")
        if self.verify.exit_code is not None:
            parts.append(f"exit code {self.verify.exit_code}")
        if self.verify.stdout_contains is not None:
            parts.append(f"stdout_contains {_short(self.verify.stdout_contains, 30)!r}")
        return "verify: " + (", ".join(parts) or "ran")

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        results = [
            data
            for e in events
            if e.get("type") == "verify.executed" and isinstance(data := e.get("data"), Mapping)
        ]
        if not results:
            return False, "no verify command ran"
        want = self.verify
        if want.command_matches is not None:
            if not all(isinstance(d.get("command"), str) for d in results):
                return False, "verify commands were not recorded (zero data retention)"
            pattern = _compile(want.command_matches)
            results = [d for d in results if pattern.search(d["command"])]
            if not results:
                return False, f"no verify command matched /{_short(want.command_matches, 40)}/"
        for d in results:
            name = _short(d["command"]) if isinstance(d.get("command"), str) else "verify"
            if d.get("skipped"):
                return False, f"{name!r} did not run: {d['skipped']}"
            code = d.get("exit_code")
            if want.exit_code is not None and (
                not isinstance(code, int) or isinstance(code, bool) or code != want.exit_code
            ):
                seen = "killed at its deadline" if d.get("timed_out") else f"exit code {code}"
                return False, f"{name!r}: {seen}, wanted {want.exit_code}"
            if want.stdout_contains is not None:
                stdout = d.get("stdout")
                if not isinstance(stdout, str):
                    return False, f"{name!r}: stdout not recorded (zero data retention)"
                if want.stdout_contains not in stdout:
                    return False, (
                        f"{name!r}: stdout lacks {_short(want.stdout_contains, 30)!r} "
                        f"(saw {_short(stdout)!r})"
                    )
        ran = len(results)
        return True, f"{ran} verify command{'s' if ran != 1 else ''} as wanted"


_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n```", re.DOTALL)


def _json_of(text: str) -> tuple[Any, str] | None:
    """The output as JSON: the whole of it, or else its first fenced code block."""
    try:
        return json.loads(text), "the output"
    except ValueError:
        pass
    m = _FENCE.search(text)
    if m is not None:
        try:
            return json.loads(m.group(1)), "the output's first code block"
        except ValueError:
            return None
    return None


class OutputJsonSchema(_Check):
    """The output (or its first fenced code block) is JSON valid against a JSON Schema."""

    output_json_schema: dict[str, Any]

    @field_validator("output_json_schema")
    @classmethod
    def _valid(cls, v: dict[str, Any]) -> dict[str, Any]:
        import jsonschema

        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return v

    def label(self) -> str:
        title = self.output_json_schema.get("title")
        if isinstance(title, str):
            return f"output_json_schema: {_short(title, 40)}"
        digest = hashlib.sha256(
            json.dumps(self.output_json_schema, sort_keys=True).encode()
        ).hexdigest()
        return f"output_json_schema: {digest[:8]}"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        import jsonschema

        out = _output(run)
        if out is None:
            return False, "the run has no output"
        found = _json_of(out.strip())
        if found is None:
            return False, f"the output is not JSON ({len(out)} chars, starts {_short(out)!r})"
        value, where = found
        validator = jsonschema.validators.validator_for(self.output_json_schema)(
            self.output_json_schema
        )
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            at = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return False, f"{where} fails the schema at {at}: {_short(error.message, 120)}"
        return True, f"{where} is valid against the schema"


class MaxCost(_Check):
    max_cost_micros: int = Field(ge=0)

    def label(self) -> str:
        return f"max_cost_micros: {self.max_cost_micros}"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        cost = run.get("cost")
        charged = cost.get("charged_micros") if isinstance(cost, Mapping) else None
        if not isinstance(charged, int):
            return False, "the run has no charged cost (not settled?)"
        verb = "≤" if charged <= self.max_cost_micros else ">"
        return charged <= self.max_cost_micros, (
            f"charged {charged} micros ({usd(charged)}) {verb} {self.max_cost_micros}"
        )


def _when(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


class MaxDuration(_Check):
    max_duration_seconds: float = Field(gt=0)

    def label(self) -> str:
        return f"max_duration_seconds: {self.max_duration_seconds:g}"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        start, end = _when(run.get("started_at")), _when(run.get("ended_at"))
        if start is None:
            return False, "the run never started"
        if end is None:
            return False, "the run has not ended"
        took = (end - start).total_seconds()
        verb = "≤" if took <= self.max_duration_seconds else ">"
        return took <= self.max_duration_seconds, (
            f"took {took:.3f} s {verb} {self.max_duration_seconds:g} s"
        )


class StatusIs(_Check):
    status: TerminalStatus

    def label(self) -> str:
        return f"status: {self.status}"

    def judge(self, run: Run, events: Events) -> tuple[bool, str]:
        seen = run.get("status")
        term = run.get("termination")
        why = term.get("reason") if isinstance(term, Mapping) else None
        detail = f" ({why})" if why else ""
        if seen == self.status:
            return True, f"status {seen}{detail}"
        return False, f"status {seen}{detail}, wanted {self.status}"


CHECK_KINDS: dict[str, type[_Check]] = {
    "output_contains": OutputContains,
    "output_matches": OutputMatches,
    "shell": ShellCheck,
    "max_cost_micros": MaxCost,
    "max_duration_seconds": MaxDuration,
    "status": StatusIs,
    "verify": VerifyCheck,
    "output_json_schema": OutputJsonSchema,
}


def _kind(value: Any) -> str | None:
    if isinstance(value, Mapping):
        key = next(iter(value)) if len(value) == 1 else None
        return key if key in CHECK_KINDS else None
    for kind, cls in CHECK_KINDS.items():
        if type(value) is cls:
            return kind
    return None


Check = Annotated[
    Annotated[OutputContains, Tag("output_contains")]
    | Annotated[OutputMatches, Tag("output_matches")]
    | Annotated[ShellCheck, Tag("shell")]
    | Annotated[MaxCost, Tag("max_cost_micros")]
    | Annotated[MaxDuration, Tag("max_duration_seconds")]
    | Annotated[StatusIs, Tag("status")]
    | Annotated[VerifyCheck, Tag("verify")]
    | Annotated[OutputJsonSchema, Tag("output_json_schema")],
    Discriminator(
        _kind,
        custom_error_type="check_kind",
        custom_error_message="a check is a mapping with exactly one key, one of: "
        + ", ".join(CHECK_KINDS),
        custom_error_context={},
    ),
]


def evaluate(checks: Sequence[_Check], run: Run, events: Events) -> list[CheckResult]:
    """One verdict per check, in the order given."""
    return [check.evaluate(run, events) for check in checks]
