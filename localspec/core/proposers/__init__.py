"""Proposers guess the next tokens cheaply; the engine verifies their guesses with the target."""

from localspec.core.proposers.base import Proposer
from localspec.core.proposers.draft_model import DraftModelProposer
from localspec.core.proposers.ngram import NgramProposer

__all__ = ["Proposer", "NgramProposer", "DraftModelProposer"]
