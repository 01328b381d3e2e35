"""zorro for verl 0.7 legacy workers: ``ZoRRoDataParallelPPOActor`` (:mod:`.actor`), its config (:mod:`.config`)
and the plugin module (:mod:`.plugin`) named in ``VERL_USE_EXTERNAL_MODULES`` or ``model.external_lib``.
Importing this package imports nothing from verl."""
