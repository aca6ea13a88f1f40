"""The engine's replay (:mod:`torchstash.engine.replay`) on the models users bring: after its
recording steps a replayed training step is the full path's, bit for bit (gradients) and byte
for byte (every row of the tally), under every strategy, on Hugging Face,
timm and torchvision models built from configs (nothing downloaded). The batch changes every
step (dropout draws included), as in training."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash_bench.ecosystem import MODELS, Unavailable, fresh, gradients, loss_at

STRATEGIES = ("none", "memsave", "quant.int8", "quant.int2", "quant.auto", "quant.fp8")
STEPS = 5


def rows(tally: ts.Tally) -> dict[str, tuple[object, ...]]:
    return {
        k: (r.saved, r.shared, r.raw_bytes, r.stored_bytes, r.held_bytes, r.compressed, r.derived)
        for k, r in tally.rows.items()
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_replayed_step_is_the_full_paths(name: str, strategy: str) -> None:
    spec = MODELS[name]
    if strategy == "memsave" and spec.memsave[0] == "error":
        pytest.skip(f"memsave: {spec.memsave[1]}")
    try:
        full, ours = fresh(spec), fresh(spec)
    except Unavailable as e:
        pytest.skip(str(e))
    handles = []
    try:
        for model in (full, ours):
            torch.manual_seed(7)  # the codes' seeds
            handles.append(ts.apply(model, strategy))
        handles[0].engine.replayer.enabled = False
        for step in range(STEPS):
            got = []
            for model, handle in zip((full, ours), handles, strict=True):
                handle.tally.reset()
                model.zero_grad(set_to_none=True)
                loss_at(spec, model, step).backward()
                got.append((gradients(model), rows(handle.tally)))
            (want, want_rows), (have, have_rows) = got
            assert have.keys() == want.keys()
            for k in want:
                assert torch.equal(have[k], want[k]), (step, k)
            assert have_rows == want_rows, step
        # every model replays: attention's codes, which read the op call, in their
        # modules' calls (regions) and the rest without the op tracker
        assert handles[1].engine.replayer.replayed > 0
    finally:
        for h in handles:
            h.remove()
