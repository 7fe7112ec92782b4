"""A tiny bidirectional masked LM with Dream's conventions, loaded through ``trust_remote_code`` in the tests.

Like Dream / DiffuCoder: ``AutoModel`` with an ``auto_map``, ``forward(input_ids, attention_mask, position_ids)``
where the mask is None (full attention) or a 4D boolean (B, 1, L, L) mask, and logits whose position i predicts
token i + 1. The test fixture copies this file next to the saved weights as the model's own code.
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


class TinyDreamConfig(PretrainedConfig):
    model_type = "tinydream"

    def __init__(self, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=256, mask_token_id=3, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


class TinyDreamModel(PreTrainedModel):
    config_class = TinyDreamConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(config.hidden_size, config.num_attention_heads, 2 * config.hidden_size,
                                       dropout=0.0, batch_first=True) for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        hidden = self.embed(input_ids) + self.position(position_ids)
        mask = None
        if isinstance(attention_mask, torch.Tensor):  # (B, 1, L, L), True = may attend
            heads = self.config.num_attention_heads
            mask = ~attention_mask.expand(-1, heads, -1, -1).reshape(-1, *attention_mask.shape[-2:])
        for layer in self.layers:
            hidden = layer(hidden, src_mask=mask)
        return MaskedLMOutput(logits=self.lm_head(hidden))
