"""Pure step functions, one module per training stage.

Every step is ``loss, metrics = step(model, params, batch, *, cfg, generator, **frozen)``:
``params`` applied with ``torch.func.functional_call``, ``batch`` a TensorDict [B],
``metrics`` a TensorDict of detached scalars, frozen networks as keyword modules. The loss
is the batch mean of per-sample losses whose noise depends only on (generator state,
sample key), so it is invariant to permuting or splitting the batch (core/steps/common.py).
"""

from core.steps.autoencoder import AutoencoderStepConfig, autoencoder_step
from core.steps.consistency import ConsistencyStepConfig, consistency_sample, consistency_step, ema_update_
from core.steps.diffusion import DiffusionStepConfig, attach_operator_prediction, diffusion_step, refine
from core.steps.operator import OperatorStepConfig, operator_step
from core.steps.steady import SteadyStepConfig, steady_sample, steady_step

__all__ = [
    "AutoencoderStepConfig", "autoencoder_step", "ConsistencyStepConfig", "consistency_sample", "consistency_step",
    "ema_update_", "DiffusionStepConfig", "attach_operator_prediction", "diffusion_step", "refine",
    "OperatorStepConfig", "operator_step", "SteadyStepConfig", "steady_sample", "steady_step",
]
