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

The fields arrive in datasets (a key the caller chooses, one PDE's data, and its field names in
channel order). Each dataset normalises each of its fields by its own mean and scale (a buffer table
per dataset, fitted from its training frames by ``fit_field_scales`` before training), so fields of
very different magnitudes meet in one model at one scale; a name two datasets share is one field,
one embedding, with two normalisations (a flow's velocity may be 100 times another's).

Token count rule: L per frame is fixed per spatial dimension (``tokens``: {d: L_d}) and does not
depend on the grid or the number of fields. A d-dimensional field is cut into L_d = S ** d equal
cells (S per axis; 2D needs L a power of 4, 3D a power of 8: Morton order), so a cell of a grid of
n points per axis holds n / S points per axis: the patch size follows from the grid. Giving 1D and
2D the same L (e.g. 64: 64 cells of a line, 8 x 8 cells of a square) gives every task the same
token count, and one operator steps them all. ``modes`` m_d per axis fixes the patch embedding's
input (K = m ** d numbers per cell and field); m = the points per cell and axis of the training grid
keeps every point of it.

Adding a dataset (``add_dataset``) appends its normalisation and embeddings of its new fields and
touches no existing parameter or buffer; a known dataset reads only its own fields' embeddings and
its own table, so its encode and decode stay bitwise equal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.models.grid_codec import NDIMS, cells_per_axis, eval_cells, fit_cells
from core.models.layers import MixerBlock, Mlp, morton_permutation
from core.models.registry import DESCRIPTION_ATTR, register
from core.models.settings import SETTINGS, heads_divide, positive

DATASET_PREFIX = "d_"
"""Prefix of a dataset's key in the normalisation tables (see ``EMBED_PREFIX``)."""
EMBED_PREFIX = "f_"
"""Prefix of a field's key in the embedding tables: keeps a field named like a module attribute
(``keys``, ``update``) from clashing with it."""


Fields = tuple[str, ...] | list[str]
"""Field names, in the order of a field tensor's channels."""
Datasets = list[tuple[str, Fields]] | list[list]
"""(dataset key, its field names in channel order) pairs, in the order the codec learned them."""


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


def dataset_buffer_key(key: str) -> str:
    """The key of dataset ``key``'s normalisation table in each half (and so in the state dict):
    ``d_`` and the key with every character outside [A-Za-z0-9_] replaced by ``_``."""
    return DATASET_PREFIX + re.sub(r"[^0-9A-Za-z_]", "_", key)


class _DatasetScales(nn.Module):
    """Each dataset's normalisation of its fields, ``(u - mean) / scale``: a buffer ``d_<key>`` =
    [F, 2] rows of (mean, scale), one per field of the dataset in its channel order (saved with the
    weights; set by ``fit_field_scales``; a dataset not fitted has 0 and 1)."""

    def __init__(self, datasets: Datasets) -> None:
        super().__init__()
        self.fields: dict[str, tuple[str, ...]] = {}
        for key, fields in datasets:
            self.add(key, fields)

    def add(self, key: str, fields: Fields) -> None:
        """A new dataset ``key`` of ``fields`` at mean 0, scale 1; a known key (or one whose buffer
        key another has) or a field twice is a ValueError."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"a dataset key is a non-empty string, got {key!r}")
        other = {dataset_buffer_key(k): k for k in self.fields}.get(dataset_buffer_key(key))
        if other is not None:
            raise ValueError(f"dataset {key!r} is already known" if other == key else
                             f"dataset keys {other!r} and {key!r} share the table {dataset_buffer_key(key)!r}; "
                             f"rename one")
        names = tuple(check_fields(fields))
        if not names:
            raise ValueError(f"dataset {key!r} has no fields")
        self.fields[key] = names
        self.register_buffer(dataset_buffer_key(key), torch.tensor([[0.0, 1.0]] * len(names)))

    def table(self, key: str) -> Tensor:
        """Dataset ``key``'s [F, 2] buffer (unknown: a ValueError naming the known ones)."""
        if key not in self.fields:
            raise ValueError(f"codec knows datasets {list(self.fields)}; got {key!r} (a new dataset needs add_dataset)")
        return self.get_buffer(dataset_buffer_key(key))

    def of(self, key: str, fields: Fields | None) -> tuple[tuple[str, ...], Tensor, Tensor]:
        """(the field names, mean [F], scale [F] fp32) of ``fields``, some of dataset ``key``'s in any
        order (None: all of them, in its order); a field it lacks is a ValueError."""
        table, own = self.table(key), self.fields[key]
        fields = own if fields is None else tuple(fields)
        if any(n not in own for n in fields):
            raise ValueError(f"dataset {key!r} has fields {list(own)}; got {list(fields)}")
        ms = table[[own.index(n) for n in fields]].float()
        return fields, ms[:, 0], ms[:, 1]


class _FieldHalf(nn.Module):
    """What both halves hold: the field names (every dataset's, each once, in the datasets' order),
    one embedding per field, one normalisation table per dataset, the cell layout and the
    per-dimension positions and mixer."""

    def __init__(self, datasets: Datasets, tokens: dict[int, int], modes: dict[int, int], hidden: int, depth: int,
                 heads: int) -> None:
        super().__init__()
        datasets = [(key, tuple(fields)) for key, fields in datasets]
        if not datasets:
            raise ValueError("a field codec needs at least one dataset (a key and its field names)")
        self.fields = check_fields(list(dict.fromkeys(n for _, fields in datasets for n in fields)))
        self.tokens, self.cells = _layout(tokens, modes)
        self.modes = dict(modes)
        self.ndims = tuple(sorted(self.tokens))
        self.embed = nn.ParameterDict({field_key(n): nn.Parameter(torch.empty(hidden)) for n in self.fields})
        for p in self.embed.values():
            nn.init.normal_(p, std=1.0)
        self.scales = _DatasetScales(datasets)
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
            raise ValueError(f"codec knows fields {self.fields}; got {list(fields)} (a new field needs add_dataset)")
        return torch.stack([self.embed[field_key(n)] for n in fields])

    def add(self, key: str, fields: Fields, *, generator: torch.Generator | None, noise: float) -> list[str]:
        """Append dataset ``key`` of ``fields`` (normalisation mean 0, scale 1) and an embedding for each
        of its fields not yet known: the mean of the existing ones, plus ``noise`` times a normal draw
        from ``generator`` when one is given. Existing parameters and buffers are not touched. Returns
        the new field names."""
        self.scales.add(key, fields)
        names = check_fields([n for n in fields if n not in self.fields], self.fields)
        for name in names:
            self.embed[field_key(name)] = nn.Parameter(torch.empty_like(self.embed[field_key(self.fields[0])]))
        old = list(self.fields)
        self.fields.extend(names)
        if names:
            self.start_new(names, old, generator=generator, noise=noise)
        return names

    @torch.no_grad()
    def start_new(self, names: list[str], old: list[str], *, generator: torch.Generator | None = None,
                  noise: float = 0.02) -> None:
        """Set the embeddings of ``names`` (fields this half has) to the mean of the embeddings of
        ``old``, plus ``noise`` times a normal draw from ``generator`` when one is given: what a field
        new to a trained codec starts from. The fields of ``old`` are not touched."""
        mean = self.embeddings(old).mean(0)
        for name in names:
            init = mean.clone()
            if generator is not None:
                init += noise * torch.randn(mean.shape, generator=generator, device=generator.device).to(mean)
            self.embed[field_key(name)].copy_(init)

    def _dim(self, d: int) -> int:
        if d not in self.ndims:
            raise ValueError(f"codec built for spatial dimensions {self.ndims}, got a {d}-dimensional field")
        return d


class FieldEncoder(_FieldHalf):
    """A dataset's named fields -> tokens. ``u_BFS`` of ``dataset`` (its fields, or the F names
    ``fields``, in the order of u's channels) -> ``z_BLD``."""

    def __init__(self, datasets: Datasets, tokens: dict[int, int], modes: dict[int, int], dim: int, hidden: int,
                 depth: int, heads: int) -> None:
        super().__init__(datasets, tokens, modes, hidden, depth, heads)
        self.heads = heads
        self.patch = nn.ModuleDict({f"{d}d": nn.Linear(self.modes[d] ** d, hidden) for d in self.ndims})
        self.lift_norm = nn.LayerNorm(hidden)
        self.lift = Mlp(hidden, 2 * hidden)
        self.score = nn.Linear(hidden, heads, bias=False)  # a bias shared by all fields cancels in the softmax
        self.value = nn.Linear(hidden, hidden)
        self.merged = nn.Linear(hidden, hidden)
        self.out_norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, u: Tensor, dataset: str, fields: Fields | None = None) -> Tensor:
        """u: [B, F, *S] (1, 2 or 3 spatial axes) of ``dataset`` (its normalisation), fields: F names
        of its fields (None: all of them, in its order) -> z_BLD [B, L_d, D]."""
        d = self._dim(u.ndim - 2)
        fields, mean_F, scale_F = self.scales.of(dataset, fields)
        if u.shape[1] != len(fields):
            raise ValueError(f"a field tensor of {u.shape[1]} channels needs as many names, got {list(fields)}")
        e_FH = self.embeddings(fields)
        shape = (-1,) + (1,) * d
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
    """Tokens -> a dataset's named fields. ``(z_BLD, dataset, grid_shape, fields)`` -> ``u_BFS``, one
    channel per requested field (None: the dataset's, in its order), in the dataset's units."""

    def __init__(self, datasets: Datasets, tokens: dict[int, int], modes: dict[int, int], dim: int, hidden: int,
                 depth: int, heads: int) -> None:
        super().__init__(datasets, tokens, modes, hidden, depth, heads)
        self.inp = nn.Linear(dim, hidden)
        self.query_norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.film = nn.Linear(hidden, 2 * hidden)
        self.read_norm = nn.LayerNorm(hidden)
        self.read = Mlp(hidden, 2 * hidden)
        self.head = nn.ModuleDict({f"{d}d": nn.Linear(hidden, self.modes[d] ** d) for d in self.ndims})
        for layer in self.head.values():  # a fresh decoder returns zeros: nRMSE 1, not a random field's
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, z_BLD: Tensor, dataset: str, grid_shape: tuple[int, ...],
                fields: Fields | None = None) -> Tensor:
        """z_BLD [B, L_d, D], ``dataset`` (its normalisation), grid_shape (X,), (X, Y) or (X, Y, Z),
        fields: F names of its fields (None: all of them, in its order) -> u [B, F, *grid_shape]."""
        d = self._dim(len(grid_shape))
        fields, mean_F, scale_F = self.scales.of(dataset, fields)
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
        shape = (-1,) + (1,) * d
        return u * scale_F.view(shape) + mean_F.view(shape)


class FieldView(nn.Module):
    """A field codec bound to one dataset (its fields, in its channel order, and its normalisation),
    with the interface of a codec of one field set (``core.models.autoencoder.Autoencoder``):
    ``encode(u)``, ``decode(z, grid_shape)``, ``view(u) -> (z, u_hat)``, and halves ``encoder(u)``
    and ``decoder(z, grid_shape)``. Holds no parameters of its own: it calls the codec it was made
    from (a module, so an exported program that wraps a view sees the codec's parameters; never
    saved: save the codec)."""

    def __init__(self, codec: FieldCodec, dataset: str) -> None:
        super().__init__()
        self.fields = codec.datasets.get(dataset)
        if self.fields is None:  # an unknown dataset fails here, not at the first batch
            raise ValueError(f"codec knows datasets {list(codec.datasets)}; got {dataset!r}")
        self.codec, self.dataset = codec, dataset

    def encoder(self, u: Tensor) -> Tensor:
        """u: [B, F, *S] -> z: [B, L, D]."""
        return self.codec.encoder(u, self.dataset)

    def decoder(self, z: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """z: [B, L, D] -> u: [B, F, *grid_shape]."""
        return self.codec.decoder(z, self.dataset, tuple(grid_shape))

    encode, decode = encoder, decoder

    def forward(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """u: [B, F, *S] -> (z [B, L, D], u_hat [B, F, *S])."""
        return self.codec(u, self.dataset)


class FieldCodec(nn.Module):
    """Holds ``encoder`` (FieldEncoder) and ``decoder`` (FieldDecoder): kept apart, as the grid
    codec's halves are, so a stage can load or export one alone.

    A dataset (a key the caller chooses: one PDE's data) names its fields in channel order and has
    its own normalisation; two datasets may share a field name, and so its embedding, while each
    keeps its own mean and scale (a velocity 100 times smaller in one flow than in another).
    ``tasks`` names the dataset of each task id of the run (the stack's batches carry task ids):
    ``forward(u, task_id_B)`` reads that dataset, ``for_task(i)`` binds it.
    """

    partial_graph = True
    """A batch uses only its task's field embeddings and its dimension's patch embedding, head and
    positions: data parallelism must expect parameters without gradients (DDP's unused-parameter search)."""

    def __init__(self, encoder: FieldEncoder, decoder: FieldDecoder, tasks: list[str] | None = None) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.tasks = list(tasks or [])
        unknown = [t for t in self.tasks if t not in encoder.scales.fields]
        if unknown:
            raise ValueError(f"tasks name datasets the codec does not know: {unknown}; known {list(self.datasets)}")

    @property
    def datasets(self) -> dict[str, tuple[str, ...]]:
        """Each dataset's field names in channel order, in the order they were added (a copy)."""
        return dict(self.encoder.scales.fields)

    @property
    def fields(self) -> list[str]:
        """The field names the codec knows, in the order they were added (a copy)."""
        return list(self.encoder.fields)

    def for_dataset(self, dataset: str) -> FieldView:
        """The codec bound to ``dataset``, with the one-field-set interface."""
        return FieldView(self, dataset)

    def for_task(self, task_id: int) -> FieldView:
        """The codec bound to the dataset of task ``task_id`` of the run (``tasks``)."""
        if not 0 <= task_id < len(self.tasks):
            raise ValueError(f"the codec's run has task ids 0..{len(self.tasks) - 1}, got {task_id}")
        return FieldView(self, self.tasks[task_id])

    def dataset_of(self, dataset: str | int | Tensor) -> str:
        """A dataset key as given, that of task id ``dataset`` (an int, known on the host), or that of
        the task of a task-id tensor [B] (every id the same: the stack's batches hold one task each).
        An id outside ``tasks`` or a mixed batch is a ValueError."""
        if isinstance(dataset, str):
            return dataset
        # A tensor costs one host sync per batch: the dataset selects parameters, so it must be known on
        # the host. An int costs none (and is the only form a tensor without values, a fake one, can give).
        ids = [dataset] if isinstance(dataset, int) else dataset.unique().tolist()
        if len(ids) != 1 or not 0 <= ids[0] < len(self.tasks):
            raise ValueError(f"a field codec's batch holds one task of ids 0..{len(self.tasks) - 1}, got ids {ids}")
        return self.tasks[ids[0]]

    def encode(self, u: Tensor, dataset: str, fields: Fields | None = None) -> Tensor:
        """u: [B, F, *S] of ``dataset`` (its fields, or the F names ``fields``) -> z: [B, L, D]."""
        return self.encoder(u, dataset, fields)

    def decode(self, z: Tensor, dataset: str, grid_shape: tuple[int, ...], fields: Fields | None = None) -> Tensor:
        """z: [B, L, D] -> u: [B, F, *grid_shape], exactly the named fields of ``dataset`` in that order
        (None: all of its fields), in its units."""
        return self.decoder(z, dataset, tuple(grid_shape), fields)

    def forward(self, u: Tensor, dataset: str | int | Tensor, fields: Fields | None = None,
                step: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, ...]:
        """u: [B, F, *S] of ``dataset`` (a key, a task id, or the task ids [B] of one task: ``dataset_of``), its
        fields or the F names ``fields`` -> (z [B, L, D], u_hat [B, F, *S]) on the input's own grid; with
        ``step`` (z_BLD -> z_BLD, e.g. a frozen operator's step) also the decoding of ``step(z)``, a third
        [B, F, *S]: one forward, so data parallelism sees every use of the codec's weights in it."""
        dataset = self.dataset_of(dataset)
        z = self.encoder(u, dataset, fields)
        u_hat = self.decoder(z, dataset, tuple(u.shape[2:]), fields)
        if step is None:
            return z, u_hat
        return z, u_hat, self.decoder(step(z), dataset, tuple(u.shape[2:]), fields)

    def add_dataset(self, key: str, fields: list[str] | tuple[str, ...], *, generator: torch.Generator | None = None,
                    noise: float = 0.02) -> None:
        """Append dataset ``key`` of ``fields`` to both halves (the fine-tuning of a run on data it never
        saw): its normalisation starts at mean 0, scale 1 (``fit_field_scales`` sets it from its data),
        and each of its fields the codec does not know gets an embedding in each half, started at the
        mean of the existing embeddings of its half, plus ``noise`` times a normal draw from
        ``generator`` when one is given (None: the mean alone). No existing parameter or buffer
        changes, so a known dataset encodes and decodes bitwise as before. The description
        (``registry.describe``) lists the new dataset, so a rebuild has it. An optimizer made before
        this call does not hold the new parameters. A known key is a ValueError.
        """
        self.encoder.add(key, fields, generator=generator, noise=noise)
        self.decoder.add(key, fields, generator=generator, noise=noise)
        description = getattr(self, DESCRIPTION_ATTR, None)
        if description is not None:
            description["args"]["datasets"] = [[k, list(f)] for k, f in self.datasets.items()]

    def start_new_fields(self, names: list[str] | tuple[str, ...]) -> None:
        """Start the fields ``names`` of this codec (built with them, its other fields' weights
        loaded from a trained codec) as ``add_dataset`` starts a new field: each half's embedding at
        the mean of its other fields'. Nothing else changes (a new dataset's normalisation is built
        at mean 0, scale 1)."""
        unknown = [n for n in names if n not in self.fields]
        if unknown:
            raise ValueError(f"codec knows fields {self.fields}; cannot start {unknown}")
        old = [n for n in self.fields if n not in names]
        if not old:
            raise ValueError("start_new_fields needs at least one trained field to start from")
        for half in (self.encoder, self.decoder):
            half.start_new(list(names), old)


@register("codec", "fields", settings=FieldCodecSettings, stack_args=("datasets", "tokens", "modes", "tasks"))
def field_autoencoder(datasets: list[list], dim: int, tokens: dict[str, int], modes: dict[str, int], hidden: int = 64,
                      depth: int = 2, heads: int = 4, tasks: list[str] | None = None) -> FieldCodec:
    """The field codec from plain JSON arguments.

    Args:
        datasets: ``[[key, [field names]], ...]``: each dataset's key and its fields in channel order
            (each field gets an embedding in each half, each dataset a normalisation table).
        dim: D, latent token width.
        tokens: ``{"d": L_d}``, tokens per frame of a d-dimensional field (JSON keys are strings);
            its keys are the spatial dimensions the codec serves.
        modes: ``{"d": m}``, cosine modes per axis of that dimension's cells (same keys).
        hidden, depth, heads: ``FieldCodecSettings``.
        tasks: the dataset key of each task id of the run (``FieldCodec.tasks``).
    Returns:
        ``FieldCodec(FieldEncoder, FieldDecoder)``.
    """
    FieldCodecSettings(hidden=hidden, depth=depth, heads=heads)
    pairs = [(key, list(fields)) for key, fields in datasets]
    per_dim = {int(d): n for d, n in tokens.items()}
    per_dim_modes = {int(d): m for d, m in modes.items()}
    kw = dict(datasets=pairs, tokens=per_dim, modes=per_dim_modes, dim=dim, hidden=hidden, depth=depth, heads=heads)
    return FieldCodec(FieldEncoder(**kw), FieldDecoder(**kw), tasks)


@torch.no_grad()
def fit_field_scales(codec: FieldCodec,
                     batches: Iterable[tuple[str, Tensor]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Set each dataset's normalisation of its fields from its training frames, in place, in both halves.

    ``batches``: (dataset key, u [B, F, *S] of all its fields in its order) pairs, read once. A
    field's mean and scale are the mean and the RMS about it of all its values in all batches of
    its dataset (float64 sums: the order of the batches changes only their rounding); a field of
    constant value (RMS at most 1e-6 of |mean|) gets the scale |mean| (or 1 when zero). Datasets
    absent from the batches keep theirs. Returns ``{dataset: {field: (mean, scale)}}`` of those fitted.
    """
    sums: dict[str, list[tuple[float, float, int]]] = {}
    for key, u in batches:
        names = codec.datasets.get(key)
        if names is None or u.shape[1] != len(names):
            raise ValueError(f"fit_field_scales: dataset {key!r} with {u.shape[1]} channels; the codec has "
                             f"{codec.datasets}")
        values_FN = u.double().transpose(0, 1).flatten(1)
        old = sums.get(key, [(0.0, 0.0, 0)] * len(names))
        sums[key] = [(s + float(row.sum()), ss + float(row.square().sum()), n + row.numel())
                     for (s, ss, n), row in zip(old, values_FN, strict=True)]
    fitted = {}
    for key, per_field in sums.items():
        rows = []
        for s, ss, n in per_field:
            mean = s / n
            rms = math.sqrt(max(ss / n - mean * mean, 0.0))
            rows.append((mean, rms if rms > 1e-6 * abs(mean) and rms > 0 else (abs(mean) or 1.0)))
        for half in (codec.encoder, codec.decoder):
            half.scales.table(key).copy_(torch.tensor(rows))
        fitted[key] = dict(zip(codec.datasets[key], rows, strict=True))
    return fitted
