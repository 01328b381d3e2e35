"""verl integration. Nothing here imports verl at package import (two verl generations share this package):

* :mod:`.config` — :class:`ZorroSettings`, the validated settings shared by both generations (no verl import).
* ``engine`` / ``plugin`` — the verl >= 0.9 FSDP engine plugin (imports verl 0.9 modules when imported).
* ``legacy`` — the verl 0.7 ``DataParallelPPOActor`` integration.
"""

from zorro_verl.integrations.verl.config import ZorroSettings

__all__ = ["ZorroSettings"]
