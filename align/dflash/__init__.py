"""The feature-conditioned block-diffusion drafter (DFlash-style): a few layers that draft a block in one pass from
the verifier's own hidden states (model: ``align.models.dflash``; decoding: :mod:`align.dflash.drafter`, loaded by
``align.loading.load_dflash_drafter``; training batches: :mod:`align.dflash.batch`; docs/dflash.md)."""

from align.dflash.drafter import FAMILY, DFlashDrafter, check_verifier, verifier_fingerprint

__all__ = ["FAMILY", "DFlashDrafter", "check_verifier", "verifier_fingerprint"]
