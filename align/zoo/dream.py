"""A Dream-style masked-diffusion LM (Dream / DiffuCoder conventions), written for the replicas of the zoo.

Dream-org's Dream-v0 and apple/DiffuCoder ship their own modelling code (``auto_map``: ``DreamConfig`` /
``DreamModel``, loaded with ``trust_remote_code``): a Qwen2 transformer whose attention is never causal, called as
``forward(input_ids, attention_mask, position_ids)`` where the mask is ``None`` / ``"full"`` (every position sees
every position) or a 4D boolean (B, 1, L, L) mask, returning logits whose position i predicts token i + 1. This
class keeps those conventions and module names (``model.layers.N.self_attn.q_proj`` ... ``lm_head``) on top of
transformers' own Qwen2 layers. It is copied next to the replica's weights as its remote code, so it loads exactly
like the real drafter; it imports nothing from ``align``.
"""

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2Model, Qwen2PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


class DreamConfig(Qwen2Config):
    model_type = "Dream"

    def __init__(self, mask_token_id=151666, **kwargs):
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


class DreamModel(Qwen2PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        batch, length = input_ids.shape
        if not isinstance(attention_mask, torch.Tensor):  # None or "full": bidirectional over everything
            attention_mask = torch.ones((batch, 1, length, length), dtype=torch.bool, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return MaskedLMOutput(logits=self.lm_head(hidden))
