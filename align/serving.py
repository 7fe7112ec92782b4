"""Serve an aligned drafter in vLLM: a speculative proposer for ``speculative_config`` method ``custom_class``.

    ALIGN_DRAFTER=runs/tiny/final python serve.py        # where serve.py builds the engine:

    LLM(model=VERIFIER, disable_log_stats=False,
        speculative_config={"method": "custom_class", "model": "align.serving.DiffusionProposer",
                            "num_speculative_tokens": 16})

vLLM builds the class in its worker with the engine's ``VllmConfig``, calls ``load_model(target)`` once and then,
after every engine step, ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``: one list of draft
tokens per running request, which vLLM verifies itself (greedy: its argmax; sampling: rejection sampling that
treats the draft as deterministic) and counts in its spec-decode metrics.

Settings come from the environment, which vLLM's worker processes inherit:

- ``ALIGN_DRAFTER`` (required): the drafter folder: an export of ``align/train.py`` (its ``meta.json`` names the
  family) or any drafter folder, or ``zoo:NAME`` of a built zoo model;
- ``ALIGN_DRAFTER_FAMILY``: the family when the folder does not name it (default: detected);
- ``ALIGN_DRAFTER_STEPS``: denoising steps per block (default 1);
- ``ALIGN_DRAFTER_DTYPE``: float32 (default), bfloat16 or float16.

The draft is the argmax of the drafter's marginals after T steps, γ = ``num_speculative_tokens`` tokens, fewer where
the model's length leaves less room. Prefix state: each running request keeps its drafter state (DiffusionGemma:
the encoder's KV cache), found again at the next step as the state whose tokens begin the request's context, so
only the tokens added since (accepted drafts and the bonus token) are encoded; states of requests that are no
longer running are dropped after each step. Every running request is drafted in the same drafter pass
(:meth:`align.drafters.diffusion.Drafter.marginals_many`: DiffusionGemma's rows go through each layer together, attention per
request against its own cache); a request near the length limit gets γ drafted and keeps what fits.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from align.drafters import load_drafter
from align.drafters.diffusion import Drafter
from align.errors import AlignError
from align.inference import PrefixState
from align.loading import infer_family
from align.machine import default_device
from align.paths import model_path


class DiffusionProposer:
    """vLLM's ``custom_class`` proposer around an align diffusion drafter (:class:`~align.drafters.diffusion.Drafter`)."""

    def __init__(self, vllm_config: Any):
        self.gamma = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.verifier_path = str(vllm_config.model_config.tokenizer or vllm_config.model_config.model)
        path = os.environ.get("ALIGN_DRAFTER")
        if not path:
            raise AlignError("align.serving.DiffusionProposer needs ALIGN_DRAFTER: set it to the drafter folder "
                             "(e.g. runs/tiny/final) in the environment that starts vLLM")
        self.path = model_path(path)
        self.steps = int(os.environ.get("ALIGN_DRAFTER_STEPS", "1"))
        self.dtype = os.environ.get("ALIGN_DRAFTER_DTYPE", "float32")
        self.family = os.environ.get("ALIGN_DRAFTER_FAMILY") or infer_family(self.path)
        self.drafter: Drafter | None = None
        self.states: list[PrefixState] = []
        self.calls = 0

    def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:
        """Load the drafter on the target model's device (vLLM calls this once, with the verifier)."""
        mend_cpu_temperature_expansion()
        device = default_device()
        if target_model is not None:
            device = str(next(target_model.parameters()).device)
        drafter = load_drafter(self.path, self.verifier_path, family=self.family, dtype=self.dtype, device=device)
        if not isinstance(drafter, Drafter):
            raise AlignError(f"align.serving.DiffusionProposer serves diffusion drafters; {self.path} is a "
                             f"{self.family} drafter (a dflash export is served by vLLM's own 'dflash' method)")
        self.drafter = drafter

    def _state_for(self, context: list[int]) -> PrefixState:
        """The kept state whose tokens are the longest prefix of ``context`` (taken out of the pool), or a new one."""
        best, best_len = None, -1
        for i, state in enumerate(self.states):
            n = len(state.ids)
            if n > best_len and n <= len(context) and state.ids == context[:n]:
                best, best_len = i, n
        if best is not None and best_len > 0:
            return self.states.pop(best)
        return self.drafter.new_state()

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                *args: Any, **kwargs: Any) -> list[list[int]]:
        """Draft tokens for every row of vLLM's batch (``[]``: none), all rows in one drafter pass per denoising
        step; vLLM's arrays are read, never written."""
        if self.drafter is None:
            self.load_model()
        self.calls += 1
        device = self.drafter.device
        rooms = [min(self.gamma, self.max_model_len - int(num_tokens_no_spec[row]) - 1) if sampled else 0
                 for row, sampled in enumerate(sampled_token_ids)]  # none for a prefill still in chunks
        rows = [row for row, room in enumerate(rooms) if room > 0]
        contexts = [[int(t) for t in token_ids_cpu[row, :int(num_tokens_no_spec[row])]] for row in rows]
        states = [self._state_for(context) for context in contexts]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if rows:  # γ for every row (one canvas shape), each cut to the room its request has left
            prefixes = [torch.tensor([context], device=device) for context in contexts]
            tokens = self.drafter.marginals_many(prefixes, states, self.gamma, self.steps).argmax(-1).tolist()
            for row, draft in zip(rows, tokens):
                drafts[row] = draft[:rooms[row]]
        self.states = states  # requests that did not run this step (finished or preempted) lose their state
        return drafts


def mend_cpu_temperature_expansion() -> bool:
    """Make vLLM-CPU's speculative sampling lossless again; True where it had to.

    vLLM 0.32's rejection sampler spreads each request's temperature over its draft positions with
    ``expand_batch_to_tokens``; without Triton (its CPU build) that runs a C++ fallback which converts the float
    tensors to int64 copies and never writes the result back, so every draft position's logits are divided by
    uninitialised memory and sampled speculative decoding leaves the verifier's distribution (measured:
    bench/serving_load.py --proposer constant, where a constant draft token was emitted at ~60% of positions that the
    verifier gives ~0.25%; greedy is unaffected). Checked on a small case first, and replaced with the same
    expansion in torch only where it is wrong. On a GPU the expansion is a Triton kernel of CUDA tensors: left as it
    is."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
    except ImportError:  # not inside vLLM
        return False
    if not current_platform.is_cpu():
        return False
    cpu = torch.device("cpu")
    probe = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.5, -1.0], device=cpu),
                                                    torch.tensor([2, 3], dtype=torch.int32, device=cpu), 3,
                                                    replace_from=-1, replace_to=1)
    if torch.equal(probe, torch.tensor([0.5, 0.5, 1.0], device=cpu)):
        return False

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
        values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
        return values.repeat_interleave(counts, output_size=num_tokens)

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
