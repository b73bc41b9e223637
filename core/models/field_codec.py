# long file: one codec: its two halves share the field table, the cell layout and the view that binds a task
"""Field codec ``fields``: any set of named fields <-> one fixed set of L latent tokens per frame.

Legend: B batch, F fields of a task (its channels, in the task's order), S spatial axes (X or X, Y),
L tokens per frame, D latent width, H token width, N merge heads, K cosine modes per cell (m ** d).

The codec knows a list of field names (a scalar, or one component of a vector, named as the
dataset's description names it), each with a learned embedding in the encoder and one in the
decoder, stored under its name (state-dict key ``encoder.embed.f_<name>``). A task's frame is a
tensor of its fields, named by the caller, so the operator, refiners, latent cache and samplers
see [L, D] tokens and never a channel count (after MPP's global field list, written anew here):

  * encode: every field alone is cut into the same cells (``grid_codec.fit_cells``: the
    least-squares cosine expansion of each cell, m modes per axis, the DCT of the cell when it
    holds m points per axis, so one codec serves every resolution), embedded by a patch embedding
    shared by all fields (one per spatial dimension, into the shared width H), its field
    embedding and the cell's position added, and lifted by a residual MLP (so the field's
    identity shapes its features non-linearly). The fields of a cell are then merged by
    attention pooling over the fields (learned scores, softmax over F): invariant to the fields'
    order up to float summation order, and normalised, so a frame of 1 field and one of 5 give
    tokens of one scale. Global-attention mixer blocks then mix the L tokens, and a linear map
    gives the D numbers of each token.
  * decode: the tokens are mixed back to width H; each requested field reads them through its
    own decoder embedding (a FiLM of the normalised tokens: scale and shift from the embedding),
    a residual MLP and a patch head per dimension giving its cells' cosine coefficients, which
    are evaluated on the requested grid (``grid_codec.eval_cells``). Fields are decoded
    independently, so decode returns exactly the requested fields in the requested order. The
    heads start at zero: a fresh codec decodes zeros (nRMSE 1), not a random field.

Each field is normalised by its own mean and scale (buffers fitted from training frames by
``fit_field_scales``, before training; a name shared by tasks is one field with one normalisation),
so fields of very different magnitudes meet in one model at one scale.

Token count rule: L per frame is fixed per spatial dimension (``tokens``: {d: L_d}) and does not
depend on the grid or the number of fields. A d-dimensional field is cut into L_d = S ** d equal
cells (S per axis; 2D needs L a power of 4, 3D a power of 8: Morton order), so a cell of a grid of
n points per axis holds n / S points per axis: the patch size follows from the grid. Giving 1D and
2D the same L (e.g. 64: 64 cells of a line, 8 x 8 cells of a square) gives every task the same
token count, and one operator steps them all. ``modes`` m_d per axis fixes the patch embedding's
input (K = m ** d numbers per cell and field); m = the points per cell and axis of the training grid
keeps every point of it.

Adding fields (``add_fields``) appends new embeddings and touches no existing parameter; a task
of old fields reads only its own fields' embeddings, so its encode and decode stay bitwise equal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.models.grid_codec import NDIMS, cells_per_axis, eval_cells, fit_cells
from core.models.layers import MixerBlock, Mlp, morton_permutation
from core.models.registry import DESCRIPTION_ATTR, register
from core.models.settings import SETTINGS, heads_divide, positive

EMBED_PREFIX = "f_"
"""Prefix of a field's key in the embedding tables: keeps a field named like a module attribute
(``keys``, ``update``) from clashing with it."""


Fields = tuple[str, ...] | list[str]
"""Field names, in the order of a field tensor's channels."""


def field_key(name: str) -> str:
    """The key of field ``name`` in the embedding tables (and so in the state dict): ``f_`` and the
    name with every character outside [A-Za-z0-9_] replaced by ``_`` (a state-dict key may not hold ``.``)."""
    return EMBED_PREFIX + re.sub(r"[^0-9A-Za-z_]", "_", name)


def check_fields(fields: list[str] | tuple[str, ...], known: list[str] | None = None) -> list[str]:
    """``fields`` as a list after checking them: non-empty strings, no name twice, no two names with
    one key (``field_key``), none already in ``known``. A violation is a ValueError naming it."""
    names = list(fields)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"field names must be non-empty strings, got {bad[0]!r}")
    taken = {field_key(n): n for n in (known or [])}
    for name in names:
        other = taken.get(field_key(name))
        if other is not None:
            raise ValueError(f"field {name!r} is already known" if other == name else
                             f"fields {other!r} and {name!r} share the key {field_key(name)!r}; rename one")
        taken[field_key(name)] = name
    return names


@dataclass(**SETTINGS)
class FieldCodecSettings:
    """The field codec's hyperparameters (codec ``fields``; the stack supplies the field names,
    the latent width and the tokens and modes per dimension)."""

    hidden: int = 64
    """H, width of the field tokens, the merge and the mixer."""
    depth: int = 2
    """Global-attention mixer blocks over the L tokens, in each half."""
    heads: int = 4
    """Attention heads of the mixer and of the field merge (divides ``hidden``)."""

    def __post_init__(self):
        positive(self, "hidden", "depth", "heads")
        heads_divide(self, "hidden", "heads")


def _layout(tokens: dict[int, int], modes: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """({d: L_d}, {d: S_d cells per axis}) after checking that tokens and modes name the same dimensions."""
    if not tokens or sorted(tokens) != sorted(modes) or any(d not in NDIMS for d in tokens):
        raise ValueError(f"tokens and modes must name the same dimensions within {NDIMS}, got "
                         f"{sorted(tokens)} and {sorted(modes)}")
    if any(m < 1 for m in modes.values()):
        raise ValueError(f"modes must be >= 1 per dimension, got {modes}")
    return dict(tokens), {d: cells_per_axis(n, d) for d, n in tokens.items()}


class _FieldScales(nn.Module):
    """Each field's normalisation ``(u - mean) / scale``: a buffer ``f_<name>`` = [mean, scale] per
    field (saved with the weights; set by ``fit_field_scales``; a field not fitted has 0 and 1)."""

    def __init__(self, fields: list[str]) -> None:
        super().__init__()
        for name in fields:
            self.add(name)

    def add(self, name: str) -> None:
        self.register_buffer(field_key(name), torch.tensor([0.0, 1.0]))

    def of(self, fields: Fields) -> tuple[Tensor, Tensor]:
        """(mean [F], scale [F]) of ``fields``, fp32."""
        ms = torch.stack([getattr(self, field_key(n)) for n in fields]).float()
        return ms[:, 0], ms[:, 1]


class _FieldHalf(nn.Module):
    """What both halves hold: the field names, one embedding and one normalisation per field, the
    cell layout and the per-dimension positions and mixer."""

    def __init__(self, fields: list[str], tokens: dict[int, int], modes: dict[int, int], hidden: int, depth: int,
                 heads: int) -> None:
        super().__init__()
        self.fields = check_fields(fields)
        self.tokens, self.cells = _layout(tokens, modes)
        self.modes = dict(modes)
        self.ndims = tuple(sorted(self.tokens))
        self.embed = nn.ParameterDict({field_key(n): nn.Parameter(torch.empty(hidden)) for n in self.fields})
        for p in self.embed.values():
            nn.init.normal_(p, std=1.0)
        self.scales = _FieldScales(self.fields)
        self.pos = nn.ParameterDict({f"{d}d": nn.Parameter(torch.empty(self.tokens[d], hidden)) for d in self.ndims})
        for p in self.pos.values():
            nn.init.normal_(p, std=0.02)
        self.mixer = nn.ModuleList(MixerBlock(hidden, heads) for _ in range(depth))
        for d, side in self.cells.items():
            if d >= 2:
                morton = morton_permutation(side, d)
                self.register_buffer(f"morton_{d}d", morton, persistent=False)
                self.register_buffer(f"unmorton_{d}d", torch.argsort(morton), persistent=False)

    def blocks(self) -> list[nn.Module]:
        """The mixer blocks, each a unit FSDP2 can shard on its own."""
        return list(self.mixer)

    def embeddings(self, fields: Fields) -> Tensor:
        """The embeddings of ``fields`` in that order. -> [F, H]; an unknown field is a ValueError."""
        unknown = [n for n in fields if n not in self.fields]
        if unknown or not fields:
            raise ValueError(f"codec knows fields {self.fields}; got {list(fields)} (a new field needs add_fields)")
        return torch.stack([self.embed[field_key(n)] for n in fields])

    def add(self, names: list[str], *, generator: torch.Generator | None, noise: float) -> None:
        """Append embeddings for ``names``: the mean of the existing ones, plus ``noise`` times a
        normal draw from ``generator`` when one is given. Existing parameters are not touched."""
        names = check_fields(names, self.fields)
        for name in names:
            self.embed[field_key(name)] = nn.Parameter(torch.empty_like(self.embed[field_key(self.fields[0])]))
            self.scales.add(name)
        old = list(self.fields)
        self.fields.extend(names)
        self.start_new(names, old, generator=generator, noise=noise)

    @torch.no_grad()
    def start_new(self, names: list[str], old: list[str], *, generator: torch.Generator | None = None,
                  noise: float = 0.02) -> None:
        """Set the embeddings of ``names`` (fields this half has) to the mean of the embeddings of
        ``old``, plus ``noise`` times a normal draw from ``generator`` when one is given, and their
        normalisation to mean 0, scale 1: what a field new to a trained codec starts from. The
        fields of ``old`` are not touched."""
        mean = self.embeddings(old).mean(0)
        for name in names:
            init = mean.clone()
            if generator is not None:
                init += noise * torch.randn(mean.shape, generator=generator, device=generator.device).to(mean)
            self.embed[field_key(name)].copy_(init)
            self.scales.get_buffer(field_key(name)).copy_(torch.tensor([0.0, 1.0]))

    def _dim(self, d: int) -> int:
        if d not in self.ndims:
            raise ValueError(f"codec built for spatial dimensions {self.ndims}, got a {d}-dimensional field")
        return d


class FieldEncoder(_FieldHalf):
    """Named fields -> tokens. ``u_BFS`` with ``fields`` (F names, in the order of u's channels) -> ``z_BLD``."""

    def __init__(self, fields: list[str], tokens: dict[int, int], modes: dict[int, int], dim: int, hidden: int,
                 depth: int, heads: int) -> None:
        super().__init__(fields, tokens, modes, hidden, depth, heads)
        self.heads = heads
        self.patch = nn.ModuleDict({f"{d}d": nn.Linear(self.modes[d] ** d, hidden) for d in self.ndims})
        self.lift_norm = nn.LayerNorm(hidden)
        self.lift = Mlp(hidden, 2 * hidden)
        self.score = nn.Linear(hidden, heads, bias=False)  # a bias shared by all fields cancels in the softmax
        self.value = nn.Linear(hidden, hidden)
        self.merged = nn.Linear(hidden, hidden)
        self.out_norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, u: Tensor, fields: Fields) -> Tensor:
        """u: [B, F, *S] (1, 2 or 3 spatial axes), fields: F names -> z_BLD [B, L_d, D]."""
        d = self._dim(u.ndim - 2)
        if u.shape[1] != len(fields):
            raise ValueError(f"a field tensor of {u.shape[1]} channels needs as many names, got {list(fields)}")
        e_FH = self.embeddings(fields)
        shape = (-1,) + (1,) * d
        mean_F, scale_F = self.scales.of(fields)
        u = (u.float() - mean_F.view(shape)) / scale_F.view(shape)
        c_BLFK = fit_cells(u, self.cells[d], self.modes[d], getattr(self, f"morton_{d}d", None))
        x = self.patch[f"{d}d"](c_BLFK.to(e_FH.dtype)) + e_FH + self.pos[f"{d}d"][:, None]  # [B, L, F, H]
        x = x + self.lift(self.lift_norm(x))
        # Attention pooling over the fields: softmax over F, per head; invariant to their order.
        w_BLFN = torch.softmax(self.score(x), dim=2)
        v = self.value(x).unflatten(-1, (self.heads, -1))  # [B, L, F, N, H/N]
        x_BLH = self.merged((w_BLFN[..., None] * v).sum(2).flatten(-2))
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        return self.out(self.out_norm(x_BLH))


class FieldDecoder(_FieldHalf):
    """Tokens -> named fields. ``(z_BLD, fields, grid_shape)`` -> ``u_BFS``, one channel per requested field."""

    def __init__(self, fields: list[str], tokens: dict[int, int], modes: dict[int, int], dim: int, hidden: int,
                 depth: int, heads: int) -> None:
        super().__init__(fields, tokens, modes, hidden, depth, heads)
        self.inp = nn.Linear(dim, hidden)
        self.query_norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.film = nn.Linear(hidden, 2 * hidden)
        self.read_norm = nn.LayerNorm(hidden)
        self.read = Mlp(hidden, 2 * hidden)
        self.head = nn.ModuleDict({f"{d}d": nn.Linear(hidden, self.modes[d] ** d) for d in self.ndims})
        for layer in self.head.values():  # a fresh decoder returns zeros: nRMSE 1, not a random field's
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, z_BLD: Tensor, fields: Fields, grid_shape: tuple[int, ...]) -> Tensor:
        """z_BLD [B, L_d, D], fields: F names, grid_shape (X,), (X, Y) or (X, Y, Z) -> u [B, F, *grid_shape]."""
        d = self._dim(len(grid_shape))
        if z_BLD.shape[1] != self.tokens[d]:
            raise ValueError(f"{d}D fields have {self.tokens[d]} tokens per frame, got z {tuple(z_BLD.shape)}")
        e_FH = self.embeddings(fields)
        x_BLH = self.inp(z_BLD) + self.pos[f"{d}d"]
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        scale_FH, shift_FH = self.film(e_FH).chunk(2, dim=-1)
        y = self.query_norm(x_BLH)[:, :, None] * (1 + scale_FH) + shift_FH  # [B, L, F, H]
        y = y + self.read(self.read_norm(y))
        coef_BLFK = self.head[f"{d}d"](y).float()
        u = eval_cells(coef_BLFK, tuple(grid_shape), self.cells[d], self.modes[d],
                       getattr(self, f"unmorton_{d}d", None))
        mean_F, scale_F = self.scales.of(fields)
        shape = (-1,) + (1,) * d
        return u * scale_F.view(shape) + mean_F.view(shape)


class FieldView(nn.Module):
    """A field codec bound to one task's field names, with the interface of a codec of one field
    set (``core.models.autoencoder.Autoencoder``): ``encode(u)``, ``decode(z, grid_shape)``,
    ``view(u) -> (z, u_hat)``, and halves ``encoder(u)`` and ``decoder(z, grid_shape)``. Holds no
    parameters of its own: it calls the codec it was made from (a module, so an exported program
    that wraps a view sees the codec's parameters; never saved: save the codec)."""

    def __init__(self, codec: FieldCodec, fields: Fields) -> None:
        super().__init__()
        codec.encoder.embeddings(fields)  # an unknown field fails here, not at the first batch
        self.codec, self.fields = codec, tuple(fields)

    def encoder(self, u: Tensor) -> Tensor:
        """u: [B, F, *S] -> z: [B, L, D]."""
        return self.codec.encoder(u, self.fields)

    def decoder(self, z: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """z: [B, L, D] -> u: [B, F, *grid_shape]."""
        return self.codec.decoder(z, self.fields, tuple(grid_shape))

    encode, decode = encoder, decoder

    def forward(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """u: [B, F, *S] -> (z [B, L, D], u_hat [B, F, *S])."""
        return self.codec(u, self.fields)


class FieldCodec(nn.Module):
    """Holds ``encoder`` (FieldEncoder) and ``decoder`` (FieldDecoder): kept apart, as the grid
    codec's halves are, so a stage can load or export one alone.

    ``tasks`` names the fields of each task id of the run (the stack's batches carry task ids, not
    names): ``forward(u, task_id_B)`` reads the fields of that task.
    """

    partial_graph = True
    """A batch uses only its task's field embeddings and its dimension's patch embedding, head and
    positions: data parallelism must expect parameters without gradients (DDP's unused-parameter search)."""

    def __init__(self, encoder: FieldEncoder, decoder: FieldDecoder, tasks: list[list[str]] | None = None) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.tasks = [tuple(t) for t in tasks or []]
        for t in self.tasks:
            encoder.embeddings(t)  # each task's fields are known ones

    def for_fields(self, fields: Fields) -> FieldView:
        """The codec bound to ``fields`` (a task's field names), with the one-field-set interface."""
        return FieldView(self, fields)

    def fields_of(self, fields: Fields | Tensor) -> tuple[str, ...]:
        """Field names as given, or those of the task of a task-id tensor [B] (every id the same:
        the stack's batches hold one task each). An id outside ``tasks`` or a mixed batch is a ValueError."""
        if not isinstance(fields, Tensor):
            return tuple(fields)
        # One host sync per batch: the names select parameters, so they must be known on the host.
        ids = fields.unique().tolist()
        if len(ids) != 1 or not 0 <= ids[0] < len(self.tasks):
            raise ValueError(f"a field codec's batch holds one task of ids 0..{len(self.tasks) - 1}, got ids {ids}")
        return self.tasks[ids[0]]

    @property
    def fields(self) -> list[str]:
        """The field names the codec knows, in the order they were added (a copy)."""
        return list(self.encoder.fields)

    def encode(self, u: Tensor, fields: Fields) -> Tensor:
        """u: [B, F, *S] with F field names -> z: [B, L, D]."""
        return self.encoder(u, fields)

    def decode(self, z: Tensor, fields: Fields, grid_shape: tuple[int, ...]) -> Tensor:
        """z: [B, L, D] -> u: [B, F, *grid_shape], exactly the named fields in that order."""
        return self.decoder(z, fields, tuple(grid_shape))

    def forward(self, u: Tensor, fields: Fields | Tensor) -> tuple[Tensor, Tensor]:
        """u: [B, F, *S] with F field names, or the task ids [B] of one task (``fields_of``) ->
        (z [B, L, D], u_hat [B, F, *S]) on the input's own grid."""
        fields = self.fields_of(fields)
        z = self.encoder(u, fields)
        return z, self.decoder(z, fields, tuple(u.shape[2:]))

    def add_fields(self, names: list[str] | tuple[str, ...], *, generator: torch.Generator | None = None,
                   noise: float = 0.02) -> None:
        """Append a new embedding for each of ``names`` to both halves (the fine-tuning of a run on
        fields it never saw): each starts at the mean of the existing embeddings of its half, plus
        ``noise`` times a normal draw from ``generator`` when one is given (None: the mean alone).
        Their normalisation starts at mean 0, scale 1 (``fit_field_scales`` sets it from their data).
        No existing parameter or buffer changes, so a task of old fields encodes and decodes bitwise as
        before. The description (``registry.describe``) lists the new fields, so a rebuild has them.
        An optimizer made before this call does not hold the new parameters. A known name is a ValueError.
        """
        self.encoder.add(list(names), generator=generator, noise=noise)
        self.decoder.add(list(names), generator=generator, noise=noise)
        description = getattr(self, DESCRIPTION_ATTR, None)
        if description is not None:
            description["args"]["fields"] = self.fields

    def start_new_fields(self, names: list[str] | tuple[str, ...]) -> None:
        """Start the fields ``names`` of this codec (built with them, its other fields' weights
        loaded from a trained codec) as ``add_fields`` starts a field: each half's embedding at the
        mean of its other fields', normalisation mean 0, scale 1. Nothing else changes."""
        unknown = [n for n in names if n not in self.fields]
        if unknown:
            raise ValueError(f"codec knows fields {self.fields}; cannot start {unknown}")
        old = [n for n in self.fields if n not in names]
        if not old:
            raise ValueError("start_new_fields needs at least one trained field to start from")
        for half in (self.encoder, self.decoder):
            half.start_new(list(names), old)


@register("codec", "fields", settings=FieldCodecSettings, stack_args=("fields", "tokens", "modes", "tasks"))
def field_autoencoder(fields: list[str], dim: int, tokens: dict[str, int], modes: dict[str, int], hidden: int = 64,
                      depth: int = 2, heads: int = 4, tasks: list[list[str]] | None = None) -> FieldCodec:
    """The field codec from plain JSON arguments.

    Args:
        fields: the field names it knows (each gets an embedding in each half).
        dim: D, latent token width.
        tokens: ``{"d": L_d}``, tokens per frame of a d-dimensional field (JSON keys are strings);
            its keys are the spatial dimensions the codec serves.
        modes: ``{"d": m}``, cosine modes per axis of that dimension's cells (same keys).
        hidden, depth, heads: ``FieldCodecSettings``.
        tasks: the field names of each task id of the run, in channel order (``FieldCodec.tasks``).
    Returns:
        ``FieldCodec(FieldEncoder, FieldDecoder)``.
    """
    FieldCodecSettings(hidden=hidden, depth=depth, heads=heads)
    per_dim = {int(d): n for d, n in tokens.items()}
    per_dim_modes = {int(d): m for d, m in modes.items()}
    kw = dict(fields=list(fields), tokens=per_dim, modes=per_dim_modes, dim=dim, hidden=hidden, depth=depth,
              heads=heads)
    return FieldCodec(FieldEncoder(**kw), FieldDecoder(**kw), tasks)


@torch.no_grad()
def fit_field_scales(codec: FieldCodec, batches: Iterable[tuple[Fields, Tensor]]) -> dict[str, tuple[float, float]]:
    """Set each field's normalisation from training frames, in place, in both halves.

    ``batches``: (field names, u [B, F, *S]) pairs, read once. A field's mean and scale are the mean
    and the RMS about it of all its values in all batches (float64 sums: the order of the batches
    changes only their rounding); a field of constant value (RMS at most 1e-6 of |mean|) gets the
    scale |mean| (or 1 when zero). Fields absent from the batches keep theirs. Returns
    ``{name: (mean, scale)}`` of the fields fitted.
    """
    sums: dict[str, tuple[float, float, int]] = {}
    for fields, u in batches:
        values_FN = u.double().transpose(0, 1).flatten(1)
        for name, row in zip(fields, values_FN):
            s, ss, n = sums.get(name, (0.0, 0.0, 0))
            sums[name] = (s + float(row.sum()), ss + float(row.square().sum()), n + row.numel())
    fitted = {}
    for name, (s, ss, n) in sums.items():
        mean = s / n
        rms = math.sqrt(max(ss / n - mean * mean, 0.0))
        scale = rms if rms > 1e-6 * abs(mean) and rms > 0 else (abs(mean) or 1.0)
        for half in (codec.encoder, codec.decoder):
            half.scales.get_buffer(field_key(name)).copy_(torch.tensor([mean, scale]))
        fitted[name] = (mean, scale)
    return fitted
