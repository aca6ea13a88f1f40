"""Outputs recomputed from a stored input: the engine's side of :mod:`torchstash.derive`.

While a :data:`~torchstash.derive.DERIVE_OPS` call saves its operands, their entries are
collected (:class:`Derivation`); when it returns, its output gets a recipe over them, carried
through layout and pointwise ops, and a later save of that output (or of a view, a cast) is
kept as the recipe: no bytes of its own. A fused attention's output and log-sum-exp are
replayed from its stored ``q``, ``k``, ``v``, or every lossy code of the call is made exact.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..casts import cast_of
from ..compressor import Compressor, recomputes_into
from ..derive import (
    DERIVE_OPS,
    FUSED,
    SDPA,
    Recipe,
    fused_attention,
    matmul_order,
    recipe,
    save_kind,
)
from ..opnames import CARRY_OPS
from ..optrack import STATE as OP_STATE
from ..optrack import on_result
from ..packed import Packed
from ..replaystep import replay_step
from ..site import Site
from .entries import RELEASED, Entry, Recomputed, dedupe_key, version_alias
from .messages import FUSED_EXACT_REASON
from .tally import Row, Tally

if TYPE_CHECKING:
    from .replay import Recorder

#: a recipe's operands: each entry (held weakly) and the shape its op saved it in
Sources = tuple[tuple["weakref.ref[Entry]", torch.Size], ...]

#: Ops whose saved first operand may be autocast's cast of it: those autocast runs in a
#: lower precision, and the normalizations CUDA's autocast runs in float32 (a LayerNorm
#: after a GELU saves a float32 copy of the GELU's bf16 output).
AUTOCAST_CASTING_OPS = frozenset({"linear", "matmul", "conv", "layer_norm", "group_norm"})


@dataclass
class Derivation:
    """The call of a :data:`DERIVE_OPS` op whose saves are being collected: its recipe, and
    for each operand saved, its entry, the shape saved and its role."""

    call_id: int
    recipe: Recipe
    sources: list[tuple[weakref.ref[Entry], torch.Size, str]] = field(default_factory=list)
    #: False once an operand is stored in a way its output cannot be recomputed from
    derivable: bool = True
    #: what the op saved of its own outputs (a fused attention's output and log-sum-exp)
    outputs: list[tuple[Entry, torch.Size]] = field(default_factory=list)


class DeriveState(Protocol):
    """What recomputation keeps per thread (:class:`~.scope.ThreadState`): the derive op call
    whose saves are being collected."""

    deriving: Derivation | None
    #: the forward being recorded, or None
    recorder: Recorder | None


class Recomputation:
    """The engine's recomputation of outputs (a part of :class:`~.core.Engine`)."""

    _skip: set[int]
    dedupe: bool
    #: outputs a later save may recompute: key -> (the output, its recipe, the operands'
    #: entries with their saved shapes)
    _recipes: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Recipe, Sources]]

    if TYPE_CHECKING:

        @property
        def _tls(self) -> DeriveState: ...
        @property
        def tally(self) -> Tally: ...
        def _store_as_is(self, entry: Entry, t: torch.Tensor) -> None: ...

    def _note_derive_save(
        self, t: torch.Tensor, entry: Entry, compressor: Compressor | None, site: Site
    ) -> None:
        """Collect what a :data:`DERIVE_OPS` call saves: its operands (a GELU's input, both
        of an ``attn @ v``), and a LayerNorm's statistics. When the call returns, its output
        becomes recomputable (:meth:`_offer_recipe`) if every operand was stored by a
        compressor whose code is fine to recompute from."""
        if not self.dedupe or site.op not in DERIVE_OPS:
            return
        tls, call_id = self._tls, OP_STATE.call_id
        d = tls.deriving
        if d is not None and d.call_id != call_id:
            d = tls.deriving = None  # an earlier call that raised
        kind = save_kind(site.op, site.role, t, OP_STATE.args)
        if kind == "source":
            if d is None:
                rec = recipe(site.op, OP_STATE.args, OP_STATE.kwargs, OP_STATE.raw)
                if rec is None:
                    return
                d = tls.deriving = Derivation(call_id, rec)
                on_result(functools.partial(self._offer_recipe, d, site.op))
            derivable = getattr(compressor, "derivable", None)
            d.derivable = (
                d.derivable
                and compressor is not None
                and entry.compressor is compressor
                and isinstance(entry.value, (Packed, Recomputed))
                and derivable is not None
                and bool(derivable(t, site))
            )
            role = site.role
            if site.op == SDPA:  # q, k, v in the call's order (the kernel saves k first)
                role = ("input", "arg1", "arg2")[site.opcall.position(t) or 0]
            d.sources.append((weakref.ref(entry), t.shape, role))
        elif kind == "output" and d is not None:  # a fused attention's, after q, k, v
            d.outputs.append((entry, t.shape))
        elif kind == "stat" and d is not None:  # saved after its input (mean, rstd)
            if isinstance(entry.value, torch.Tensor) and entry.value is not RELEASED:
                d.recipe.stats.append(entry.value)
            else:
                d.recipe.usable = False  # a code, not the tensor: no exact statistics

    def _offer_recipe(self, d: Derivation, op: str, result: Any) -> None:
        """The derive call returned: make its output recomputable from its operands' entries."""
        tls, rec = self._tls, d.recipe
        if tls.deriving is d:
            tls.deriving = None
        if op == SDPA:
            self._settle_fused_attention(d, result)
            return
        if not isinstance(result, torch.Tensor) or result.numel() == 0 or not d.derivable:
            return
        if not rec.usable or len(d.sources) != rec.arity:
            return
        if len(rec.stats) != rec.stats_needed:
            return  # a LayerNorm or BatchNorm needs its statistics, kept exact
        sources = [(ref, shape) for ref, shape, _ in d.sources]
        if op == "matmul":
            order = matmul_order(
                [tuple(shape) for _, shape, _ in d.sources],
                [role for _, _, role in d.sources],
                tuple(result.shape),
            )
            if order is None:
                return
            sources = [sources[i] for i in order]
        rec.dtype, rec.shape = result.dtype, result.shape
        self._add_recipe(result, rec, tuple(sources))

    def _settle_fused_attention(self, d: Derivation, result: Any) -> None:
        """A fused attention returned. Its backward reads ``q``, ``k``, ``v``, its output and
        its log-sum-exp together (the map from the first two and the third, the row sums
        from the output): codes of some beside exact others disagree, and training diverged
        (an SDPA GPT at 300 steps: int4 +44%, fp8 NaN). So either the output and log-sum-exp
        are recomputed from the stored ``q``, ``k``, ``v`` by the same kernel in backward
        (:data:`~.derive.FUSED_ATTENTION`, no dropout), or every lossy code of the call is
        turned back into its exact tensor."""
        order = {"input": 0, "arg1": 1, "arg2": 2}
        d.sources.sort(key=lambda source: order.get(source[2], 3))
        entries = [ref() for ref, _, _ in d.sources]
        replay = None
        if isinstance(result, torch.Tensor) and result.numel() and d.recipe.usable:
            replay = fused_attention(result, d.recipe)
        shapes = {tuple(shape) for _, shape in d.outputs}
        if (
            replay is not None
            and d.derivable
            and len(entries) == 3
            and all(e is not None and e.value is not RELEASED for e in entries)
            and [role for _, _, role in d.sources] == ["input", "arg1", "arg2"]
            and len(d.outputs) == 2
            and shapes == {tuple(result.shape), tuple(result.shape[:-1])}
        ):
            sources = [(e, shape) for e, (_, shape, _) in zip(entries, d.sources) if e is not None]
            for entry, shape in d.outputs:
                which = 0 if tuple(shape) == tuple(result.shape) else 1
                rec = Recipe(FUSED, {"replay": replay, "which": which}, arity=3)
                self._recompute_from(entry, sources, rec, shape)
            out = next(e for e, shape in d.outputs if tuple(shape) == tuple(result.shape))
            self._add_recipe(result, Recipe(SDPA, {}), ((weakref.ref(out), result.shape),))
            return
        for coded in [*entries, *(e for e, _ in d.outputs)]:
            if coded is None or not isinstance(coded.value, Packed):
                continue
            if coded.compressor is None or coded.compressor.lossless:
                continue
            exact = coded.source()
            if exact is not None:
                row = self.tally.row(coded.site)
                before = (row.stored_bytes, row.held_bytes)
                self._store_as_is(coded, exact)
                coded.reason = FUSED_EXACT_REASON
                row.declined[FUSED_EXACT_REASON] += 1
                recorder = self._tls.recorder
                if recorder is not None:
                    stored, held = row.stored_bytes - before[0], row.held_bytes - before[1]
                    recorder.restate(coded, stored, held)

    def _recompute_from(
        self,
        entry: Entry,
        sources: list[tuple[Entry, torch.Size]],
        rec: Recipe,
        shape: torch.Size,
    ) -> None:
        """Turn a stored entry into a recipe over ``sources`` (a fused attention's output
        once the call returned): its bytes are given back, and it no longer counts as
        declined."""
        row = self.tally.row(entry.site)
        before = (row.stored_bytes, row.held_bytes)
        value = entry.value
        if isinstance(value, Packed):
            row.compressed -= 1
            self.tally.drop(row, value, entry)
        elif isinstance(value, torch.Tensor):
            self.tally.drop(row, value, entry)
            counted = entry.watch is not None  # a code's alias, kept when it became the tensor
            entry.watch = version_alias(value)
            if entry.watch is not None and not counted:
                self.tally.keep_alias(row, entry.watch)
        if entry.reason:
            row.declined[entry.reason] -= 1
            if row.declined[entry.reason] <= 0:
                del row.declined[entry.reason]
            entry.reason = ""
        compressor = sources[0][0].compressor
        entry.value = Recomputed(sources, rec, shape)
        entry.compressor = compressor
        recorder = self._tls.recorder
        if recorder is not None:
            recorder.restate(entry, row.stored_bytes - before[0], row.held_bytes - before[1])
        if compressor is not None:
            self._derive(
                value if isinstance(value, torch.Tensor) else None,
                sources,
                compressor,
                entry.site,
                row,
            )

    def _derive(
        self,
        t: torch.Tensor | None,
        sources: list[tuple[Entry, torch.Size]],
        compressor: Compressor,
        site: Site,
        row: Row,
    ) -> None:
        """Count a save recomputed from ``sources``, which it will restore once each, and tell
        the compressor that stored them (``derived``: its budget counts it)."""
        for source, _ in sources:
            source.pending += 1
        row.derived += 1
        told = getattr(compressor, "derived", None)
        if told is not None and t is not None:
            told(t, site, [source.site for source, _ in sources])

    def _add_recipe(self, result: torch.Tensor, rec: Recipe, sources: Sources) -> None:
        key = dedupe_key(result)
        recipes = self._recipes

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            # The output is gone, so no later save can match it: drop the recipe (and the
            # statistics it holds) now, not when the table next grows.
            found = recipes.get(key)
            if found is not None and found[0] is ref:
                del recipes[key]

        recipes[key] = (weakref.ref(result, forget), rec, sources)

    def _carry_recipe(
        self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], result: Any
    ) -> None:
        """A layout or elementwise op (:data:`~.derive.CARRY_OPS`) on a recomputable tensor:
        its result is recomputable too, by the same recipe one step longer (``attn @ v``,
        transposed and copied into the projection's input; a BatchNorm's output through an
        in-place ReLU; ``q @ k.T`` scaled and masked)."""
        if not self._recipes or not args or not isinstance(result, torch.Tensor):
            return
        carried = self._carried(func, args, kwargs, result)
        if carried is not None:
            self._add_recipe(result, *carried)

    def _carried(
        self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], result: torch.Tensor
    ) -> tuple[Recipe, Sources] | None:
        """The recipe of ``result``, one step longer than that of the argument it was computed
        from (the one tensor argument of its size with a recipe), or None."""
        if result.numel() == 0:
            return None
        hits = ((i, self._recipe_before(x, result)) for i, x in enumerate(args))
        index, found = next(((i, f) for i, f in hits if f is not None), (0, None))
        if found is None:
            return None
        same = self._recipes.get(dedupe_key(result))
        if same is not None and same[0]() is not None:
            # A view of the same values in the same layout (a fused attention's output,
            # transposed back to contiguous, then reshaped): already recomputable. Held by
            # this newer view now, so the recipe outlives the temporary one before it.
            return same[1], same[2]
        step = replay_step(func, args, kwargs, index)
        return None if step is None else (found[1].then(step), found[2])

    def _recipe_before(
        self, x: object, result: torch.Tensor
    ) -> tuple[weakref.ref[torch.Tensor], Recipe, Sources] | None:
        """The recipe of argument ``x`` of the call that made ``result``, if it has one."""
        if not isinstance(x, torch.Tensor) or x.numel() != result.numel():
            return None
        before = dedupe_key(x)
        if result is x:  # in place (a ReLU's): x as it was is one version back
            before = (*before[:-1], before[-1] - 1)
        found = self._recipes.get(before)
        return found if found is not None and found[0]() is not None else None

    def _recomputed(
        self,
        t: torch.Tensor,
        key: tuple[Any, ...],
        compressor: Compressor,
        site: Site,
        row: Row,
    ) -> Entry | None:
        """An entry recomputing ``t`` from the stored input of the op that made it, when that
        op offered a recipe and its input is stored by the same compressor (or as is)."""
        found = self._recipe_for(t, key, compressor, site)
        if found is None:
            return None
        rec, sources = found
        self._derive(t, sources, compressor, site, row)
        return Entry(Recomputed(sources, rec, t.shape), compressor, site, t._version, t, watched=t)

    def _recipe_for(
        self, t: torch.Tensor, key: tuple[Any, ...], compressor: Compressor, site: Site
    ) -> tuple[Recipe, list[tuple[Entry, torch.Size]]] | None:
        """The recipe that recomputes ``t`` and the entries it reads, or None (see
        :meth:`_recomputed`, which then counts them; nothing is counted here)."""
        found = self._recipes.get(key) or self._autocast_copy(t, site)
        if found is None or found[0]() is None:
            carried = self._carried_in_call(t, site)
            if carried is None:
                return None
            rec, source_refs = carried
        else:
            rec, source_refs = found[1], found[2]
        sources = []
        for source_ref, shape in source_refs:
            source = source_ref()
            if (
                source is None
                or source.value is RELEASED
                or (source.compressor is not compressor and source.compressor is not None)
                or not recomputes_into(compressor, source.site.op, site.op)
            ):
                return None
            sources.append((source, shape))
        return rec, sources

    def _carried_in_call(self, t: torch.Tensor, site: Site) -> tuple[Recipe, Sources] | None:
        """The output a carrying op saves itself (a softmax keeps its result): recomputable
        when its argument is, by the argument's recipe followed by the op (the result watcher
        sees the op only once it returned, after this save)."""
        func = OP_STATE.func
        if site.role != "output" or func is None or OP_STATE.raw not in CARRY_OPS:
            return None
        return self._carried(func, OP_STATE.args, OP_STATE.kwargs, t)

    def _autocast_copy(
        self, t: torch.Tensor, site: Site
    ) -> tuple[weakref.ref[torch.Tensor], Recipe, Sources] | None:
        """Under autocast a projection saves its input cast to the autocast dtype, a copy no
        recipe names (a LayerNorm's fp32 output, cast to bf16 inside ``linear``). When
        autograd's graph shows the saved tensor is a view of such a cast of the op's first
        argument (:func:`cast_of`), it is the argument's recipe, cast the same way."""
        if site.op not in AUTOCAST_CASTING_OPS or not OP_STATE.args:
            return None
        x = OP_STATE.args[0]
        if not isinstance(x, torch.Tensor) or not cast_of(t, x):
            return None
        found = self._recipes.get(dedupe_key(x))
        if found is None or found[0]() is None:
            return None
        ref, rec, sources = found
        dtype = t.dtype
        return ref, rec.then(lambda y: y.to(dtype)), sources
