"""Dream-style masked-diffusion LMs (Dream / DiffuCoder conventions) on Qwen2 or Llama layers.

Dream-org's Dream-v0 and apple/DiffuCoder ship their own modelling code (``auto_map``: ``DreamConfig`` /
``DreamModel``, loaded with ``trust_remote_code``): a Qwen2 transformer whose attention is never causal, called as
``forward(input_ids, attention_mask, position_ids)`` where the mask is ``None`` / ``"full"`` (every position sees
every position) or a 4D boolean (B, 1, L, L) mask, returning logits whose position i predicts token i + 1. These
classes keep those conventions and module names (``model.layers.N.self_attn.q_proj`` ... ``lm_head``) on top of
transformers' own layers: :class:`DreamModel` on Qwen2 (the replicas of the zoo), :class:`DreamLlamaModel` on Llama
(the drafter the zoo makes from SmolLM2, as Dream-7B was made from Qwen2.5-7B). ``logits_to_keep`` (n > 0: the
logits of the last n positions only) spares the LM head the prefix, which drafting and training never read.

This file is copied next to the weights as the model's own code, so the models load exactly like a real Dream; it
imports nothing from ``align``.
"""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel, Qwen2Config, Qwen2Model, Qwen2PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


def _bidirectional(model, input_ids, attention_mask, position_ids, logits_to_keep):
    batch, length = input_ids.shape
    if not isinstance(attention_mask, torch.Tensor):  # None or "full": bidirectional over everything
        attention_mask = torch.ones((batch, 1, length, length), dtype=torch.bool, device=input_ids.device)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    return MaskedLMOutput(logits=model.lm_head(hidden))


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

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        return _bidirectional(self, input_ids, attention_mask, position_ids, logits_to_keep)


class DreamLlamaConfig(LlamaConfig):
    model_type = "DreamLlama"

    def __init__(self, mask_token_id=None, **kwargs):
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


class DreamLlamaModel(LlamaPreTrainedModel):
    config_class = DreamLlamaConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        return _bidirectional(self, input_ids, attention_mask, position_ids, logits_to_keep)
