"""Training losses."""

from vldist.losses.hinge import hardest_negative_hinge, vse_hinge_loss

__all__ = ["vse_hinge_loss", "hardest_negative_hinge"]
