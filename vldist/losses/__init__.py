"""Training losses."""

from vldist.losses.contrastive_captioning import contrastive_captioning_loss, cross_rank_contrastive_captioning_loss
from vldist.losses.damsm import (
    cross_rank_damsm_loss,
    cross_rank_damsm_parts,
    damsm_loss,
    damsm_parts,
    word_region_scores,
)
from vldist.losses.distributed import (
    cross_rank_caption_nll,
    cross_rank_mean,
    cross_rank_token_nll,
    cross_rank_vse_hinge_loss,
)
from vldist.losses.hinge import hardest_negative_hinge, vse_hinge_loss
from vldist.losses.total_variation import total_variation_loss
from vldist.losses.two_branch import (
    cross_rank_phrase_ranking_loss,
    cross_rank_two_branch_ranking_loss,
    phrase_ranking_loss,
    two_branch_ranking_loss,
)

__all__ = [
    "vse_hinge_loss",
    "hardest_negative_hinge",
    "cross_rank_vse_hinge_loss",
    "cross_rank_token_nll",
    "cross_rank_caption_nll",
    "cross_rank_mean",
    "contrastive_captioning_loss",
    "cross_rank_contrastive_captioning_loss",
    "two_branch_ranking_loss",
    "cross_rank_two_branch_ranking_loss",
    "phrase_ranking_loss",
    "cross_rank_phrase_ranking_loss",
    "total_variation_loss",
    "damsm_loss",
    "damsm_parts",
    "cross_rank_damsm_loss",
    "cross_rank_damsm_parts",
    "word_region_scores",
]
