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
# The shared folder sits beside the checkout (../shared), in CI as in development.
SHARED_DIR = Path(os.environ.get("CURSUS_SHARED_DIR", REPO_ROOT.parent / "shared"))
