"""align: make diffusion drafters agree with autoregressive verifiers, so speculative decoding accepts more."""

__version__ = "0.1.0"
