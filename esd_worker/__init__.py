"""Analyse the weight spectra of one model; importing this package does not import torch."""

__version__ = "0.1.0"
