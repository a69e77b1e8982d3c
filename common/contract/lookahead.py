"""The rule by which scheduler and worker count a sequence's tokens alike without waiting for a
reply (one step of lookahead): both apply it when a step is sent, before its tokens are known."""


def num_sampled_tokens(num_tokens: int, num_computed_tokens: int) -> int:
    """Tokens a step samples for a sequence that held num_tokens tokens before it and has
    num_computed_tokens computed after it: every computed position at or past its last token samples
    the next one. So a chunk mid-prompt samples none, one that reaches the end samples one, and n
    decode iterations (the last token and n - 1 the worker sampled itself) sample n."""
    return max(num_computed_tokens + 1 - num_tokens, 0)
