"""Shared test configuration: hypothesis profiles and paths to shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The project's shared folder, beside the checkout in development and CI; a user's clone has none.
SHARED_DIR = Path(os.environ.get("CURSUS_SHARED_DIR", REPO_ROOT.parent / "shared"))
#: The cross-language conformance vectors, committed as test data so a bare clone passes ``make test``;
#: ``test_wire_conformance`` checks the copy against ``SHARED_DIR`` whenever that folder exists.
CONFORMANCE_PATH = Path(__file__).resolve().parent / "data" / "conformance" / "wire-v2.json"
