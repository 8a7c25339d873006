"""Evaluation metrics."""

from vldist.metrics.retrieval import retrieval_protocols, retrieval_recall

__all__ = ["retrieval_recall", "retrieval_protocols"]
