"""Scoring of rollouts against true trajectories, mergeable over batches and ranks.

Legend: N samples, B batch, T time steps, C channels, S spatial axes, L tokens, D latent dim.
Pure: the caller reads the data, builds the models and combines ranks (entry/evaluate.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from core.metrics import nrmse_per_step, pdebench_metrics
from core.rollout import decode_trajectory, rollout

MEAN_KEYS = ("rmse", "nrmse", "vrmse", "brmse")
"""Per-sample values averaged over samples (PDEBench: mean over the batch)."""
RMS_KEYS = ("crmse", "frmse_low", "frmse_mid", "frmse_high")
"""Values PDEBench takes as RMS over samples: we add squares, so shards combine exactly."""
_ROWS = MEAN_KEYS + RMS_KEYS + ("one_step_nrmse",)


@dataclass
class MetricSums:
    """Per-sample metric sums of one task and variant, mergeable over batches and ranks.

    ``sums_KCT`` rows follow ``_ROWS``; the one-step row's column t scores the prediction
    of frame t from the true frames before it (columns ``t < given_steps`` unused, so one-step
    and rollout scores cover the same predicted frames; steady tasks: the single prediction is
    its own one-step prediction).
    """

    given_steps: int
    steady: bool
    sums_KCT: Tensor
    max_CT: Tensor
    count: Tensor
    samples: list = field(default_factory=list)
    """(pred_TCS, true_TCS) CPU tensor pairs kept for plots."""

    @classmethod
    def zeros(cls, channels: int, steps: int, given_steps: int, steady: bool, device) -> MetricSums:
        z = dict(dtype=torch.float64, device=device)
        return cls(given_steps, steady, torch.zeros(len(_ROWS), channels, steps, **z),
                   torch.zeros(channels, steps, **z), torch.zeros((), **z))

    def add(self, pred_BCTS: Tensor, true_BCTS: Tensor, one_step_BCTS: Tensor | None) -> None:
        """Add a batch: ``pred``/``true`` over the whole window, ``one_step`` predicts frames 1..T-1."""
        b = true_BCTS.shape[0]
        m = pdebench_metrics(pred_BCTS, true_BCTS, given_steps=self.given_steps)
        rows = [m[k] * b for k in MEAN_KEYS] + [m[k].square() * b for k in RMS_KEYS]
        one = torch.zeros_like(m["nrmse"])
        if self.steady:
            one = m["nrmse"]
        elif one_step_BCTS is not None:
            one[:, 1:] = nrmse_per_step(one_step_BCTS, true_BCTS[:, :, 1:])
        rows.append(one * b)
        self.sums_KCT += torch.stack(rows).to(self.sums_KCT)
        self.max_CT.copy_(torch.maximum(self.max_CT, m["max_error"].to(self.max_CT)))
        self.count += b

    def summary(self) -> dict:
        """Scores over channels and predicted steps ``t >= given_steps`` (see core/metrics.py)."""
        n = self.count.item()
        if n == 0:
            raise ValueError("no samples were scored")
        k = {name: i for i, name in enumerate(_ROWS)}
        per_step = {name: self.sums_KCT[k[name]] / n for name in MEAN_KEYS}
        per_step |= {name: (self.sums_KCT[k[name]] / n).sqrt() for name in RMS_KEYS}
        per_step["max_error"] = self.max_CT
        g = self.given_steps
        out = {name: v[:, g:].mean().item() for name, v in per_step.items()}
        out["nrmse_pdebench2022"] = per_step["nrmse"].mean().item()
        one = self.sums_KCT[k["one_step_nrmse"]] / n
        out["one_step_nrmse"] = (one[:, 0] if self.steady else one[:, max(g, 1):]).mean().item()
        out["nrmse_per_step"] = per_step["nrmse"][:, g:].mean(0).tolist()
        # Per channel (field component), over the predicted steps: the caller names the channels.
        out["nrmse_per_channel"] = per_step["nrmse"][:, g:].mean(1).tolist()
        out["vrmse_per_channel"] = per_step["vrmse"][:, g:].mean(1).tolist()
        out["n_samples"] = int(n)
        return out


Encode = Callable[[Tensor], Tensor]
StepFn = Callable[[Tensor, Tensor, Tensor], Tensor]
Decode = Callable[[Tensor, tuple[int, ...]], Tensor]
StepFnFor = Callable[[Tensor, Tensor], StepFn]
"""``step_fn_for(sample_id_B, t_B) -> step_fn`` for the batch whose samples those are (``t_B``: the
input frame of a one-step prediction, -1 for a rollout): how a sampler gets noise that belongs to
each sample (``core.steps.common.SampleNoise``) whatever the batch it is scored in."""


def _constant(step_fn: StepFn) -> StepFnFor:
    return lambda sample_id_B, t_B: step_fn


@torch.no_grad()
def accumulate_task(sums: MetricSums, u_true_NTCS: Tensor, *, encode: Encode, step_fn: StepFn | StepFnFor,
                    decode: Decode, dt: float, task_id: int, coefficient_NCS: Tensor | None = None, keep: int = 0,
                    sample_id_N: Tensor | None = None) -> None:
    """Score one batch of test trajectories into ``sums`` (steady tasks: from ``coefficient_NCS``).

    Dynamic: encode frame ``given_steps - 1`` (the model is Markov: one input frame), take
    ``T - given_steps`` steps of ``step_fn``, decode; the given frames are copied from the
    truth. One-step: every true frame t -> ``decode(step_fn(encode(u_t)))`` against t + 1.
    Steady: ``decode(step_fn(encode(coefficient)))`` against the solution (T = 1).
    With ``sample_id_N`` (the samples' stable ids), ``step_fn`` is a ``StepFnFor``, asked for the
    step function of each batch it is called on. ``keep`` first samples are stored in
    ``sums.samples`` for plots.
    """
    n, t = u_true_NTCS.shape[:2]
    grid = tuple(u_true_NTCS.shape[3:])
    device = u_true_NTCS.device
    step_for = _constant(step_fn) if sample_id_N is None else step_fn
    ids_N = torch.zeros(n, dtype=torch.int64) if sample_id_N is None else sample_id_N.to(torch.int64).cpu()
    dt_B = torch.full((n,), dt, dtype=torch.float32, device=device)
    id_B = torch.full((n,), task_id, dtype=torch.int64, device=device)
    rollout_fn = step_for(ids_N, torch.full((n,), -1, dtype=torch.int64))
    if sums.steady:
        pred_NTCS = predict_steady(rollout_fn, coefficient_NCS, encode=encode, decode=decode, task_id_B=id_B)[:, None]
        one_NTCS = None
    else:
        g = sums.given_steps
        z_BTLD = rollout(rollout_fn, encode(u_true_NTCS[:, g - 1]), dt_B, id_B, t - g)
        # Index 0 of the rollout is the encoded frame g - 1: the truth stands there (a given step).
        pred_NTCS = torch.cat([u_true_NTCS[:, :g], decode_trajectory(decode, z_BTLD[:, 1:], grid)], dim=1)
        frames = u_true_NTCS[:, :-1].flatten(0, 1)
        one_fn = step_for(ids_N.repeat_interleave(t - 1), torch.arange(t - 1).repeat(n))
        z_next = one_fn(encode(frames), dt_B.repeat_interleave(t - 1), id_B.repeat_interleave(t - 1))
        one_NTCS = decode(z_next, grid).reshape(n, t - 1, *u_true_NTCS.shape[2:])
    sums.add(pred_NTCS.transpose(1, 2), u_true_NTCS.transpose(1, 2),
             None if one_NTCS is None else one_NTCS.transpose(1, 2))
    for i in range(min(keep, n)):
        sums.samples.append((pred_NTCS[i].float().cpu(), u_true_NTCS[i].float().cpu()))


@torch.no_grad()
def predict_steady(step_fn: StepFn, coefficient_NCS: Tensor, *, encode: Encode, decode: Decode,
                   task_id_B: Tensor) -> Tensor:
    """A steady task's prediction from its coefficient: ``decode(step_fn(encode(coefficient)))`` at
    time step 0, on the coefficient's grid. -> [N, C, *S]."""
    dt_B = torch.zeros(coefficient_NCS.shape[0], dtype=torch.float32, device=coefficient_NCS.device)
    return decode(step_fn(encode(coefficient_NCS), dt_B, task_id_B), tuple(coefficient_NCS.shape[2:]))


@torch.no_grad()
def accumulate_reconstruction(sums: MetricSums, u_true_NTCS: Tensor, *, encode: Encode, decode: Decode) -> None:
    """Score the codec alone: ``decode(encode(u))`` of every frame against the frame, into ``sums``
    (made like a rollout's, so ``summary()["nrmse"]`` covers the frames a rollout is scored on).
    No model can score below this on those frames: it is the error floor of a latent surrogate."""
    n, t = u_true_NTCS.shape[:2]
    frames = u_true_NTCS.flatten(0, 1)
    rec = decode(encode(frames), tuple(u_true_NTCS.shape[3:])).reshape(u_true_NTCS.shape)
    sums.add(rec.transpose(1, 2), u_true_NTCS.transpose(1, 2), None)
