"""The scaling ladder (``densetrain ladder``): the runs that measure this recipe's scaling law on this data.

- :mod:`~densetrain.tools.ladder.grid`: sizes scaled from a config, isoFLOP budgets, one WSD run per size
  with cooldown branches;
- :mod:`~densetrain.tools.ladder.launcher`: the resumable ladder directory, local runs, cluster commands;
- :mod:`~densetrain.tools.ladder.fit`: ``ladder fit``, the laws (:mod:`densetrain.law`) into ``fit.json``;
- :mod:`~densetrain.tools.ladder.command`: the command line (the scaling panel: :mod:`densetrain.report.ladder`).

Predictions for a run and the on-track alarm read ``fit.json`` in training (:mod:`densetrain.train.watch.curve`).
Nothing is imported here: ``densetrain --help`` builds the command line without loading torch.
"""
