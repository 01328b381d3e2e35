"""Framework integrations: :mod:`.transformers` (the model step on Hugging Face models) and :mod:`.verl` (the verl
plugins, built on it). Only this folder imports transformers or verl (docs/DESIGN.md §9)."""
