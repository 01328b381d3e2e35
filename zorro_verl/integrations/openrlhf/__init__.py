"""OpenRLHF integration (docs/design/openrlhf.md): zorro's deduplicated forward for ``openrlhf.models.actor.Actor`` and
group-aware batching, switched on by ``ZORRO_OPENRLHF=1``. Nothing here imports OpenRLHF at package import:

* :mod:`.settings` — the switch and ``ZORRO_OPENRLHF_OPTIONS`` (no OpenRLHF);
* :mod:`.boot` — the loader the ``.pth`` file runs in every process, and its post-import hooks;
* :mod:`.layout` — OpenRLHF's batch layout to zorro's plan and back (torch only);
* :mod:`.actor` — the replacement ``Actor.forward``, refusals and metrics;
* :mod:`.batching` — group micro-batches for the replay buffer, the experience maker and DP balancing.
"""
