"""Checks that a Python environment holds the Megatron tests' stack (the versions scripts/setup_megatron_env.sh
installs, a CPU torch, megatron-core importable, Megatron-Bridge importable with the tests' CPU stand-ins); exits
non-zero with what is wrong. Run with the environment's interpreter, from the repository root:
``.venv-megatron/bin/python scripts/check_megatron_env.py``."""

import importlib.metadata as md
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.support below

WANT = {"torch": "2.13.0", "megatron-core": "0.19.2", "verl": "0.9.1", "mbridge": "0.15.1",
        "megatron-bridge": "0.6.2", "megatron-energon": "7.4.1", "transformers": "5.10.4"}


def main() -> None:
    import torch

    bad = []
    for name, v in WANT.items():
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            got = None
        if got is None or not got.startswith(v):
            bad.append(f"{name}: want {v}, got {got}")
    if torch.version.cuda is not None:
        bad.append(f"torch is a CUDA build ({torch.__version__})")
    if bad:
        sys.exit(f"[setup-megatron] {sys.prefix}: broken environment:\n  " + "\n  ".join(bad))
    import megatron.core  # noqa: F401  (an import error fails the script)

    from tests.support import megatron_bridge_cpu  # the bridge imports with the tests' CPU stand-ins

    megatron_bridge_cpu.install()
    print(f"[setup-megatron] {sys.prefix} ok:", ", ".join(f"{k} {md.version(k)}" for k in WANT))


if __name__ == "__main__":
    main()
