"""densetrain: the complete recipe for pretraining dense decoder-only language models.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless already set: with OpenMP's default
busy-wait, idle worker threads spin, and on a 2-core machine a second busy process then made
2-thread training about 6x slower. It has to happen before torch loads its OpenMP runtime, hence here.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
