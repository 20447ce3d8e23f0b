"""Tensor parallelism of one executor group: how weights and heads split over the ranks
(``partition.py``), the ranks' process group and its collectives (``group.py``), and the rank
processes with rank 0 driving the others (``ranks.py``)."""
