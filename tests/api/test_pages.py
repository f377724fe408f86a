"""The pages over the real app: sign-in, the run page, its live stream, samples, playground."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from ephemeral.api import view
from ephemeral.api.pages import PAGE_COOKIE
from ephemeral.api.samples import load_sample
from ephemeral.engine.runtime import Runtime
from ephemeral.evals.execute import execute_planned
from ephemeral.recipes.recipe import expand, load_recipe
from ephemeral.settings import Settings
from tests.api.conftest import SAMPLE_BODY, Member, new_member

PRODUCT_PAGE_REQUEST = {
    "prompt": "This is a sandbox test. Do these steps with the shell and report the real output, "
    "never what you expect. 1) Write a small script that prints the first 15 prime numbers, run "
    "it and show the output. 2) Run `whoami` and `pwd`. 3) Try to reach the internet with "
    "`curl -sS -m 8 https://example.com` (and, if curl is missing, python3 with urllib) and "
    "report the exact error. 4) Write a file named /tmp/proof.txt and list it. Reply in Markdown, "
    "at most 120 words: one line per step with the result, then one sentence saying whether the "
    "network call succeeded.",
    "web": False,
    "shell": True,
    "timeout_seconds": 120,
    "max_cost_micros": 40000,
}


def signed_in(http: httpx.AsyncClient, member: Member) -> httpx.AsyncClient:
    http.cookies.set(PAGE_COOKIE, member.key)
    return http


async def test_login_sets_an_httponly_strict_cookie(
    http: httpx.AsyncClient, member: Member
) -> None:
    r = await http.post("/login", data={"api_key": "eph_wrong", "next": "/"})
    assert r.status_code == 401
    assert "unknown API key" in r.text or "malformed" in r.text
    r = await http.post("/login", data={"api_key": member.key, "next": "//evil.example/x"})
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    cross = await http.post(
        "/login", data={"api_key": member.key}, headers={"Origin": "http://evil.example"}
    )
    assert cross.status_code == 403


async def test_run_page_needs_sign_in_and_hides_other_orgs(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    r = await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)
    rid = r.json()["id"]
    await runtime.wait(rid, 60)
    anon = await http.get(f"/runs/{rid}")
    assert anon.status_code == 303 and anon.headers["location"].startswith("/login?next=")
    other = await new_member(runtime, "globex")
    http.cookies.set(PAGE_COOKIE, other.key)
    assert (await http.get(f"/runs/{rid}")).status_code == 404


@pytest.mark.sandbox
async def test_run_page_shows_timeline_permissions_output_and_money(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    rid = (await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)).json()["id"]
    await runtime.wait(rid, 60)
    page = await signed_in(http, member).get(f"/runs/{rid}")
    assert page.status_code == 200
    html = page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'data-live="0"' in html
    assert "Succeeded" in html and rid in html
    assert "$ echo hello; whoami" in html and "worker" in html  # command and its output
    assert "<h2>Done</h2>" in html  # the output as Markdown
    assert "<script>alert(1)</script>" not in html  # model-written HTML stays text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert re.search(r"Worker disposed: \$[0-9.]+ charged, \$[0-9.]+ refunded \(model \$", html)
    for setting in (
        "Connections",
        "Web",
        "Shell",
        "Files",
        "Zero data retention",
        "Budget",
        "Time limit",
    ):
        assert f"<td>{setting}</td>" in html
    assert "on, inside a sealed machine" in html and "$0.04, hard cap" in html
    assert "60 seconds" in html


@pytest.mark.sandbox
async def test_live_stream_sends_rendered_rows_until_settled(
    http: httpx.AsyncClient, member: Member
) -> None:
    rid = (await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)).json()["id"]
    r = await signed_in(http, member).get(f"/runs/{rid}/live", params={"after": 1})
    assert r.status_code == 200
    messages = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert messages[0]["seq"] == 2 and messages[-1]["type"] == "run.settled"
    assert all(m["html"].startswith('<li class="ev') for m in messages)
    assert "Worker disposed" in messages[-1]["summary_html"]
    shell = next(m for m in messages if m["type"] == "shell.executed")
    assert "echo hello; whoami" in shell["html"]


async def test_sample_page_replays_the_recorded_run(http: httpx.AsyncClient) -> None:
    r = await http.get("/samples/sandbox-proof")
    assert r.status_code == 200
    html = r.text
    sample = load_sample(Settings.load(), "sandbox-proof")
    assert html.count('<li class="ev') == len(sample.events)
    assert "$ pwd; whoami" in html
    assert "curl -sS -m 8 https://example.com" in html
    assert "Could not resolve host" in html
    assert "/tmp/proof.txt" in html
    assert 'href="/playground?sample=sandbox-proof"' in html
    assert "curl -X POST $EPHEMERAL_URL/v1/runs" in html
    shown = re.search(r'<pre class="code" id="request-json">(.*?)</pre>', html, re.S)
    assert shown is not None
    import html as html_lib

    assert json.loads(html_lib.unescape(shown.group(1))) == PRODUCT_PAGE_REQUEST
    assert (await http.get("/samples/no-such")).status_code == 404
    assert (await http.get("/samples/..%2Fsecrets")).status_code == 404


def test_shipped_sample_is_a_real_successful_run() -> None:
    sample = load_sample(Settings.load(), "sandbox-proof")
    types = [e.type for e in sample.events]
    assert types[0] == "run.queued" and types[-1] == "run.settled"
    assert "run.succeeded" in types and types.count("shell.executed") == 4
    ready = next(e for e in sample.events if e.type == "sandbox.ready")
    assert ready.data["isolation"] in ("gvisor", "microvm-kvm", "namespaces", "microvm-tcg")
    shells = [e for e in sample.events if e.type == "shell.executed"]
    curl = next(e for e in shells if "curl" in e.data["command"])
    assert curl.data["exit_code"] != 0 and "Could not resolve host" in curl.data["stderr"]
    assert sample.prompt == PRODUCT_PAGE_REQUEST["prompt"]


async def test_playground_prefills_from_the_sample(http: httpx.AsyncClient) -> None:
    r = await http.get("/playground", params={"sample": "sandbox-proof"})
    assert r.status_code == 200
    assert "This is a sandbox test." in r.text
    assert 'name="budget" inputmode="decimal" value="0.04"' in r.text
    assert 'name="timeout" min="1" max="3600" value="120"' in r.text
    assert 'name="api_key"' in r.text  # not signed in: asks for a key


async def test_playground_names_bad_fields(http: httpx.AsyncClient, member: Member) -> None:
    r = await signed_in(http, member).post(
        "/playground",
        data={"prompt": "", "shell": "on", "timeout": "0", "budget": "abc", "token": "t1"},
    )
    assert r.status_code == 422
    assert 'data-field="budget"' in r.text
    r = await http.post(
        "/playground",
        data={"prompt": "hi", "shell": "on", "timeout": "9999", "budget": "0.04", "token": "t2"},
    )
    assert r.status_code == 422 and 'data-field="timeout"' in r.text


@pytest.mark.sandbox
async def test_playground_starts_a_run_once_per_form(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    form = {
        "prompt": "hello",
        "shell": "on",
        "timeout": "60",
        "budget": "0.04",
        "token": "form-token-1",
        "api_key": member.key,
    }
    r = await http.post("/playground", data=form)
    assert r.status_code == 303
    rid = r.headers["location"].removeprefix("/runs/")
    assert PAGE_COOKIE in r.headers["set-cookie"]
    again = await http.post("/playground", data=form)  # double submit: the same run
    assert again.headers["location"] == f"/runs/{rid}"
    row = await runtime.wait(rid, 60)
    assert row.status == "succeeded" and row.policy["timeout_seconds"] == 60
    assert row.org_id == member.org_id


@pytest.mark.sandbox
async def test_index_lists_the_members_runs_and_logout_forgets_the_key(
    http: httpx.AsyncClient, member: Member, runtime: Runtime
) -> None:
    anon = await http.get("/")
    assert anon.status_code == 200 and "Recent runs" not in anon.text
    r = await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)
    rid = r.json()["id"]
    page = await signed_in(http, member).get("/")
    assert "Recent runs" in page.text and f'href="/runs/{rid}"' in page.text
    out = await http.post("/logout")
    assert out.status_code == 303 and PAGE_COOKIE in out.headers["set-cookie"]
    assert "Max-Age=0" in out.headers["set-cookie"] or "expires" in out.headers["set-cookie"]
    await runtime.wait(rid)  # the run it started ends here, not in the fixture's close


@pytest.mark.sandbox
async def test_live_stream_ignores_a_bad_t0_and_needs_sign_in(
    http: httpx.AsyncClient, member: Member
) -> None:
    rid = (await http.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)).json()["id"]
    anon = await http.get(f"/runs/{rid}/live")
    assert anon.status_code == 401
    r = await signed_in(http, member).get(f"/runs/{rid}/live", params={"t0": "yesterday"})
    assert r.status_code == 200 and "run.settled" in r.text


@pytest.mark.sandbox
async def test_run_page_shows_the_grading_check_verdicts_and_verify(
    http: httpx.AsyncClient, member: Member, runtime: Runtime, tmp_path: Path
) -> None:
    """A run judged by its recipe: its page says PASS/FAIL per check with the reason, the
    verify result, and each verify command as a timeline step with its exit code and output."""
    recipe_file = tmp_path / "graded.yaml"
    recipe_file.write_text(
        "name: graded\nmodel: replay/api-quick\nprompt: say hello\n"
        "policy: {shell: true, timeout_seconds: 60, max_cost_micros: 40000}\n"
        "verify:\n"
        "  - echo graded-ok\n"
        "  - |\n"
        "    cat <<'EOF' >&2\n"
        "    no answer.txt\n"
        "    EOF\n"
        "    exit 3\n"
        "checks:\n"
        "  - status: succeeded\n"
        "  - output_contains: Done\n"
        "  - verify: {exit_code: 0}\n"
    )
    recipe = load_recipe(recipe_file)
    [planned] = expand(recipe, default_model=None)
    result = await execute_planned(runtime, member.org_id, planned, recipe, "suite_test")
    assert result.run_id is not None and result.status == "succeeded", result.detail
    page = await signed_in(http, member).get(f"/runs/{result.run_id}")
    html = page.text
    grading = html[
        html.index('<section id="grading">') : html.index("</section>", html.index('id="grading"'))
    ]
    assert 'id="verify-result" data-passed="1" data-count="2"' in grading
    assert ">FAIL</span>\n      1 of 2 command(s) exited 0" in grading
    assert "Checks: 2 of 3 passed." in grading
    rows = re.findall(
        r'<tr data-passed="(\d)">.*?>(PASS|FAIL)<.*?<code>(.*?)</code></td><td>(.*?)</td>', grading
    )
    assert [(r[1], r[2]) for r in rows] == [
        ("PASS", "status: succeeded"),
        ("PASS", "output_contains: Done"),
        ("FAIL", "verify: exit code 0"),
    ], rows
    assert rows[2][3].endswith("exit code 3, wanted 0")  # the failing check says why
    assert html.count('data-type="verify.executed"') == 2
    assert (
        '<code class="cmd">$ cat &lt;&lt;&#39;EOF&#39; &gt;&amp;2\nno answer.txt\nEOF\nexit 3'
        in html
    )
    assert '<span class="exit bad">exit 3</span>' in html and "no answer.txt\n</pre>" in html


def test_the_sample_curl_makes_its_key_without_uuidgen() -> None:
    """uuidgen is not installed on a fresh Debian: the curl then sent no Idempotency-Key at all.
    The served command makes the key with python3, and that command really prints a UUID."""
    assert "uuidgen" not in view.CURL
    made = re.search(r'"Idempotency-Key: (\$\(.*\))"', view.CURL)
    assert made is not None, view.CURL
    printed = subprocess.run(
        ["sh", "-c", f"echo {made.group(1)}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert str(uuid.UUID(printed)) == printed
