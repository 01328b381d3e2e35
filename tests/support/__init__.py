"""Test support that does not ship with the package: repository paths, the verl CPU platform, verl engine builders
and the Ray test worker."""

from pathlib import Path

#: The repository root (configs/, examples/, scripts/ live there).
REPO_ROOT = Path(__file__).resolve().parents[2]
