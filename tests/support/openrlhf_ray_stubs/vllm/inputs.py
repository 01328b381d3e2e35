"""Stand-in (tests only): vLLM's ``TokensPrompt`` is a ``TypedDict``; a dict subclass serves the imports."""


class TokensPrompt(dict):
    pass
