"""The standard alternative: a same-size autoregressive drafter, trained on the same rollouts for the same time.

    python -m align.baseline train --run runs/tiny --out runs/tiny/ar [--seconds S | --steps N] [--seed 0] [--lr LR]
    python -m align.baseline eval --drafter runs/tiny/ar [--diffusion runs/tiny/final] [--limit 48] [--gamma 16]

``train`` reads the run's ``recipe.yaml``, loads the very rollouts that run was trained on (and holds out the same
prompts as ``align/train.py``), builds a causal Llama with the verifier's tokenizer, tied embeddings and a
parameter count matched to the run's diffusion drafter, and trains it from scratch by next-token cross-entropy on
``prompt ‖ response`` (every response token supervised in one teacher-forced pass; prompt tokens are context only,
unless ``--prompt-weight`` > 0: the drafter only ever drafts response tokens, and the prompts are not the
verifier's output). The budget is wall-clock training time (``--seconds``; default: the diffusion run's training
time, estimated from its ``metrics.jsonl``) and/or steps. Saved with ``save_pretrained`` plus ``meta.json``
(``family: ar``), atomically.

:class:`align.drafters.ar.ARDrafter` drafts γ tokens one at a time on a KV cache kept across blocks and plugs into
``align.speculative.SpeculativeDecoder`` like any drafter: that is standard speculative decoding, through the same
loop. ``eval`` measures it (and optionally a diffusion drafter) on held-out prompts.
"""

from align.baseline.cli import main
from align.baseline.measure import measure
from align.baseline.model import ar_model, count_parameters, drafter_shape, llama_parameters, matched_intermediate
from align.baseline.train import diffusion_train_seconds, save, train

__all__ = ["ar_model", "count_parameters", "diffusion_train_seconds", "drafter_shape", "llama_parameters", "main",
           "matched_intermediate", "measure", "save", "train"]
