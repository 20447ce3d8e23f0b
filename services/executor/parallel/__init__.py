"""Tensor parallelism below the layers: how weights and heads split over the ranks
(``partition.py``) and the ranks' process group with its collectives (``group.py``). It imports
neither the layers, the models nor the runner; the rank processes that drive a runner are
``services/executor/tp_group/``."""
