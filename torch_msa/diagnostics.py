"""How torch_msa talks to its users besides errors: `TorchMSAWarning`, the category of all its
warnings, and `logger` (`"torch_msa"`), which at INFO says when a kernel is first compiled or tuned.
"""

import logging

logger = logging.getLogger("torch_msa")


class TorchMSAWarning(UserWarning):
    """The category of torch_msa's warnings."""
