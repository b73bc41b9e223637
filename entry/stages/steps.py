"""The step functions of the stages whose batches need completing before the core step runs: the
consistency student's (the frozen operator's prediction attached first) and the steady prior's (a
cache pair renamed to coefficient and solution). Shared by the stages that train with them and by
the planner and the estimate that probe them (entry.stages.record)."""

from __future__ import annotations

from core.steps.consistency import consistency_step
from core.steps.diffusion import attach_operator_prediction
from core.steps.steady import steady_step


def consistency_with_operator(model, params, batch, *, cfg, generator, operator, teacher, target):
    """The consistency step on a batch completed with the frozen operator's prediction z_op.
    Returns (loss, metrics) as `core.steps.consistency.consistency_step` does."""
    batch = attach_operator_prediction(operator, batch)
    return consistency_step(model, params, batch, cfg=cfg, generator=generator, teacher=teacher, target=target)


def steady_pairs_step(model, params, batch, *, cfg, generator, solution_mean=None):
    """The steady step on a cache pair: coefficient latent (z_t) -> solution latent (z_next).
    Returns (loss, metrics) as `core.steps.steady.steady_step` does."""
    batch = batch.copy()
    batch["z_coef"], batch["z_sol"] = batch["z_t"], batch["z_next"]
    return steady_step(model, params, batch, cfg=cfg, generator=generator, solution_mean=solution_mean)
