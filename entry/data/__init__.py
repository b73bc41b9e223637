"""A run's data on disk: the task files (resolved, generated, validated) and the latent cache
(where it lives, what it must hold, building and loading it)."""
