"""``quant.auto``: mixed precision under a budget of average bits, with no extra passes.

Stochastic rounding at ``b`` bits adds independent, unbiased noise of variance ``step**2 / 6``
on average per element, where ``step = range / (2**b - 1)`` of the element's group. Where
the saved tensor ``x`` meets a weight in a contraction (linear, conv, a matmul with a
parameter), the weight gradient's error is

    E|dW|^2 = sum_n |g_n|^2 |dx_n|^2  ~  var(x) * K * |G|^2

with ``K`` the contraction length and ``G`` the op's output gradient. On the bench zoo's GPT
this predicts each linear input's share of the gradient error within 10% (the head's input
alone is 73% of it at 2 bits). Other ops reach the weights through the layers below; a
factor per kind of op stands in for that path (:data:`PATH_FACTOR`, set from the same
measurement). A loss's saved tensor (log-probabilities) goes through ``exp`` in the backward,
which turns noise into bias (measured: 99 times the 2-bit error at 1 bit); it stays at
:data:`LOSS_BITS`.

A save the engine recomputes from stored codes (a LayerNorm's or GELU's output, attention's
output: :mod:`torchstash.derive`) costs no bits but counts in the average, so the budget is
bits per element autograd saved; a save coded at a fixed width beside the allocation
(attention's ``q`` and ``k`` at 8 bits, a loss's at 4) counts at that width. A recomputed
save's error is its sources' noise carried through the op: each source's estimate gains the
consumer's ``K * |G|^2`` times the variance ratio of the output to the source (a
LayerNorm's ``(w * rstd)**2``, a GELU's mean ``f'**2``, roughly).

Both ingredients come free with a normal step: the group steps are the kernel's output and
``|G|^2`` is one reduction in a hook on the op's output. One step in every ``interval`` is
measured; at the start of the next, bits are re-allocated greedily (the largest error cut
per bit first) until the budget is spent. An allocation that gives every site the width the
one before gave it doubles the steps to the next measurement, up to ``max_interval``; one
that changes a width brings them back to ``interval``. A measured step and the one after it
run the engine's full path (the measurement watches each op's output) and the replay records
again after them: on the zoo's GPT three steps in twenty cost 10-70% more than a replayed
one while the allocation was measured every twenty steps. The state is keyed by site, so a
dynamic graph works: a site not seen before runs at its start width (``start_bits``, as far as the step
affords it: see below) until the next allocation, and a site not seen in a measured step drops
out of it.

A step's peak is what runs out of memory, so a step keeps to the budget before its first
allocation too: a site no allocation has measured takes its start width only where the step's
running average affords it (:class:`Running`), the output the engine will recompute from the
site's code counted ahead, and a weight's input goes one width below the default where the
step is over the budget (as the allocation pays for ``q``, ``k`` and a loss). On the heap
gauge's GPTs the first step held 1.16 to 1.33 times a later step's bytes with every start width
taken, 0.98 to 1.02 times now. What can still go over is what comes last: a loss coded at its
own width, or a start width whose output was not recomputed after all (the ecosystem's tiny
Llama and ViT: 1.04 and 1.05 times, from 1.13 and 1.15).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchstash.compressor import BaseCompressor
from torchstash.errors import OptionError
from torchstash.kernels import group_steps
from torchstash.packed import Packed
from torchstash.site import Site

from ._options import BITS, check_group_size
from .allocation import Allocation, Need, allocate
from .centered import center_rows
from .groupcode import OWN, GroupCode
from .groupwise import GroupQuantizer, with_offsets
from .rows import PLANE_NORM_OPS, ROW_NORM_OPS

#: ``max_interval``'s default, in ``interval``\ s: 20 steps double to 320 while the
#: allocation holds (GACT measures every 1000)
MAX_INTERVAL_FACTOR = 16

CONTRACTION_OPS = frozenset({"linear", "conv", "matmul"})
ELEMENTWISE_OPS = frozenset(
    {"gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "softplus", "mish", "hardswish"}
)
LOSS_OPS = frozenset(
    {
        "cross_entropy",
        "nll_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
    }
)

#: Factor on ``var * K * |G|^2`` for each kind of site (see the module docstring): the median,
#: over the bench zoo's GPT (small) at 2 bits (the ViT's are 10 to 80 times larger), of a site's true share of the gradient error
#: (that site alone quantized, 3 seeds) over the estimate, linear inputs being 1 by
#: construction (measured 0.89 to 1.14), rounded to a power of two. The spread within a kind
#: is wide for attention's operands (0.15 for ``v`` to 120 for ``q`` and ``k``).
PATH_FACTOR = {
    "weight": 1.0,  # the error lands in this op's weight gradient
    "activation": 16.0,  # q @ k.T, attn @ v, softmax: through the qkv projection (median 11)
    "elementwise": 64.0,  # GELU, SiLU...: f'' times the fan-in of the layer below (55 to 73)
    "norm": 2.0,  # rows aligned (see .rows); renormalized in the backward (0.6 to 2.5)
    "norm_unaligned": 256.0,  # groups straddle rows: the backward multiplies the error up
    "other": 1.0,
}


#: Kinds whose error ends in a weight gradient: the estimate is exact for them, and only they
#: go below the budget's width (the others' path factor varies with the model). At 1 bit the
#: noise is several times the signal, and two such codes on one backward path multiply
#: (measured on the GPT: attention's operands and softmax at 1 bit, each harmless alone,
#: together took the gradient's relative squared error from 0.09 to 0.55).
TERMINAL_KINDS = frozenset({"weight"})
#: Kinds kept at the uniform width: attention's operands' true factors spread from 0.15
#: (``v``, whose error is damped by the softmax backward) to 480 (``q`` and ``k`` on the
#: ViT), so one factor would waste bits on ``v`` (measured: the ViT's cosine fell below
#: uniform's when ``v`` was widened at the linear inputs' expense).
UNRANKED_KINDS = frozenset({"activation"})
#: The width of unranked sites per uniform width, when outputs are recomputed: attention at 4
#: bits below a budget of 4, as ``quant.int2`` stores it (at 2 bits it decides the demo's
#: final loss). Without recomputation it would leave the linear inputs 1 bit (measured: the
#: GPT's cosine 0.41), so there they stay at the uniform width.
UNRANKED_BITS = {2: 4}
#: The narrowest width of a site whose error travels on, whatever the budget.
PATH_FLOOR = 2
#: The ops whose weight's input may go to 1 bit (a weight-kind site of another op, a
#: convolution, keeps :data:`PATH_FLOOR`). On timm's EfficientNet-B0 the pointwise convs'
#: inputs went to 1 bit (their estimated errors the smallest), and along stock's SGD run the
#: allocated gradient's median cosine was 0.74 against ``quant.int2``'s 0.78 at the same bytes;
#: with no conv input below 2 bits, 0.80. MobileNetV3 lost 0.01 (0.94 to 0.93, int2 0.89);
#: ResNet-10t, ResNet-18 and ConvNeXt-atto were unchanged
#: (``python -m torchstash_bench.ecosystem_steps``).
ONE_BIT_OPS = frozenset({"linear", "matmul"})
#: Kinds whose inputs, where a batch norm made them, the allocation never gives less than
#: ``quant.int<b>``'s width (its start width, :attr:`AutoQuantizer.start_bits`). An
#: elementwise op's input error reaches the weights through the op's second derivative and
#: the layer below; its path factor, set on the GPT's GELU (after a linear), was several times
#: too small on timm's EfficientNet-B0 (SiLU after a batch norm, whose training backward
#: takes out the gradient's mean and its projection on the normalized input, not the noise):
#: allocated 2 bits, the gradient's cosine to stock was 0.36, against 0.63 for ``quant.int2``
#: at the same bytes, and 0.76 with them at ``quant.int2``'s 4 bits. Held so after a linear
#: too, the transformers lost (torchvision's ViT-B/16 0.77 to 0.76, Llama 0.84 to 0.77).
KIND_FLOORS = frozenset({"elementwise"})
#: The width of what a loss saves (see the module docstring).
LOSS_BITS = 4
#: Ops whose output the engine recomputes from their input's code under ``derive``
#: (``torchstash.derive``'s recipes): a start width there is paid for by that output, which
#: counts in the average at no bits.
RECOMPUTED_OPS = frozenset({"gelu", "silu", "hardswish", "layer_norm"})


#: The role of a product's right operand (contracted over its rows, ``x.shape[-2]``) where it
#: is not ``arg1``: ``addmm(bias, x, w)`` (Hugging Face's GPT-2 ``Conv1D``) has its left operand
#: at ``arg1``, and ``b.__rmatmul__(a)`` is ``a @ b``. Read as the left operand, ``addmm``'s input
#: was contracted over its batch rows, not its features: on a 2-layer GPT-2 (32 rows of 256
#: features into ``c_proj``) that gave the projection's input 1 bit and the gradient a cosine
#: of 0.63 against stock.
RIGHT_OPERAND = {"addmm": "arg2", "baddbmm": "arg2", "addbmm": "arg2", "__rmatmul__": "input"}


@dataclass(slots=True)
class SiteStats:
    numel: int
    kind: str
    contraction: int
    #: a width fixed outside the allocation (a loss's, attention's scores' operands'): it
    #: counts against the budget at that width
    pinned: int | None = None
    unit_var: torch.Tensor | None = None  # mean over elements of range**2 / 6
    grad_sq: torch.Tensor | None = None  # |G|^2 of the op's output
    grads: int = 0
    variance: torch.Tensor | None = None  # of the saved values (a recomputation's scale)
    #: a recomputed save: the sites of the codes it is recomputed from
    sources: tuple[str, ...] = ()
    #: the narrowest width the allocation may give it beside the kind's (see :data:`KIND_FLOORS`)
    floor: int = 0


@dataclass(slots=True)
class Running:
    """What the step has saved so far, in elements and bits: the widths of sites no
    allocation has measured keep its average within the budget."""

    elements: int = 0
    bits: int = 0
    #: per stored site, the elements of its output the engine will recompute from its code:
    #: counted ahead, and settled when that save comes
    owed: dict[str, int] = field(default_factory=dict)
    owing: int = 0

    def add(self, numel: int, bits: int) -> None:
        self.elements += numel
        self.bits += numel * bits

    def room(self, budget: float, numel: int) -> float:
        """The bits ``numel`` more elements may take with the step's average within budget."""
        return budget * (self.elements + self.owing + numel) - self.bits

    def expect(self, key: str, numel: int) -> None:
        self.owed[key] = numel
        self.owing += numel

    def settle(self, keys: list[str]) -> None:
        """The outputs of these sites came, recomputed: they count as elements now."""
        for key in keys:
            self.owing -= self.owed.pop(key, 0)


def site_kind(x: torch.Tensor, site: Site) -> tuple[str, int]:
    """(kind of path, contraction length) of the tensor ``x`` saved at ``site``."""
    op = site.op
    if op in CONTRACTION_OPS and x.dim() >= 1:
        weighted = op != "matmul" or site.opcall.has_parameter
        if op == "conv":
            weights = [a for a in site.opcall.args[1:2] if isinstance(a, torch.Tensor)]
            k = int(weights[0][0].numel()) if weights else int(x.shape[1] if x.dim() > 1 else 1)
        elif site.role == RIGHT_OPERAND.get(site.func, "arg1") and x.dim() >= 2:
            k = int(x.shape[-2])  # the right operand: contracted over its rows
        else:
            k = int(x.shape[-1])
        return ("weight" if weighted else "activation"), max(k, 1)
    if op in ELEMENTWISE_OPS:
        return "elementwise", 1
    if op in ROW_NORM_OPS or op in PLANE_NORM_OPS:
        return "norm", 1
    if op == "softmax":
        return "activation", 1
    return "other", 1


class AutoQuantizer(BaseCompressor):
    """Per-group stochastic quantization with bits chosen per site under an average budget."""

    lossless = False

    def __init__(
        self,
        budget: float = 2.0,
        bits: tuple[int, ...] = BITS,
        group_size: int = 256,
        interval: int = 20,
        stochastic: bool = True,
        seed: int | None = None,
        name: str = "quant.auto",
        max_interval: int | None = None,
    ) -> None:
        self.name = name
        candidates = tuple(sorted(set(bits))) if isinstance(bits, (tuple, list)) else ()
        if not candidates or any(b not in BITS for b in candidates):
            raise OptionError(
                f"{name}: option bits={bits!r} must be a tuple of widths from 1, 2, 4, 8"
            )
        if (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or not candidates[0] <= budget <= candidates[-1]
        ):
            raise OptionError(
                f"{name}: option budget={budget!r} (average bits per element) must be a number "
                f"from {candidates[0]} to {candidates[-1]}"
            )
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise OptionError(
                f"{name}: option interval={interval!r} (steps between allocations) must be a "
                f"positive integer"
            )
        self.budget = float(budget)
        self.candidates = candidates
        self.group_size = check_group_size(group_size, name)
        if max_interval is None:
            max_interval = interval * MAX_INTERVAL_FACTOR
        if (
            isinstance(max_interval, bool)
            or not isinstance(max_interval, int)
            or max_interval < interval
        ):
            raise OptionError(
                f"{name}: option max_interval={max_interval!r} (the most steps between "
                f"allocations that repeat) must be an integer of at least interval={interval}"
            )
        self.interval = interval
        self.max_interval = max_interval
        #: steps from one measured step to the next: ``interval``, doubled by each allocation
        #: that repeats the one before, up to ``max_interval``
        self._gap = interval
        #: the next step that measures
        self._due = interval - 1
        self.codec = GroupQuantizer(candidates[-1], self.group_size, stochastic, seed, name=name)
        self.default_bits = max(b for b in candidates if b <= budget)
        #: see :data:`UNRANKED_BITS` (set by :func:`~.strategies.auto` with ``derive``)
        self.unranked_bits: dict[int, int] = {}
        #: the width of a kind of site (``"elementwise"``, ``"norm"``) before any allocation
        #: has measured it, as ``quant.int<b>`` stores it, where the step affords it
        #: (:meth:`_width`; set by :func:`~.strategies.auto`):
        #: the first step of timm's EfficientNet-B0 with its SiLU inputs at 2 bits had a
        #: gradient cosine of 0.07 against stock, 0.62 with them at 4 like ``quant.int2``
        self.start_bits: dict[str, int] = {}
        #: the engine recomputes the outputs of :data:`RECOMPUTED_OPS` from the inputs coded
        #: here (set by :func:`~.strategies.auto`): they pay for their inputs' start widths
        self.derive = False
        self.stats: dict[str, SiteStats] = {}
        #: saves recomputed from codes stored here in the measured step (no bits of their own)
        self.recomputed: dict[str, SiteStats] = {}
        self.allocation = Allocation()
        self.steps = 0
        self._seen: set[str] = set()
        self._running = Running()
        self._measuring = True
        self._lock = threading.Lock()

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return self.codec.unsupported(x, site)

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        """A matmul's kind of path reads its call (:func:`site_kind`); what else a replayed
        save needs is its site's key and op."""
        return site.op != "matmul"

    def replays_next(self) -> bool:
        """Not a step that measures, nor the one after it, whose first save allocates anew:
        those take the full path (its op-call hooks watch the gradients) and record again."""
        with self._lock:
            upcoming = self.steps + 1 == self._due
            return not (self._measuring or upcoming)

    # -- steps ---------------------------------------------------------------------------------

    def _next_step(self) -> None:
        """A site came round again: the previous step's forward (and backward) are over."""
        self._seen.clear()
        self._running = Running()
        self.steps += 1
        if self._measuring:
            before = self.allocation.bits
            self._allocate()
            self.stats, self.recomputed = {}, {}
            if self.steps - 1 == self._due:  # not the first step's extra measurement
                same = bool(before) and self.allocation.bits == before
                self._gap = min(2 * self._gap, self.max_interval) if same else self.interval
                self._due += self._gap
        self._measuring = self.steps == self._due

    def _at_least(self, bits: int) -> int:
        return min((b for b in self.candidates if b >= bits), default=self.candidates[-1])

    def bits_for(self, site: Site) -> int:
        if site.op in LOSS_OPS:
            return self._at_least(LOSS_BITS)
        bits = self.allocation.bits.get(site.key)
        if bits is not None:
            return bits
        return self._start_width(site) or self.default_bits

    def _start_width(self, site: Site) -> int | None:
        """The width ``quant.int<b>`` gives this kind of site, where it differs (see
        :attr:`start_bits`)."""
        if self.start_bits and site.role == "input":
            if site.op in ELEMENTWISE_OPS:
                return self.start_bits.get("elementwise")
            if site.op == "layer_norm":
                return self.start_bits.get("norm")
        return None

    def _width(self, x: torch.Tensor, site: Site) -> int:
        """The width of a save (under the lock): the allocation's, else :meth:`bits_for`'s
        as far as the step's running average affords it (see :class:`Running`)."""
        preferred = self.bits_for(site)
        if site.key in self.allocation.bits or site.op in LOSS_OPS:
            return preferred
        numel = x.numel()
        recomputed = self.derive and site.op in RECOMPUTED_OPS and site.role == "input"
        credit = numel if recomputed else 0
        if credit:
            self._running.expect(site.key, credit)
        room = self._running.room(self.budget, numel)
        low = self._narrowest(x, site, preferred)
        fits = [b for b in self.candidates if low <= b <= preferred and b * numel <= room]
        return max(fits, default=low)

    def _narrowest(self, x: torch.Tensor, site: Site, preferred: int) -> int:
        """How far an unmeasured site may narrow to keep the step within the budget: a start
        width to the default; a weight's input one width below it, where the error ends (the
        allocation takes them lower); any other site not at all."""
        if preferred > self.default_bits:
            return self.default_bits
        if site_kind(x, site)[0] not in TERMINAL_KINDS:
            return preferred
        return max((b for b in self.candidates if b < preferred), default=preferred)

    # -- codec ---------------------------------------------------------------------------------

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        return self.compress_as(x, site, OWN)

    def compress_as(self, x: torch.Tensor, site: Site, code: GroupCode) -> Packed:
        """A :class:`~.groupcode.GroupCodec`: ``code.bits`` fixes the width (else the
        allocation's); ``code.rows`` as :meth:`GroupQuantizer.compress_as` (one kernel call),
        except in a measured step, whose statistics are of the centered values themselves."""
        rows, group_size = code.rows, code.group_size
        key = site.key
        with self._lock:
            if key in self._seen:
                self._next_step()
            self._seen.add(key)
            measuring = self._measuring
            width = code.bits or self._width(x, site)
            self._running.add(x.numel(), width)
        if rows is not None and measuring and x.numel() > 0:
            centered, offsets, constant, _ = center_rows(x, rows)
            packed = self.codec.compress_as(centered, site, GroupCode(width, group_size))
            self._measure(centered, site, packed, width, group_size is not None)
            return with_offsets(packed, x, offsets, constant)
        packed = self.codec.compress_as(x, site, GroupCode(width, group_size, rows))
        if measuring and x.numel() > 0:
            self._measure(x, site, packed, width, group_size is not None)
        return packed

    def encoder_as(self, site: Site, code: GroupCode) -> Callable[[torch.Tensor], Packed]:
        """:meth:`compress_as` at ``site``: the width is the allocation's at each call."""
        return functools.partial(self.compress_as, site=site, code=code)

    def decompress(self, packed: Packed) -> torch.Tensor:
        return self.codec.decompress(packed)

    # -- measurement ---------------------------------------------------------------------------

    def _measure(
        self, x: torch.Tensor, site: Site, packed: Packed, width: int, aligned: bool
    ) -> None:
        kind, contraction = site_kind(x, site)
        if kind == "norm" and not aligned:
            kind = "norm_unaligned"
        pinned = self._at_least(LOSS_BITS) if site.op in LOSS_OPS else None
        stats = SiteStats(x.numel(), kind, contraction, pinned=pinned)
        if kind in KIND_FLOORS and _made_by_batch_norm(site):
            stats.floor = self._start_width(site) or 0
        elif kind in TERMINAL_KINDS and site.op not in ONE_BIT_OPS:
            stats.floor = self._at_least(PATH_FLOOR)
        lo, step = packed.tensors["lo"], packed.tensors["step"]
        assert isinstance(lo, torch.Tensor) and isinstance(step, torch.Tensor)
        levels = float(2**width - 1)
        # NaN/Inf groups carry a negative step and are stored exactly: no rounding noise; a
        # group of subnormals stores its step scaled up (group_steps reads it unscaled).
        stats.unit_var = group_steps(lo, step).square().mean() * (levels * levels / 6)
        stats.variance = _variance(x)
        self.stats[site.key] = stats
        self._watch(stats, site)

    def fixed_width(self, x: torch.Tensor, site: Site, bits: int) -> None:
        """A save coded at ``bits`` by another codec beside this one (attention's ``q`` and
        ``k``, :data:`~.opaware.SCORES_BITS`): not allocated, but its bits count in the
        average, so the budget stays bits per element saved."""
        with self._lock:
            self._running.add(x.numel(), bits)
            if not self._measuring or x.numel() == 0:
                return
            kind, contraction = site_kind(x, site)
            self.stats[site.key] = SiteStats(x.numel(), kind, contraction, pinned=bits)

    def derived(self, x: torch.Tensor, site: Site, sources: list[Site]) -> None:
        """A save recomputed from codes stored here (see the module docstring)."""
        with self._lock:
            self._running.add(x.numel(), 0)
            self._running.settle([s.key for s in sources])
            if not self._measuring or x.numel() == 0:
                return
        kind, contraction = site_kind(x, site)
        stats = SiteStats(x.numel(), kind, contraction, sources=tuple(s.key for s in sources))
        stats.variance = _variance(x)
        self.recomputed[site.key] = stats
        self._watch(stats, site)

    def _watch(self, stats: SiteStats, site: Site) -> None:
        """Sum ``|G|^2`` of the op's output into ``stats`` in the backward."""

        def watch(result: object) -> None:
            out = result[0] if isinstance(result, (tuple, list)) and result else result
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._grad(stats, g))

        site.opcall.on_result(watch)

    @staticmethod
    def _grad(stats: SiteStats, g: torch.Tensor) -> None:
        sq = g.detach().float().square().sum()
        stats.grad_sq = sq if stats.grad_sq is None else stats.grad_sq + sq
        stats.grads += 1

    # -- allocation ----------------------------------------------------------------------------

    def sensitivity(self, stats: SiteStats) -> float:
        """Estimated squared gradient error of the site at "1 level" (divide by (2**b-1)**2)."""
        if stats.unit_var is None or stats.grad_sq is None:
            return 0.0
        return (
            float(stats.unit_var)
            * stats.contraction
            * float(stats.grad_sq)
            * PATH_FACTOR[stats.kind]
        )

    def _carried(self, measured: dict[str, SiteStats]) -> dict[str, float]:
        """Per source site, the estimated error its code causes in the saves recomputed from
        it (at one level, like :meth:`sensitivity`)."""
        extra: dict[str, float] = {}
        for r in self.recomputed.values():
            if r.grad_sq is None or r.variance is None or not r.sources:
                continue
            for key in r.sources:
                src = measured.get(key)
                if src is None or src.unit_var is None or src.variance is None:
                    continue
                gain = float(r.variance) / max(float(src.variance), 1e-30) / len(r.sources)
                extra[key] = extra.get(key, 0.0) + (
                    float(src.unit_var)
                    * gain
                    * r.contraction
                    * float(r.grad_sq)
                    * PATH_FACTOR[r.kind]
                )
        return extra

    def _allocate(self) -> None:
        measured = {k: s for k, s in self.stats.items() if s.grads > 0 or s.pinned is not None}
        sources = {k for r in self.recomputed.values() for k in r.sources}
        measured.update({k: s for k, s in self.stats.items() if k in sources})
        if not measured:
            return
        carried = self._carried(measured)
        free = sum(r.numel for r in self.recomputed.values())
        # Sites whose error travels on never go below the uniform width: their path factors
        # are the smallest measured across the zoo (the ViT's are 10 to 80 times the GPT's),
        # so the estimate is trusted to raise them, not to lower them.
        floor = self._at_least(max(PATH_FLOOR, self.default_bits))
        needs = {}
        for k, s in measured.items():
            if s.pinned is not None:  # its width is fixed, but it counts against the budget
                needs[k] = Need(s.numel, 0.0, s.pinned, ceiling=s.pinned)
            else:
                low = self.candidates[0] if s.kind in TERMINAL_KINDS else floor
                low = max(low, s.floor)
                high = self.candidates[-1]
                if s.kind in UNRANKED_KINDS:
                    width = self.unranked_bits.get(floor, floor)
                    low = high = self._at_least(max(floor, width))
                sens = self.sensitivity(s) + carried.get(k, 0.0)
                needs[k] = Need(s.numel, sens, low, ceiling=high)
        self.allocation = allocate(needs, self.candidates, self.budget, free=free)


def _variance(x: torch.Tensor) -> torch.Tensor:
    """The variance of ``x`` with its NaN and Inf read as zeros (one would make it
    meaningless). ``nan_to_num`` is one pass where ``isfinite`` and ``where`` took four (a
    measured step of the zoo's GPT spent 50 ms here)."""
    if x.numel() <= 1:
        return x.new_zeros((), dtype=torch.float32)
    if x.dtype == torch.float32:
        return torch.nan_to_num(x.detach(), 0.0, 0.0, 0.0).var()
    return x.detach().float().nan_to_num_(0.0, 0.0, 0.0).var()  # the copy is ours


def _made_by_batch_norm(site: Site) -> bool:
    """The op's input is a batch norm's output (its autograd node says so)."""
    first = site.opcall.args[0] if site.opcall.args else None
    node = first.grad_fn if isinstance(first, torch.Tensor) else None
    return node is not None and "BatchNorm" in type(node).__name__
