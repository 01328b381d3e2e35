"""Where the Hydra presets (``zorro_ppo_trainer``, ``zorro_megatron_trainer``, ``zorro_legacy``) live: package data
in ``zorro_verl/configs``, reachable from verl's command line as ``--config-path=pkg://zorro_verl.configs``. Imports
no verl."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PRESET_SEARCH_PATH", "preset_dir"]

#: What to pass as verl's ``--config-path`` (Hydra finds the package's presets wherever it is installed).
PRESET_SEARCH_PATH = "pkg://zorro_verl.configs"


def preset_dir() -> str:
    """Absolute path of the installed package's presets folder (``zorro_verl/configs``); ``FileNotFoundError`` if the
    package was installed without its data files."""
    d = Path(__file__).resolve().parents[2] / "configs"
    if not (d / "zorro_ppo_trainer.yaml").is_file():
        raise FileNotFoundError(f"zorro presets: {d / 'zorro_ppo_trainer.yaml'} is missing; reinstall zorro-verl "
                                "(the presets are package data).")
    return str(d)
