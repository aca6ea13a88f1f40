"""The core README's budget table: ``torchstash.apply(model, budget_mb=...)`` on the bench zoo's
GPT (small, batch 8, CPU, one thread) at 1/2, 1/4, 1/8 and 1/16 of stock's saved bytes."""

from __future__ import annotations

import torch

import torchstash as ts
from torchstash.budget import MB
from torchstash.errors import ApplyError
from torchstash.testing.models import zoo


def main() -> None:
    torch.set_num_threads(1)
    entry = next(z for z in zoo("small") if z.name == "gpt")
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(8, torch.device("cpu"))

    def step(m: torch.nn.Module) -> torch.Tensor:
        return entry.loss(m, x, y)

    with ts.apply(model, "none") as h:
        step(model).backward()
        stock = h.tally.stored_bytes
    model.zero_grad(set_to_none=True)
    print(f"stock saves {stock / MB:.2f} MB")
    for fraction in (2, 4, 8, 16):
        budget = stock / fraction / MB
        try:
            with ts.apply(model, budget_mb=budget, example=step) as h:
                plan = h.budget
                assert plan is not None
                chosen = sorted({c.strategy for c in plan.choices}) or plan.rules
                print(
                    f"1/{fraction} ({budget:.2f} MB): {plan.measured_bytes / MB:.2f} MB, "
                    f"cosine {plan.measured_cosine:.4f}, {chosen}"
                )
        except ApplyError as e:
            print(f"1/{fraction} ({budget:.2f} MB): {e}")


if __name__ == "__main__":
    main()
