"""localspec: lossless speculative decoding for one user's chat on their own machine."""

__version__ = "0.1.0"
