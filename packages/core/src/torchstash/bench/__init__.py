"""The lab: what measures torchstash, kept apart from the library it measures.

``harness`` runs the bench zoo (``torchstash bench``), ``compare`` sets torchstash beside
checkpointing and the published methods (``torchstash bench --compare``), ``demo`` trains
the small GPT (``torchstash demo``), ``zoo`` holds the models they share, and ``quant``,
``quant_persample``, ``dropit`` and ``memsave`` measure each plug-in's README figures
(``python -m torchstash.bench.quant``). The library never imports this package (an import
contract in the lint session checks it); only the command line does.
"""
