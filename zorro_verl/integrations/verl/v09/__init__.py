"""zorro for verl >= 0.9: the FSDP engine (:mod:`.engine`), its config (:mod:`.config`), the trainers' group-aware
balancing (:mod:`.balance`), registration (:mod:`.registration`) and the entry-point plugin (:mod:`.plugin`).
Importing this package imports nothing from verl."""
