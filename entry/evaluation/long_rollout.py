"""Long-rollout and ensemble scores of one task and variant, mergeable over batches and ranks.

Wires ``core.long_rollout`` into the evaluation: nRMSE and VRMSE per lead-time window, the
correlation time (PDE-Refiner's 0.8 threshold), the energy-spectrum error at the last step, and,
for an ensemble of K rollouts from the same initial state, the fair CRPS, the spread-skill ratio
and the ensemble-mean nRMSE per window. Every score is a sum over samples until ``summary()``,
so batches and ranks combine exactly (no approximation; see each sum's comment).

Legend: K members, B batch, C channels, T time steps (given ones included), S spatial axes,
R radial wavenumber shells, L tokens, D latent dim.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.evaluation import Decode, Encode, MetricSums, StepFnFor
from core.long_rollout import (
    correlation_per_step,
    correlation_time,
    crps_ensemble,
    lead_time_windows,
    radial_energy_spectrum,
    spectra_log_error,
    windowed,
)
from core.metrics import NRMSE_EPS, flat_space, nrmse_per_step, vrmse_per_step
from core.rollout import decode_trajectory, rollout

CORRELATION_THRESHOLD = 0.8
"""Correlation below which a rollout counts as decorrelated (PDE-Refiner, Lippe et al. 2023)."""


def member_seed(seed: int, member: int) -> int:
    """Noise seed of ensemble member ``member`` (0-based) from the evaluation seed: member 0 keeps
    ``seed``, so its scores are the single-sample ones; member k adds k to the seed's high 32-bit
    word, which ``SampleNoise`` hashes beside the low one, so members draw independent noise."""
    if member < 0:
        raise ValueError(f"member must be >= 0, got {member}")
    return seed + (member << 32)


@dataclass
class RolloutSums:
    """Sums over test samples of one time-dependent task and variant (``[C, T]`` per-step rows).

    ``members`` is the ensemble size K this variant is scored with (1: a single rollout, member 0).
    """

    given_steps: int
    members: int
    per_step_JCT: Tensor
    """Rows ``_PER_STEP``, each the sum over samples of a per-sample (or per-sample-mean) score."""
    member_nrmse_KCT: Tensor
    """nRMSE per step of each member, summed over samples (their spread says how much of a
    difference between variants one draw of the noise can make)."""
    spectra_2CR: Tensor | None = None
    """Last-step radial energy spectra of member 0 and of the truth, summed over samples; None
    until the first batch (the shell count comes from the grid)."""
    k_max: int = 0
    """Shells the spectrum error compares, ``min(S) // 2`` (0 until the first batch)."""
    correlation_time: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    count: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    _PER_STEP = ("nrmse", "vrmse", "crps", "spread_sq", "skill_sq", "ensemble_mean_nrmse", "correlation")

    @classmethod
    def zeros(cls, channels: int, steps: int, given_steps: int, members: int, device) -> RolloutSums:
        """Empty sums for fields of ``channels`` channels and ``steps`` steps (given ones included)."""
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        z = {"dtype": torch.float64, "device": device}
        return cls(given_steps, members, torch.zeros(len(cls._PER_STEP), channels, steps, **z),
                   torch.zeros(members, channels, steps, **z),
                   correlation_time=torch.zeros((), **z), count=torch.zeros((), **z))

    def add(self, members_KBCTS: Tensor, true_BCTS: Tensor) -> None:
        """Add a batch: ``members`` [K, B, C, T, *S] rollouts from the same initial states (member 0
        the single-sample one, given steps copied from the truth) against ``true`` [B, C, T, *S]."""
        k, b = members_KBCTS.shape[:2]
        if k != self.members:
            raise ValueError(f"expected {self.members} members, got {tuple(members_KBCTS.shape)}")
        pred_BCTS = members_KBCTS[0]
        mean_BCTS = members_KBCTS.mean(0)
        # Squared spread and ensemble-mean error are summed before any square root: the ratio of
        # the pooled sums is spread_skill_ratio of all samples at once, whatever the batches.
        spread_sq = (flat_space(members_KBCTS.double().var(0, correction=1)).mean(-1).sum(0) if k > 1
                     else torch.zeros_like(self.per_step_JCT[0]))
        skill_sq = flat_space((mean_BCTS.double() - true_BCTS.double()).square()).mean(-1).sum(0)
        rows = [nrmse_per_step(pred_BCTS, true_BCTS) * b, vrmse_per_step(pred_BCTS, true_BCTS) * b,
                crps_ensemble(members_KBCTS, true_BCTS) * b, spread_sq, skill_sq,
                nrmse_per_step(mean_BCTS, true_BCTS) * b,
                correlation_per_step(pred_BCTS.double(), true_BCTS.double()).sum(0)]
        self.per_step_JCT += torch.stack([r.to(self.per_step_JCT) for r in rows])
        self.member_nrmse_KCT += torch.stack([nrmse_per_step(m, true_BCTS) * b for m in members_KBCTS]).to(
            self.member_nrmse_KCT)
        self.correlation_time += correlation_time(pred_BCTS, true_BCTS, threshold=CORRELATION_THRESHOLD,
                                                  given_steps=self.given_steps).sum().to(self.count)
        # Batch-summed spectra, the error taken at the end: spectrum_error compares batch means.
        spectra = torch.stack([radial_energy_spectrum(u[:, :, -1:])[:, :, 0].sum(0)
                               for u in (pred_BCTS, true_BCTS)]).to(self.count)
        self.spectra_2CR = spectra if self.spectra_2CR is None else self.spectra_2CR + spectra
        self.k_max = min(true_BCTS.shape[3:]) // 2
        self.count += b

    def all_reduce(self) -> None:
        """Sum over ranks (collective; a rank with no samples joins with zeros). Two collectives:
        the spectrum's sizes (a rank with an empty shard has seen no grid), then the sums."""
        shells = torch.tensor([0 if self.spectra_2CR is None else self.spectra_2CR.shape[-1], self.k_max],
                              device=self.count.device)
        dist.all_reduce(shells, op=dist.ReduceOp.MAX)
        r, self.k_max = shells.tolist()
        spectra = self.spectra_2CR if self.spectra_2CR is not None else self.per_step_JCT.new_zeros(
            2, self.per_step_JCT.shape[1], r)
        parts = [self.per_step_JCT, self.member_nrmse_KCT, spectra, self.correlation_time, self.count]
        packed = torch.cat([p.flatten() for p in parts])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        for p, new in zip(parts, packed.split([p.numel() for p in parts])):
            p.copy_(new.view_as(p))
        self.spectra_2CR = spectra

    def summary(self, edges: Sequence[int]) -> dict:
        """Scores over the predicted steps, windows ending at the lead times ``edges``.

        Returns ``windows`` ({"1-10": {...}, ...}: nrmse and vrmse of member 0, crps, spread_skill
        (None with one member), ensemble_mean_nrmse and nrmse_member_std (the std over members of
        the window's nRMSE; None with one member), each averaged over the window's steps and the
        channels), ``correlation_time`` (mean predicted steps at correlation >= 0.8),
        ``spectrum_error`` (mean over channels, last step), ``crps``, ``spread_skill``,
        ``ensemble_mean_nrmse`` over all predicted steps, ``ensemble_members``, and for plots
        ``correlation_per_step`` (member 0's Pearson correlation with the truth per predicted step,
        channels and samples averaged) and ``spectrum_last_step`` (``prediction`` and ``truth``: the
        sample-mean radial energy spectra of the last step, channels averaged, shells 1 to k_max).
        """
        n = self.count.item()
        if n == 0:
            raise ValueError("no samples were scored")
        g, k = self.given_steps, self.members
        rows = dict(zip(self._PER_STEP, self.per_step_JCT / n))
        spread_skill_CT = None
        if k > 1:
            # core.long_rollout.spread_skill_ratio per step, from the pooled squares of all samples.
            ratio_CT = rows["spread_sq"].sqrt() / (rows["skill_sq"].sqrt() + NRMSE_EPS)
            spread_skill_CT = math.sqrt((k + 1) / k) * ratio_CT
        spans = lead_time_windows(self.per_step_JCT.shape[-1] - g, edges)
        member_KCT = self.member_nrmse_KCT / n

        def over(value_CT: Tensor | None) -> dict[str, float | None]:
            if value_CT is None:
                return {f"{a + 1}-{b}": None for a, b in spans}
            return {name: v.mean().item() for name, v in windowed(value_CT, spans, given_steps=g).items()}

        per_window = {"nrmse": over(rows["nrmse"]), "vrmse": over(rows["vrmse"]), "crps": over(rows["crps"]),
                      "spread_skill": over(spread_skill_CT),
                      "ensemble_mean_nrmse": over(rows["ensemble_mean_nrmse"])}
        member_windows = [over(m) for m in member_KCT]
        windows = {}
        for a, b in spans:
            name = f"{a + 1}-{b}"
            windows[name] = {key: v[name] for key, v in per_window.items()}
            spread = torch.tensor([m[name] for m in member_windows]).std().item() if k > 1 else None
            windows[name]["nrmse_member_std"] = spread

        def whole(value_CT: Tensor | None) -> float | None:
            return None if value_CT is None else value_CT[:, g:].mean().item()

        spectra_2R = (self.spectra_2CR / n).mean(1)[:, 1:self.k_max + 1]
        return {"ensemble_members": k, "windows": windows,
                "correlation_per_step": rows["correlation"][:, g:].mean(0).tolist(),
                "spectrum_last_step": {"prediction": spectra_2R[0].tolist(), "truth": spectra_2R[1].tolist()},
                "correlation_time": self.correlation_time.item() / n,
                "spectrum_error": spectra_log_error(self.spectra_2CR[0] / n, self.spectra_2CR[1] / n,
                                                      self.k_max).mean().item(),
                "crps": whole(rows["crps"]), "spread_skill": whole(spread_skill_CT),
                "ensemble_mean_nrmse": whole(rows["ensemble_mean_nrmse"])}


@torch.no_grad()
def rollout_fields(u_given_NTCS: Tensor, steps: int, *, encode: Encode, step_for: StepFnFor, decode: Decode,
                   dt: float, task_id: int, sample_id_N: Tensor) -> Tensor:
    """The evaluation's rollout in field space: encode the last given frame (the model is Markov),
    take ``steps`` latent steps of ``step_for``'s step function for these samples, decode every one.
    -> [N, T0 + steps, C, *S]: the ``T0`` given frames as they are, then the predictions (what
    ``core.evaluation.accumulate_task`` scores, and what `entry.inference` returns)."""
    n, g = u_given_NTCS.shape[:2]
    if steps == 0:  # nothing to decode (a decoder of zero frames cannot infer its shapes)
        return u_given_NTCS
    device = u_given_NTCS.device
    step_fn = step_for(sample_id_N.to(torch.int64).cpu(), torch.full((n,), -1, dtype=torch.int64))
    dt_B = torch.full((n,), dt, dtype=torch.float32, device=device)
    id_B = torch.full((n,), task_id, dtype=torch.int64, device=device)
    z_BTLD = rollout(step_fn, encode(u_given_NTCS[:, g - 1]), dt_B, id_B, steps)
    grid = tuple(u_given_NTCS.shape[3:])
    return torch.cat([u_given_NTCS, decode_trajectory(decode, z_BTLD[:, 1:], grid)], dim=1)


def rollout_member(u_true_NTCS: Tensor, given_steps: int, *, encode: Encode, step_for: StepFnFor,
                   decode: Decode, dt: float, task_id: int, sample_id_N: Tensor) -> Tensor:
    """One more ensemble member: the rollout ``core.evaluation.accumulate_task`` scores (from frame
    ``given_steps - 1``, given frames copied), without its one-step predictions. -> pred [N, C, T, *S]."""
    pred = rollout_fields(u_true_NTCS[:, :given_steps], u_true_NTCS.shape[1] - given_steps, encode=encode,
                          step_for=step_for, decode=decode, dt=dt, task_id=task_id, sample_id_N=sample_id_N)
    return pred.transpose(1, 2)


def ensemble_fan(members_KBCTS: Tensor, true_BCTS: Tensor, given_steps: int) -> dict:
    """One trajectory's ensemble for a fan plot: sample 0's first channel at the grid's centre point
    over the predicted steps, per member and for the truth. -> {"point", "members" [K][T'], "truth" [T']}."""
    centre = tuple(n // 2 for n in true_BCTS.shape[3:])
    at = (slice(None), 0, 0, slice(given_steps, None), *centre)
    return {"point": list(centre), "members": members_KBCTS[at].double().tolist(),
            "truth": true_BCTS[at[1:]].double().tolist()}


MIN_COST_ROUNDS = 2
"""Timed rounds `rollout_step_cost` always takes (the best of one is a single draw of the machine's noise)."""
COST_BUDGET_S = 0.5
"""Seconds of timed rounds after which `rollout_step_cost` takes no more than `MIN_COST_ROUNDS`."""


def rollout_step_cost(step_for: StepFnFor, networks: dict[str, nn.Module], z0_BLD: Tensor, *, dt: float,
                      task_id: int, sample_id_B: Tensor, steps: int = 10, rounds: int = 5,
                      budget_s: float = COST_BUDGET_S, timed: bool = True) -> tuple[float | None, dict[str, int]]:
    """What one latent rollout step of a variant costs (operator and refiner, no decoding): (wall
    seconds per trajectory, forward calls of each network in ``networks`` a step); not ``timed``,
    the warm-up step alone runs (the calls) and the seconds are None.

    ``steps`` steps from ``z0`` for its batch, the best of at most ``rounds`` after a warm-up step:
    at least `MIN_COST_ROUNDS`, then more while the timed rounds have taken under ``budget_s``
    (every evaluation pays this per variant and task; a large model's round already takes long). The
    seconds are machine-dependent, a record rather than a score; the calls (the operator's one, a
    sampler's denoiser calls; networks not called are left out) are not. They are counted by
    forward hooks during the warm-up step only (a step calls the same networks as every other), so
    the timed rounds carry no hook. On CUDA each round is synchronised. Best of 2 rounds of 5 steps
    moved by a third between two evaluations of the same weights on a 2-core machine; hence more of
    each."""
    b, device = z0_BLD.shape[0], z0_BLD.device
    step_fn = step_for(sample_id_B.to(torch.int64).cpu(), torch.full((b,), -1, dtype=torch.int64))
    dt_B = torch.full((b,), dt, dtype=torch.float32, device=device)
    id_B = torch.full((b,), task_id, dtype=torch.int64, device=device)
    calls = dict.fromkeys(networks, 0)

    def counter(name: str):
        def hook(*_):
            calls[name] += 1
        return hook

    best, spent = math.inf, 0.0
    for r in range(rounds + 1 if timed else 1):
        if r > MIN_COST_ROUNDS and spent >= budget_s:
            break
        # round 0 is one step: it warms up (lazy init, allocator) and counts the calls
        handles = [net.register_forward_hook(counter(name)) for name, net in networks.items()] if r == 0 else []
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            rollout(step_fn, z0_BLD, dt_B, id_B, steps if r > 0 else 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            for h in handles:
                h.remove()
        if r > 0:
            seconds = time.perf_counter() - t0
            best, spent = min(best, seconds), spent + seconds
    return (best / (steps * b) if timed else None), {name: n for name, n in calls.items() if n}


class KeepPrediction:
    """Stands in for a ``MetricSums`` in ``accumulate_task`` and keeps the rollout it scores, so
    member 0 of an ensemble is the single-sample rollout, not rolled out a second time."""

    def __init__(self, sums: MetricSums) -> None:
        self.sums = sums
        self.given_steps, self.steady, self.samples = sums.given_steps, sums.steady, sums.samples
        self.pred_BCTS: Tensor | None = None

    def add(self, pred_BCTS: Tensor, true_BCTS: Tensor, one_step_BCTS: Tensor | None) -> None:
        self.sums.add(pred_BCTS, true_BCTS, one_step_BCTS)
        self.pred_BCTS = pred_BCTS
