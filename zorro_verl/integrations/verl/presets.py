"""Where the Hydra presets (``zorro_ppo_trainer``, ``zorro_legacy``) live. Imports no verl."""

from __future__ import annotations

from pathlib import Path

__all__ = ["preset_dir"]


def preset_dir() -> str:
    """Absolute path of the folder holding the presets: inside the installed package, else the checkout's
    ``configs/``. Raises ``FileNotFoundError`` naming both places when neither exists."""
    pkg = Path(__file__).resolve().parents[2] / "configs"
    checkout = Path(__file__).resolve().parents[3] / "configs"
    for d in (pkg, checkout):
        if (d / "zorro_ppo_trainer.yaml").is_file():
            return str(d)
    raise FileNotFoundError(f"zorro presets: zorro_ppo_trainer.yaml is in neither {pkg} nor {checkout}; reinstall "
                            "zorro-verl.")
