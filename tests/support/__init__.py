"""Test support that does not ship with the package: repository paths, the verl CPU platform, verl engine builders
and the Ray test worker."""

import os
from pathlib import Path

#: The repository root (configs/, examples/, scripts/ live there).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: The time limit of a test's subprocess or rank group: a guard against hangs only, never a speed check. It is set
#: far above any measured run (the slowest multi-rank test here takes ~3 min on a quiet 2-core machine), so a slow or
#: busy machine cannot reach it and only a real hang (a collective that never completes) does; ZORRO_HANG_TIMEOUT
#: overrides it.
HANG_TIMEOUT_S = int(os.environ.get("ZORRO_HANG_TIMEOUT", "1500"))
