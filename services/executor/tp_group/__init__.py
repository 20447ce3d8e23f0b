"""The processes of one tensor-parallel executor group, above the model runner they drive:
the rank processes, how each step reaches every rank and the settings they must share
(``ranks.py``), and rank 0's hold on the others: forming, watching and stopping them
(``rank_zero.py``). The collectives and the partitioning the layers use are below the layers,
in ``services/executor/parallel/``."""
