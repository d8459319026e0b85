"""Shared test support: builders of models and Kubernetes objects, the fake services (S3, the
Kubernetes API, the kustomize subset), and where the repository lies. Test modules import
from here, never from each other."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "tests" / "fixtures"
