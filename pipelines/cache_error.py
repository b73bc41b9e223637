"""The latent cache's one error, in a module of its own: the config's list of user errors
(`entry.config.errors`) names it without loading the cache's reader (tensordict, and torch._dynamo
with it: 2 s of every refused command's start)."""

from __future__ import annotations


class CacheError(RuntimeError):
    """A latent cache that must not be used (missing, partial, stale or corrupt)."""
