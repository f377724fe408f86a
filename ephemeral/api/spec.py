"""The OpenAPI document, as checked in at ``docs/openapi.json``.

Regenerate after an API change with ``python -m ephemeral.api.spec > docs/openapi.json``;
``tests/api/test_openapi.py`` fails while the checked-in copy differs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ephemeral.settings import Settings


def openapi_document() -> dict[str, Any]:
    from ephemeral.api import create_app

    # The document depends on code only; settings do not change it.
    return create_app(Settings.load(url=None)).openapi()


def render() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
