"""The product page's sample request: the one prompt ``replay/sandbox-proof`` answers."""

from __future__ import annotations

from typing import Final

SAMPLE_MODEL: Final = "replay/sandbox-proof"
# The "prompt" of request.json on the product page, verbatim (recipes/sandbox-proof.yaml renders
# it; recipes/cassettes/sandbox-proof.json records it).
SAMPLE_PROMPT: Final = (
    "This is a sandbox test. Do these steps with the shell and report the real output, never "
    "what you expect. 1) Write a small script that prints the first 15 prime numbers, run it "
    "and show the output. 2) Run `whoami` and `pwd`. 3) Try to reach the internet with "
    "`curl -sS -m 8 https://example.com` (and, if curl is missing, python3 with urllib) and "
    "report the exact error. 4) Write a file named /tmp/proof.txt and list it. Reply in "
    "Markdown, at most 120 words: one line per step with the result, then one sentence saying "
    "whether the network call succeeded."
)
