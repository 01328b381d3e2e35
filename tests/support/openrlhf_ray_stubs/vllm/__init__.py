"""Stand-in for the names OpenRLHF's Ray modules import from vLLM (tests only; see ../README.md)."""

__version__ = "0.0.0+zorro-test-stand-in"


class _NoEngine:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vLLM is not installed: the OpenRLHF tests start no vLLM engine")

    @classmethod
    def from_engine_args(cls, *args, **kwargs):
        cls()


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


AsyncEngineArgs = AsyncLLMEngine = LLM = _NoEngine
