"""``quant.auto``'s allocator: bits for each site with the least estimated gradient error
under a budget of average bits (see :mod:`.auto` for the estimate and when it runs)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class Allocation:
    """The bits of each site from the last allocation, with the figures behind them."""

    bits: dict[str, int] = field(default_factory=dict)
    average: float = 0.0
    #: estimated gradient error (squared) per site at its allocated bits
    error: dict[str, float] = field(default_factory=dict)
    #: elements recomputed from the sites' codes: in the average, at no bits
    free: int = 0


#: At one bit the two levels are the group's ends, and the rounding variance is
#: E[(x - lo)(hi - x)], not step**2 / 6: for bell-shaped groups about 1.3 times as much
#: (measured on the GPT: a linear input's error at 1 bit is 11.7 times its 2-bit error, 9
#: by step**2 alone).
ONE_BIT_EXCESS = 1.3


def level_error(sensitivity: float, bits: int) -> float:
    """Estimated squared gradient error at ``bits`` of a site with this sensitivity."""
    return sensitivity * (ONE_BIT_EXCESS if bits == 1 else 1.0) / float(2**bits - 1) ** 2


@dataclass(frozen=True, slots=True)
class Need:
    """What the allocator knows of a site."""

    numel: int
    sensitivity: float  # squared gradient error at one level (divided by (2**b - 1) ** 2)
    floor: int  # the narrowest width it may get
    ceiling: int = 8  # the widest


def allocate(
    sites: dict[str, Need], candidates: tuple[int, ...], budget: float, free: int = 0
) -> Allocation:
    """Bits for ``sites`` with the least total estimated error, the average within ``budget``
    (floors above the budget win over it); ``free`` more elements count in the average at no
    bits (saves recomputed from the sites' codes).

    Widths come in chunks (a site goes from 2 to 4 bits at once), so one greedy order can
    strand budget; several starts are each filled greedily and the best is kept: the floors,
    the uniform width (so the result is never worse than uniform, by the estimate), and the
    choices of a sweep of Lagrange multipliers (error + price * bits, per site); then pairs of
    one widening paid for by one narrowing are tried until none helps.
    """
    total = sum(need.numel for need in sites.values()) + free
    limit = budget * total
    allowed = {
        k: [b for b in candidates if need.floor <= b <= max(need.floor, need.ceiling)]
        or [need.floor]
        for k, need in sites.items()
    }
    uniform = max((b for b in candidates if b <= budget), default=candidates[0])
    at_uniform = {k: min(max(uniform, bs[0]), bs[-1]) for k, bs in allowed.items()}
    allowed = _no_site_over(sites, allowed, at_uniform)
    starts = [{k: bs[0] for k, bs in allowed.items()}, at_uniform]
    sens = [need.sensitivity / need.numel for need in sites.values() if need.sensitivity > 0]
    if sens:
        lo, hi = min(sens) * 1e-6, max(sens) * 10.0
        for i in range(48):
            price = lo * (hi / lo) ** (i / 47)
            starts.append({k: _cheapest(sites[k], bs, price) for k, bs in allowed.items()})
    best: dict[str, int] | None = None
    best_error = float("inf")
    for start in starts:
        if sum(sites[k].numel * b for k, b in start.items()) > limit and start is not starts[0]:
            continue
        bits = _swap(sites, _fill(sites, dict(start), allowed, limit), allowed, limit)
        err = sum(level_error(sites[k].sensitivity, b) for k, b in bits.items())
        if err < best_error:
            best, best_error = bits, err
    assert best is not None
    spent = sum(sites[k].numel * b for k, b in best.items())
    return Allocation(
        bits=best,
        average=spent / total if total else 0.0,
        error={k: level_error(sites[k].sensitivity, b) for k, b in best.items()},
        free=free,
    )


def _no_site_over(
    sites: dict[str, Need], allowed: dict[str, list[int]], at_uniform: dict[str, int]
) -> dict[str, list[int]]:
    """``allowed`` less the widths at which one site's estimated error alone would exceed the
    uniform width's total: where the floors and the fixed widths leave no room, the budget
    was met by the one site still free to narrow (Hugging Face's GPT-2: its hand-written
    GELU's four saves held at their floor, the MLP's output projection's input went to 1 bit,
    four times the uniform code's whole error, and the gradient's cosine to stock fell from
    0.94 at ``quant.int2`` to 0.63). The floors win over the budget then, as they do anyway."""
    total = sum(level_error(sites[k].sensitivity, b) for k, b in at_uniform.items())
    return {
        k: [b for b in bs if level_error(sites[k].sensitivity, b) <= total] or bs[-1:]
        for k, bs in allowed.items()
    }


def _cheapest(need: Need, options: list[int], price: float) -> int:
    """The width with the least error plus ``price`` per stored bit."""
    return min(options, key=lambda b: level_error(need.sensitivity, b) + price * need.numel * b)


def _fill(
    sites: dict[str, Need], bits: dict[str, int], allowed: dict[str, list[int]], limit: float
) -> dict[str, int]:
    """Widen greedily from ``bits``: the most estimated error removed per added bit first."""
    spent = sum(sites[k].numel * b for k, b in bits.items())

    def upgrade(key: str) -> tuple[float, str, int] | None:
        options = allowed[key]
        b = bits[key]
        if b >= options[-1]:
            return None
        nxt = options[options.index(b) + 1]
        sens, numel = sites[key].sensitivity, sites[key].numel
        gain = (level_error(sens, b) - level_error(sens, nxt)) / (numel * (nxt - b))
        return (-gain, key, nxt)

    heap = [u for u in map(upgrade, sites) if u is not None]
    heapq.heapify(heap)
    while heap:
        neg_gain, key, nxt = heapq.heappop(heap)
        extra = sites[key].numel * (nxt - bits[key])
        if spent + extra > limit or neg_gain == 0.0:
            continue
        bits[key] = nxt
        spent += extra
        u = upgrade(key)
        if u is not None:
            heapq.heappush(heap, u)
    return bits


def _swap(
    sites: dict[str, Need],
    bits: dict[str, int],
    allowed: dict[str, list[int]],
    limit: float,
    rounds: int = 64,
    width: int = 24,
) -> dict[str, int]:
    """Improve ``bits`` by widening one site, paid for by narrowing the sites that lose the
    least error per freed bit; the best such move first, until none helps."""
    spent = float(sum(sites[k].numel * b for k, b in bits.items()))
    for _ in range(rounds):
        ups, downs = [], []
        for k, b in bits.items():
            options, need = allowed[k], sites[k]
            i = options.index(b)
            now = level_error(need.sensitivity, b)
            if i + 1 < len(options):
                nb = options[i + 1]
                gain = now - level_error(need.sensitivity, nb)
                ups.append((gain / (need.numel * (nb - b)), gain, need.numel * (nb - b), k, nb))
            if i > 0:
                nb = options[i - 1]
                loss = level_error(need.sensitivity, nb) - now
                downs.append((loss / (need.numel * (b - nb)), loss, need.numel * (b - nb), k, nb))
        ups.sort(reverse=True)
        downs.sort()
        best: tuple[float, list[tuple[str, int]], float] | None = None
        for _, gain, cost, ku, bu in ups[:width]:
            need_free, lost, moves = spent + cost - limit, 0.0, [(ku, bu)]
            for _, loss, freed, kd, bd in downs:
                if need_free <= 0 or lost >= gain:
                    break
                if kd != ku:
                    need_free -= freed
                    lost += loss
                    moves.append((kd, bd))
            net = gain - lost
            if need_free <= 0 and net > 1e-12 * gain and (best is None or net > best[0]):
                delta = sum(sites[k].numel * (b - bits[k]) for k, b in moves)
                best = (net, moves, delta)
        if best is None:
            break
        for k, b in best[1]:
            bits[k] = b
        spent += best[2]
    return bits
