"""verl integration (docs/design/verl.md). Nothing here imports verl at package import:

* :mod:`.settings` — :class:`~.settings.ZorroSettings`, the validated ``zorro`` keys (no verl);
* :mod:`.common` — what both generations' actors share (no verl);
* :mod:`.v09` — the verl >= 0.9 FSDP engine plugin;
* :mod:`.v07` — the verl 0.7 ``DataParallelPPOActor`` integration.
"""
