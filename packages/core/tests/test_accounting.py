"""Byte accounting against what the process holds: storages, not views, on both sides.

Stock PyTorch keeps a saved tensor's storage, whole, once however many saved tensors view it;
a strategy keeps its payloads' storages, whole. ``raw_bytes`` and ``stored_bytes`` count
exactly that (the glibc heap gauge, :mod:`torchstash.testing.heap`, checks them on models).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import torchstash as ts
from torchstash.packed import (
    CPU_ALLOCATION,
    CUDA_ALLOCATION,
    EXACT_ALLOCATION,
    Packed,
    StorageLedger,
    allocation,
    storage_nbytes,
)
from torchstash.testing import heap

N = 64 * 64 * 4  # bytes of a 64x64 float32 tensor


def test_a_view_of_a_saved_tensor_adds_no_raw_bytes() -> None:
    """``x @ x.t()`` saves x and its transpose: one storage. Stock holds it once; torchstash
    stores the two layouts as two entries, both as is, so it holds it once too (both sides
    counted it twice before)."""
    a = torch.randn(64, 64, requires_grad=True)
    with ts.stash("none", min_bytes=0) as s:
        x = a * 2  # saves nothing of x
        loss = (x @ x.t()).sum()
    assert s.tally.raw_bytes == N
    assert s.tally.stored_bytes == N
    assert sum(r.saved for r in s.tally.rows.values()) == 2
    # held: the storage's chunk and record once, a tensor's record for each entry
    assert s.tally.held_bytes == CPU_ALLOCATION.held(N) + CPU_ALLOCATION.tensor
    loss.backward()


def test_a_saved_slice_counts_its_whole_storage() -> None:
    """``x[:8] @ w`` saves a slice of x: the graph holds all of x's storage (the gauge sees
    it), so stock's bytes are x's, not the slice's 2 KiB."""
    a = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with ts.stash("none", min_bytes=0) as s:
        loss = ((a * 2)[:8] @ w).sum()
    assert s.tally.raw_bytes == s.tally.stored_bytes == N
    loss.backward()
    if heap.available():
        held = heap.held_by_graph(lambda: ((a * 2)[:8] @ w).sum())
        assert N <= held < N + 4096


def test_entries_of_one_storage_under_a_codec(toy_strategies: list[str]) -> None:
    """Under test.clone the two layouts of x are two copies (x and a contiguous x.t()): the
    codec holds them both, stock holds x once."""
    a = torch.randn(64, 64, requires_grad=True)
    with ts.stash("test.clone", min_bytes=0) as s:
        loss = ((a * 2) @ (a * 2).t()).sum()  # two different tensors: two storages
    assert s.tally.raw_bytes == 2 * N
    with ts.stash("test.clone", min_bytes=0) as s:
        x = a * 2
        loss = (x @ x.t()).sum()
    assert s.tally.raw_bytes == N
    assert s.tally.stored_bytes == 2 * N
    loss.backward()


def test_a_code_turned_into_the_tensor_counts_its_storage(toy_strategies: list[str]) -> None:
    """GELU's input is coded (test.half), then a matmul saves the same tensor as is (rule
    ``none``): the entry drops its code and holds the tensor, counted once."""
    a = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    rules = [{"strategy": "test.half"}, {"op": "matmul", "strategy": "none"}]
    with ts.stash(policy=rules, min_bytes=0) as s:
        x = a * 2
        loss = (F.gelu(x) + x @ w).sum()
    rows = list(s.tally.rows.values())
    assert s.tally.raw_bytes == N
    assert s.tally.stored_bytes == N
    # the tensor, and the version alias the code kept beside it (a record and an empty storage)
    alias = CPU_ALLOCATION.tensor + CPU_ALLOCATION.storage
    assert s.tally.held_bytes == CPU_ALLOCATION.held(N) + alias
    assert sum(r.compressed for r in rows) == 0
    assert sum(r.shared for r in rows) == 1
    loss.backward()


def test_packed_nbytes_counts_storages_whole_and_once() -> None:
    """A payload that views part of a buffer holds the buffer; two views of one buffer hold it
    once; a nested record's payload counts too."""
    x = torch.randn(4, 64)
    buf = torch.empty(300, dtype=torch.uint8)
    inner = Packed.like(x, "inner", scale=torch.empty(8, dtype=torch.bfloat16))
    p = Packed.like(x, "outer", codes=buf[:256], tail=buf[256:], inner=inner)
    assert p.nbytes() == 300 + 16
    assert p.nbytes("cpu") == 316
    assert p.nbytes("cuda") == 0


def test_storage_nbytes() -> None:
    x = torch.empty(10, 10)
    assert storage_nbytes(x) == 400
    assert storage_nbytes(x[2:4, ::2]) == 400
    assert storage_nbytes(torch.empty(0)) == 0
    assert storage_nbytes(torch.empty(3, 4, device="meta")) == 48  # no memory: its elements


class _Owner:
    """Stands for an entry: something held weakly."""


def test_ledger_counts_a_storage_once_while_its_owner_lives() -> None:
    ledger = StorageLedger()
    x = torch.empty(256)
    owner = _Owner()
    assert ledger.count(x, owner) == 1024
    assert ledger.count(x.view(16, 16), _Owner()) == 0  # a view of it
    assert ledger.count(x[10:20], _Owner()) == 0  # a slice of it
    assert ledger.count(x.clone(), _Owner()) == 1024  # another storage
    del owner
    gc.collect()
    assert ledger.count(x, _Owner()) == 1024  # the owner (a freed graph's entry) is gone


def test_ledger_counts_a_reused_address_again() -> None:
    """A storage freed while its owner lives (the tensor was coded, the original dropped) may
    leave its address to a new storage: that one counts (stock would hold both)."""
    ledger = StorageLedger()
    owner = _Owner()
    x = torch.empty(4096)
    assert ledger.count(x, owner) == 16384
    del x
    y = torch.empty(4096)  # often at the same address
    assert ledger.count(y, owner) == 16384


def test_ledger_counts_a_packed_payload() -> None:
    ledger = StorageLedger()
    buf = torch.empty(100, dtype=torch.uint8)
    p = Packed.like(torch.empty(3), "c", a=buf[:50], b=buf[50:])
    owner = _Owner()
    assert ledger.count(p, owner) == 100
    assert ledger.count(buf, owner) == 0


def test_ledger_keeps_no_freed_storage_in_the_heap() -> None:
    """A record must not keep a freed storage's StorageImpl alive: records outlive their step,
    and those small chunks, among the next steps' tensor buffers, fragment glibc's heap (a
    6-layer MLP under ``none`` grew the process by 25 to 190 MB over 600 steps)."""
    if not heap.available():
        pytest.skip(heap.why_unavailable())
    owner = _Owner()
    ledgers = [StorageLedger() for _ in range(64)]
    gc.collect()
    before = heap.heap_bytes()
    for ledger in ledgers:
        for _ in range(16):
            ledger.count(torch.empty(64), owner)  # freed at once, its record stays
    # per record: the ledgers' dict tables (about 36 bytes), and 112 more or over when the
    # freed StorageImpl is kept
    assert heap.heap_bytes() - before < 64 * 16 * 80


def test_allocation_rules() -> None:
    """CUDA's caching allocator holds 512-byte blocks and no record on the device; the CPU's
    a 16-byte rounded chunk with an 8-byte header, 32 at least, and the records."""
    assert [CUDA_ALLOCATION.held(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    records = CPU_ALLOCATION.tensor + CPU_ALLOCATION.storage
    assert [CPU_ALLOCATION.held(n) - records for n in (1, 24, 25, 1000)] == [32, 32, 48, 1008]
    assert CPU_ALLOCATION.held(0) == CPU_ALLOCATION.tensor  # a storage counted already
    assert allocation(torch.device("cpu")) is CPU_ALLOCATION
    assert allocation(torch.device("cuda", 1)) is CUDA_ALLOCATION
    assert allocation(torch.device("meta")) is EXACT_ALLOCATION
    assert EXACT_ALLOCATION.held(1000) == 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nbytes", [1, 512, 1000, 70000])
def test_the_cuda_rule_is_what_the_caching_allocator_holds(nbytes: int) -> None:
    before = torch.cuda.memory_allocated()
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() - before == CUDA_ALLOCATION.held(nbytes)
    del x


def test_a_report_shows_what_the_allocator_holds(toy_strategies: list[str]) -> None:
    """measure() reports the payload (stored) and what the allocator holds for it (held): on
    a model of small tensors under test.half, each record and chunk shows."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 16)
    report = ts.measure(model, lambda: model(x).sum().backward(), "test.half", repeat=1)
    assert report.held_bytes == sum(r.held_bytes for r in report.rows)
    assert report.held_bytes > report.stored_bytes > 0
    assert report.to_dict()["held_bytes"] == report.held_bytes
    assert "held MB" in str(report)


@pytest.mark.parametrize("dedupe", [True, False])
def test_raw_is_stock_with_and_without_dedupe(dedupe: bool) -> None:
    """Raw bytes are stock's whatever the engine shares: a view adds nothing either way."""
    from torchstash.engine import Engine

    engine = Engine(lambda site, types: None, min_bytes=0, dedupe=dedupe)
    a = torch.randn(64, 64, requires_grad=True)
    with engine.activated():
        x = a * 2
        loss = (x @ x.t()).sum()
    assert engine.tally.raw_bytes == N
    assert engine.tally.stored_bytes == N
    loss.backward()
