"""Proposers guess the next tokens cheaply; the engine verifies their guesses with the target."""

from localspec.proposers.base import Proposer
from localspec.proposers.draft_model import DraftModelProposer
from localspec.proposers.ngram import NgramProposer

__all__ = ["Proposer", "NgramProposer", "DraftModelProposer"]
