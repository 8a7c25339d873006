"""Evaluation metrics."""

from vldist.errors import CaptionMetricsError, JavaNotFoundError
from vldist.metrics.captions import caption_scores, release_meteor_jvm
from vldist.metrics.phrase_localization import phrase_localization_recall
from vldist.metrics.r_precision import aimcos, r_precision
from vldist.metrics.retrieval import retrieval_protocols, retrieval_recall
from vldist.metrics.self_retrieval import self_retrieval_recall
from vldist.metrics.sentence_retrieval import sentence_to_sentence_recall

__all__ = [
    "retrieval_recall",
    "retrieval_protocols",
    "caption_scores",
    "release_meteor_jvm",
    "CaptionMetricsError",
    "JavaNotFoundError",
    "self_retrieval_recall",
    "sentence_to_sentence_recall",
    "phrase_localization_recall",
    "r_precision",
    "aimcos",
]
