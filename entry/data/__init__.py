"""A run's data on disk: the task files (resolved, generated, validated) and the latent cache (its
plan, resolved once from the config, and building it)."""
