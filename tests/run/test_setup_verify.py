"""Images, setup and verify in whole runs: real sandboxes, replayed turns, real SQLite ledger.

The runs name the shipped ``python-dev`` image (built by ``make setup``): its env reaches the
agent's commands, setup runs before the first turn, verify after the last one, in the same
sandbox, and an agent that used all its time is still graded.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.agent.loop import AgentRun
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.records import Records
from ephemeral.runview import run_object
from ephemeral.sandbox import images
from ephemeral.settings import REPO_ROOT, Settings
from tests import runlevel
from tests.drivers import built_image, unavailable
from tests.patience import PATIENCE
from tests.run.conftest import turn
from tests.run.test_agent_run import assert_settled, run_to_end, types

pytestmark = [pytest.mark.sandbox]
ISOLATION = "namespaces"


@pytest.fixture
def python_dev(run_settings: Settings) -> images.ImageConfig:
    built = built_image(run_settings, "python-dev")
    return built


def request(model: str, **kw: object) -> RunRequest:
    return RunRequest.model_validate(
        {
            "prompt": "fix it",
            "model": model,
            "image": "python-dev",
            "isolation": ISOLATION,
            "timeout_seconds": 60,
            "max_cost_micros": 40_000,
            **kw,
        }
    )


async def test_setup_agent_and_verify_share_one_python_dev_sandbox(
    runtime: Runtime, make_cassette: Callable[..., str], python_dev: images.ImageConfig
) -> None:
    model = make_cassette(
        "sv-ok",
        [
            turn("cat made-by-setup.txt; echo pip_no_index=$PIP_NO_INDEX; python3 -m pytest -q"),
            turn(final="Fixed."),
        ],
    )
    files = [
        {"path": "test_ok.py", "content_base64": "ZGVmIHRlc3RfaXQoKToKICAgIGFzc2VydCBUcnVlCg=="}
    ]
    org = await runtime.local_org()
    row, _ = await runtime.admit(
        org,
        request(
            model,
            files=files,
            setup=["echo from-setup > made-by-setup.txt", "echo secret-setup-output"],
            verify=["python3 -m pytest -q", "test -f made-by-setup.txt"],
        ),
    )
    agent = await runtime.engine.build(row.id)
    row = await runtime.engine.handle(agent.run_id).drive(agent)
    events = await runtime.store.events.list(row.id)
    assert row.status == "succeeded", row.termination_detail
    t = types(events)
    assert t[:3] == ["run.queued", "sandbox.ready", "worker.started"]
    assert t.count("setup.executed") == 2 and t.count("verify.executed") == 2
    # setup before the first model call, verify after the last one, both before teardown
    assert t.index("setup.executed") < t.index("model.called")
    last_model = len(t) - 1 - t[::-1].index("model.called")
    assert last_model < t.index("verify.executed") < t.index("sandbox.destroyed")
    ready = next(e.data for e in events if e.type == "sandbox.ready")
    assert ready["image"] == "python-dev" and ready["image_hash"] == python_dev.hash
    shell = next(e.data for e in events if e.type == "shell.executed")
    assert shell["exit_code"] == 0, shell
    assert "from-setup" in shell["stdout"] and "pip_no_index=1" in shell["stdout"]
    assert "1 passed" in shell["stdout"]
    verify = [e.data for e in events if e.type == "verify.executed"]
    assert [v["exit_code"] for v in verify] == [0, 0]
    assert "1 passed" in verify[0]["stdout"]
    obj = run_object(row)
    assert obj["image"] == "python-dev" and obj["image_hash"] == python_dev.hash
    assert obj["policy"]["verify"] == ["python3 -m pytest -q", "test -f made-by-setup.txt"]
    assert_settled(row, events)
    recs = Records(runtime.settings.records_dir)
    _, rows = recs.query(f"select image, image_hash, verify from runs where run_id = '{row.id}'")
    [(image, image_hash, verify_json)] = rows
    assert (image, image_hash) == ("python-dev", python_dev.hash)
    assert [v["exit_code"] for v in json.loads(verify_json)] == [0, 0]
    # the model never saw setup's output: it is in no message of the conversation
    assert agent.messages and "secret-setup-output" not in str(agent.messages)
    assert "from-setup" in str(agent.messages)  # what the agent's own command printed


async def test_failing_setup_ends_the_run_setup_failed_before_any_model_call(
    runtime: Runtime, make_cassette: Callable[..., str], python_dev: images.ImageConfig
) -> None:
    model = make_cassette("sv-setup-fails", [turn(final="never asked")])
    row, events = await run_to_end(
        runtime,
        request(model, setup=["true", "echo broken >&2; exit 3"], verify=["true"]),
    )
    assert row.status == "failed"
    assert row.termination_reason == "setup_failed"
    assert row.termination_detail == "setup[1] exited 3: broken"
    t = types(events)
    assert "model.called" not in t and "verify.executed" not in t
    assert [e.data["exit_code"] for e in events if e.type == "setup.executed"] == [0, 3]
    assert row.breakdown["compute_micros"] > 0  # setup ran in the sandbox: compute is charged
    assert_settled(row, events)


async def test_an_agent_that_used_all_its_time_is_still_verified_after_kill_all(
    runtime: Runtime, make_cassette: Callable[..., str], python_dev: images.ImageConfig
) -> None:
    model = make_cassette(
        "sv-slow",
        [turn("(sleep 300 &) ; echo started > marker; sleep 300"), turn(final="never")],
    )
    row, events = await run_to_end(
        runtime,
        request(
            model,
            timeout_seconds=8,
            verify_timeout_seconds=4,
            # kill_all ran first: none of the agent's sleeps is left when the grader looks
            verify=["cat marker", "! pgrep -x sleep"],
        ),
    )
    assert row.status == "timed_out", row.termination_detail
    assert "4 s of it kept for verify" in (row.termination_detail or "")
    verify = [e.data for e in events if e.type == "verify.executed"]
    assert [v["exit_code"] for v in verify] == [0, 0], verify
    assert verify[0]["stdout"].strip() == "started"
    assert_settled(row, events)


async def test_an_image_this_server_has_not_built_is_refused_naming_image(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    org = await runtime.local_org()
    bad = RunRequest(prompt="x", model=make_cassette("sv-none", [turn(final="x")]), image="nope")
    with pytest.raises(errors.InvalidRequest) as exc:
        await runtime.admit(org, bad)
    assert exc.value.errors and exc.value.errors[0]["field"] == "image"
    assert "'nope' is not built" in exc.value.detail and "default" in exc.value.detail


async def test_the_warm_pool_serves_only_its_own_image(
    run_settings: Settings, make_cassette: Callable[..., str], python_dev: images.ImageConfig
) -> None:
    model = make_cassette(
        "sv-pool", [turn("cat /etc/os-release >/dev/null; which git || true"), turn(final="done")]
    )
    settings = run_settings.model_copy(update={"pool_size": 1})
    async with runlevel.started(settings, check=True, warm_pool=True) as runtime:
        [pool] = runtime.sandboxes.pools.values()
        await pool.wait_ready(PATIENCE)
        got = {}
        for image in ("python-dev", None):
            row, events = await run_to_end(
                runtime, request(model, image=image, isolation="auto", verify=[])
            )
            assert row.status == "succeeded", row.termination_detail
            ready = next(e.data for e in events if e.type == "sandbox.ready")
            shell = next(e.data for e in events if e.type == "shell.executed")
            got[image] = (ready["image"], shell["stdout"].strip())
        assert got["python-dev"] == ("python-dev", "/usr/bin/git")
        assert got[None] == ("default", "")  # the pooled default image has no git


async def test_an_images_env_and_workdir_apply_to_every_command_of_a_run(
    tmp_path: Path, cassettes: Path, make_cassette: Callable[..., str]
) -> None:
    """A derived image (built here on default's cached layer) with env and workdir: setup, the
    agent's shell and verify all run in scratch/<workdir> with that environment. Its name is
    this run's own: the image cache is shared, and another checkout's suite running this test
    at the same time would otherwise boot, and remove, the same build."""
    defs = tmp_path / "images"
    shutil.copytree(REPO_ROOT / "sandbox_images" / "default", defs / "default")
    wd = f"wd-{uuid.uuid4().hex[:12]}"
    (defs / wd).mkdir()
    (defs / wd / "image.yaml").write_text(
        f"name: {wd}\nbase: default\nenv: {{WD_MARK: here}}\nworkdir: work/dir\n"
    )
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, images_dir=defs, use_prefect=False
    )
    if images.built_rootfs(settings, "default") is None:
        unavailable("image default not built (make setup)")
    await images.ensure_image(settings, wd)
    model = make_cassette("sv-wd", [turn("pwd; echo $WD_MARK; cat from-setup"), turn(final="ok")])
    async with runlevel.started(settings, check=True) as runtime:
        row, events = await run_to_end(
            runtime,
            request(
                model,
                image=wd,
                setup=["echo set > from-setup"],
                verify=['test "$(basename "$PWD")" = dir && test "$WD_MARK" = here'],
            ),
        )
        images.remove_images(settings, wd)
    assert row.status == "succeeded", row.termination_detail
    shell = next(e.data for e in events if e.type == "shell.executed")
    pwd, mark, setup_out = shell["stdout"].splitlines()
    assert pwd.startswith("/tmp/ephemeral-run-") and pwd.endswith("/scratch/work/dir")
    assert (mark, setup_out) == ("here", "set")
    assert [e.data["exit_code"] for e in events if e.type == "verify.executed"] == [0]


async def test_a_cancel_during_verify_still_destroys_the_sandbox_and_settles(
    runtime: Runtime,
    make_cassette: Callable[..., str],
    python_dev: images.ImageConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The moment verify begins, seen from inside (an event, not a guess at the time it takes
    # under load): the guest serves one exec at a time, so the test cannot ask the sandbox.
    entered = asyncio.Event()
    real_verify = AgentRun.verify

    async def verify(self: AgentRun) -> None:
        entered.set()
        await real_verify(self)

    monkeypatch.setattr(AgentRun, "verify", verify)
    model = make_cassette("sv-cancel", [turn(final="done")])
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, request(model, verify=["sleep 1000"]))
    task = runtime.launch(row.id)
    await asyncio.wait_for(entered.wait(), 120)
    await asyncio.sleep(0.5)  # margin only: a cancel anywhere inside verify is "during verify"
    cancelled = await runtime.cancel(row.id)
    assert cancelled.status == "cancelled"
    assert cancelled.termination_detail == "cancelled by request (during verify)"
    with pytest.raises(asyncio.CancelledError):
        await task
    events = await runtime.store.events.list(row.id)
    assert_settled(await runtime.store.runs.get(row.id), events)
    assert "sandbox.destroyed" in types(events)
