"""Framework integrations: :mod:`.transformers` (the model step on Hugging Face models), :mod:`.verl` (the verl
plugins) and :mod:`.openrlhf` (the OpenRLHF actor), both built on it. Only this folder imports transformers, verl or
OpenRLHF (docs/design/layering.md)."""
