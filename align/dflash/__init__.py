"""Training the feature-conditioned block-diffusion drafter (DFlash-style): batches that run every window of a
rollout in one drafter pass (:mod:`align.dflash.batch`) and the verifier's features cached on disk
(:mod:`align.dflash.cache`). Its model: ``align.models.dflash``; decoding: ``align.drafters.dflash``; docs/dflash.md."""
