"""The lab: what measures torchstash, in a distribution of its own (``torchstash-bench``).

``harness`` runs the bench zoo (``torchstash bench``), ``compare`` sets torchstash beside
checkpointing and the published methods (``torchstash bench --compare``), ``demo`` trains
the small GPT (``torchstash demo``), ``speed`` times each strategy's step against stock's,
``ecosystem`` runs models users bring, and ``quant``, ``quant_persample``, ``dropit`` and
``memsave`` measure each plug-in's README figures (``python -m torchstash_bench.quant``).
The zoo's models live in the core (:mod:`torchstash.testing.models`), where tests import
them too. Nothing in the core or a plug-in imports this package (an import contract in the
lint session checks it): the ``torchstash`` command finds ``bench`` and ``demo`` through the
``torchstash.commands`` entry points this distribution declares.
"""
