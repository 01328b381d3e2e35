"""Import hook for verl 0.7, the one module of the verl 0.7 integration with an import-time side effect: importing
it installs zorro's legacy actor routing.

Name it in ``VERL_USE_EXTERNAL_MODULES=zorro_verl.integrations.verl.v07.plugin`` (imported by ``import verl`` in
every process, Ray workers included) or in ``actor_rollout_ref.model.external_lib`` (imported by the FSDP worker's
``init_model`` before it builds the actor and the reference policy). Either way, an actor or ref whose
``fsdp_config.zorro.enable`` is true is built as
:class:`~zorro_verl.integrations.verl.v07.actor.ZoRRoDataParallelPPOActor`;
all other actors stay stock.
"""

from zorro_verl.integrations.verl.v07.actor import install

install()
