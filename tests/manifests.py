"""Write a hand-edited manifest as a writer would: sealed with a fresh ``manifest_digest``.

Tests that edit a manifest to reach the parser's and the readers' own checks re-seal it, as a
deliberate forger can (the digest detects corruption and stray edits, not forgery), so that
those checks, not the digest, are what the test exercises.
"""

from __future__ import annotations

import json
from typing import Any

from shardsafe.format import DIGEST_FIELD, seal


def sealed(doc: dict[str, Any], **dumps: Any) -> bytes:
    """``doc`` (its old digest dropped) as the bytes of a sealed ``manifest.json``."""
    body = {k: v for k, v in doc.items() if k != DIGEST_FIELD}
    return seal(json.dumps(body, **dumps).encode())
