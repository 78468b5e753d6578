"""How torch_msa talks to its users besides errors: one warning category and one logger.

* `TorchMSAWarning` (a `UserWarning`) is the category of every warning torch_msa emits, so a
  user can filter them as a group: `warnings.filterwarnings("ignore", category=TorchMSAWarning)`.
* `logger` is the `logging` logger named `"torch_msa"`. At INFO it says when a kernel is first
  compiled or tuned for a shape (a CuTe DSL compile takes seconds):
  `logging.getLogger("torch_msa").setLevel(logging.INFO)` with a handler, or `logging.basicConfig`.
"""

import logging

logger = logging.getLogger("torch_msa")


class TorchMSAWarning(UserWarning):
    """The category of torch_msa's warnings."""
