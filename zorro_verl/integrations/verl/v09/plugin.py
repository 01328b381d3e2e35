"""verl >= 0.9 plugin entry point (group ``verl.plugins``): the one module of the verl 0.9 integration with an
import-time side effect.

verl imports every ``verl.plugins`` entry point at ``import verl`` (driver and Ray workers) and only logs load errors
at DEBUG level; an entry point is imported, never called, so importing this module installs zorro's post-import
hooks (:func:`~zorro_verl.integrations.verl.v09.registration.install`). The config class checks loudly that it
did (:func:`~zorro_verl.integrations.verl.v09.registration.check_engine_registered`).
"""

from zorro_verl.integrations.verl.v09.registration import install

install()
