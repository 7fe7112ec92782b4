"""The lean DiffusionGemma drafting pass: what decoding asks of the model, computed from the model's parts.

Decoding a batch of one calls the drafter once per block; on a small model the wrappers' per-call work costs more
than the arithmetic. :class:`DiffusionGemmaPass` does the same arithmetic with the same weights (the first call is
checked against the model's own forward) and skips what drafting does not need. ``ALIGN_LEAN=0`` selects the
models' own forwards everywhere (``bench/throughput.py --decode`` measures both). :func:`lm_logits` and
:func:`with_cache` are what the model's own forwards need of it on the other paths (training, the check).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from align.inference import PrefixState, cache_keyword


def lm_logits(core: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A ``DiffusionGemmaForBlockDiffusion``'s output logits for ``hidden``: its ``lm_head``, float32, soft-capped as
    the model caps them."""
    logits = core.lm_head(hidden).float()
    cap = core.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


@functools.lru_cache(maxsize=None)
def _cache_keyword() -> str:
    from transformers import DiffusionGemmaForBlockDiffusion

    return cache_keyword(DiffusionGemmaForBlockDiffusion)


def with_cache(cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for DiffusionGemma's forwards (the model's, its encoder's, its decoder's): transformers
    names it ``cache`` from 5.20 on and ``past_key_values`` before (the version vLLM's CPU build pins, where the
    drafter serves). Read from transformers' class, so wrappers (DeepSpeed, PEFT) do not hide it."""
    return {_cache_keyword(): cache}


# ``DiffusionGemmaRMSNorm`` is x · pow(mean(x²) + eps, -½) (· weight) in float32; ``F.rms_norm`` is the same
# arithmetic in one call (pow(·, -½) is rsqrt in ATen; tests/test_drafter_pass.py checks the two are bitwise equal)


def _eps(norm: torch.nn.Module) -> float:
    """A ``DiffusionGemmaRMSNorm``'s epsilon: ``eps`` up to transformers 5.24, ``variance_epsilon`` from 5.25."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The scale-free part of ``DiffusionGemmaRMSNorm``, in float32."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps)


def _scaled(normalised: torch.Tensor, weight: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The rest of ``DiffusionGemmaRMSNorm``: · weight (when it has one), back in the input's dtype."""
    if weight is not None:
        normalised = normalised * weight.float()
    return normalised.type_as(like)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``DiffusionGemmaRMSNorm``: x · (mean(x²) + eps)^-½ (· weight), in float32, returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` with ``sin`` given as (-sin₁ ‖ sin₂): rotate_half(x) · sin = roll(x) · that,
    exactly (negation commutes with rounding), one op instead of four."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _normalises(norm: torch.nn.Module) -> bool:
    """Whether a norm module normalises (``DiffusionGemmaRMSNorm``), or passes its input through (``Skipped``, where
    ``align.models.diffusiongemma`` follows Gemma 3)."""
    return type(norm).__name__ != "Skipped"


def _linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``layer(x)`` without the module call for a float ``nn.Linear``; any other layer (an int8 one) as itself."""
    return F.linear(x, layer.weight, layer.bias) if isinstance(layer, torch.nn.Linear) else layer(x)


class DiffusionGemmaPass:
    """What decoding asks of a ``DiffusionGemmaForBlockDiffusion``, computed from the model's parts.

    ``logits(cache, start, new, canvas, self_conditioning)`` does what ``model.model.encoder(input_ids=new,
    cache=cache, position_ids=start..)`` followed by ``model(cache=cache, decoder_input_ids=canvas,
    self_conditioning_logits=...).logits`` do: the same weights and operations, equal within float tolerance, without
    what decoding a batch of one does not need:

    - one pass instead of two (float32 and float64 models): the encoder and decoder layers share every weight, so
      the new prefix tokens and the canvas go through the layers together as rows of one sequence; an attention mask
      gives each row the keys it has in the two-pass computation (new tokens: causal, within the sliding window;
      canvas: the cached prefix as the decoder sees it, and the whole canvas), and the new tokens' keys and values
      join the cache as the encoder's do;
    - the wrappers' per-call work (argument merging, output capture, mask builders, output dataclasses);
    - the encoder's last layer past its keys and values, and its final norm (only its hidden states need them);
    - the self-conditioning MLP without logits: pre_norm(0) = 0, so it adds exactly 0 and leaves post_norm(embeddings);
    - rotate_half's slices, negation and concatenation (one roll against a sign-folded sin, exactly equal);
    - the experts' routing bookkeeping (sort, float histogram, gathers, inverse permutation): with few experts
      every expert runs on every row in two matmuls and the routing weights (zero for the experts a row did not
      pick) combine them; with many, on CPU, a leaner grouped matmul.

    ``supported(model)`` says why a model cannot take this pass (decoding then uses its own forward); the first
    call is compared with the model's own forward (``check``).
    """

    AHEAD = 256  # positions past the current ones in the rotary table
    #: how far the lean pass may be from the model's own forward at its first call (``check``), relative to 1 + the
    #: largest value compared. A structural difference (a mask, a missing term) shows as an O(1) relative difference;
    #: rounding in another order (attention kernels, matmul blocking) as far less. Measured (logits, next-token logits
    #: and keys, 3 seeds, with and without self-conditioning; docs/results.md, "The lean pass"): bitwise equal on the
    #: tests' and the tiny zoo's drafters in every dtype, at most 3.5e-6 relative in float32 on a 6-layer, 8-expert
    #: one; half precision takes the two-pass path, which rounds as the model's forward does. The bounds leave about
    #: 30x (float32) and 2.5 units in the last place of bfloat16 at the largest logit
    TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, None: 2e-2}

    def __init__(self, model: Any):
        self.model = model
        self.encoder = model.model.encoder.language_model
        self.decoder = model.model.decoder
        text = self.decoder.text_config
        self.types = list(text.layer_types[:text.num_hidden_layers])
        self.window = getattr(text, "sliding_window", None)
        self.eps = text.rms_norm_eps
        self.softcap = getattr(model, "final_logit_softcapping", None)
        self.fused = self._shared()  # encoder rows and canvas rows in one pass (in full precision)
        sc = self.decoder.self_conditioning
        self.zero_signal = all(layer.bias is None for layer in (sc.gate_proj, sc.up_proj, sc.down_proj))
        self._tables: dict[tuple, tuple] = {}  # rotary cos and sin per (rotary module, layer type, dtype, device)
        self.checked = False  # compared with the model's own forward once
        self.usable = True  # False once that comparison failed

    @staticmethod
    def supported(model: Any) -> str | None:
        """None when the lean pass computes what this model's forward computes, else the reason it may not."""
        from transformers import DiffusionGemmaForBlockDiffusion
        if type(model).__name__ not in ("DiffusionGemmaForBlockDiffusion", "Gemma3ValueDiffusionGemma"):
            return f"{type(model).__name__} is not a DiffusionGemmaForBlockDiffusion"
        text = model.config.get_text_config()
        if text._attn_implementation not in ("sdpa", "eager"):
            return f"attention implementation {text._attn_implementation}"
        if getattr(text, "use_bidirectional_attention", None) == "all":
            return "a bidirectional encoder"
        inner = model.model
        expected = {"DiffusionGemmaEncoderTextLayer": inner.encoder.language_model.layers,
                    "DiffusionGemmaDecoderTextLayer": inner.decoder.layers}
        for name, layers in expected.items():
            if any(type(layer).__name__ != name for layer in layers):
                return f"layers other than {name}"
        # every module the pass reads must be transformers' own DiffusionGemma module, an activation or a plain
        # Linear: an adapter (PEFT's lora.Linear), a quantised linear or an offloading hook changes the arithmetic
        own = (DiffusionGemmaForBlockDiffusion.__module__, "transformers.activations", "align.models.diffusiongemma")
        eps = set()
        for part in (inner.encoder.language_model, inner.decoder, model.lm_head):
            for module in part.modules():
                kind = type(module)
                if not (kind is torch.nn.Linear or kind is torch.nn.ModuleList or kind.__module__ in own):
                    return f"modules of another kind ({kind.__module__}.{kind.__name__}, e.g. adapters)"
                if hasattr(module, "_hf_hook") or module._forward_pre_hooks:
                    return "hooks on the model (offloading, device maps)"
                if kind.__name__ == "DiffusionGemmaRMSNorm":
                    eps.add(_eps(module))
        if len(eps) > 1:
            return "norms with different eps"
        if len({p.device for p in model.parameters()}) > 1:
            return "parameters on several devices"
        return None

    def _shared(self) -> bool:
        """Whether encoder layer i and decoder layer i are the same computation (tied weights, equal buffers)."""
        for enc, dec in zip(self.encoder.layers, self.decoder.layers):
            ours, theirs = dict(enc.named_parameters()), dict(dec.named_parameters())
            if ours.keys() != theirs.keys() or any(ours[k] is not theirs[k] for k in ours):
                return False
            if not torch.equal(enc.layer_scalar, dec.layer_scalar):
                return False
        for kind in set(self.types):
            for name in (f"{kind}_inv_freq", f"{kind}_attention_scaling"):
                a, b = getattr(self.encoder.rotary_emb, name, None), getattr(self.decoder.rotary_emb, name, None)
                if not (torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b):
                    return False
        return True

    # ---------------------------------------------------------------------------------------------- the pass

    @torch.inference_mode()
    def logits(self, cache: Any, start: int, new: torch.Tensor | None, canvas: torch.Tensor,
               self_conditioning: torch.Tensor | None = None, next_token: bool = False) -> Any:
        """Append the keys and values of ``new`` (1, n; None: nothing new) at positions start.. to ``cache``, and
        return the canvas's logits (1, γ, V), float32 and soft-capped, after the prefix now in ``cache``. With
        ``next_token``: also the encoder's next-token logits (1, V) at the last new token (None when nothing is
        new), what ``lm_head`` gives for the encoder's normed last hidden state: ``(canvas logits, those)``."""
        if not next_token:
            return self.logits_many([(cache, start, new)], canvas, self_conditioning)
        logits, (after,) = self.logits_many([(cache, start, new)], canvas, self_conditioning, True)
        return logits, after

    @torch.inference_mode()
    def logits_many(self, parts: list[tuple[Any, int, torch.Tensor | None]], canvas: torch.Tensor,
                    self_conditioning: torch.Tensor | None = None, next_token: bool = False) -> Any:
        """:meth:`logits` for several sequences at once: part b = (its own cache, start, new tokens (1, n_b) or
        None) with canvas row b (B, γ). Their rows go through every layer together (one matmul per weight for the
        whole batch, however different the lengths); only attention runs per sequence, each against its own cache.
        Returns (B, γ, V); with ``next_token``, also a list of each part's next-token logits (1, V) (None for a part
        with nothing new)."""
        segments = [(cache, start, 0 if new is None else new.shape[1]) for cache, start, new in parts]
        after: list[torch.Tensor | None] = [None] * len(parts)
        # one pass only in full precision: in half precision, rows batched differently round differently, enough
        # to move the router's top-k choices (then the two passes, which round as the model's forward does)
        fused = self.fused and self.decoder.embed_tokens.weight.dtype in (torch.float32, torch.float64)
        if not fused and any(n for *_, n in segments):  # the encoder's layers, then the decoder's
            encoding = [(b, segment, new) for b, (segment, (*_, new)) in enumerate(zip(segments, parts))
                        if new is not None]
            last = self._layers(self.encoder, torch.cat([self.encoder.embed_tokens(new) for *_, new in encoding],
                                                         dim=1), [segment for _, segment, _ in encoding], 0, next_token)
            if next_token:
                for row, (b, *_) in enumerate(encoding):
                    after[b] = self._next(last[0, row])
            segments = [(cache, start + n, 0) for cache, start, n in segments]
        dec = self.decoder
        embed, sc = dec.embed_tokens, dec.self_conditioning
        h = embed(canvas)
        if self_conditioning is None and self.zero_signal:  # pre_norm(0) = 0, and the bias-free MLP maps 0 to 0
            h = _rms(h, None, _eps(sc.post_norm))
        else:
            if self_conditioning is None:
                soft = torch.zeros_like(h)
            else:
                soft = torch.matmul(self_conditioning.softmax(dim=-1, dtype=torch.float32).to(embed.weight.dtype),
                                    embed.weight) * embed.embed_scale.to(h.dtype)
            soft = _rms(soft, sc.pre_norm.weight, _eps(sc.pre_norm))
            signal = _linear(sc.act_fn(_linear(soft, sc.gate_proj)) * _linear(soft, sc.up_proj), sc.down_proj)
            h = _rms(h + signal, None, _eps(sc.post_norm))
        if any(n for *_, n in segments):  # each sequence's new prefix tokens (the encoder's embedding), its canvas
            rows = []
            for b, ((*_, n), (*_, new)) in enumerate(zip(segments, parts)):
                rows += [self.encoder.embed_tokens(new), h[b:b + 1]] if n else [h[b:b + 1]]
            h = torch.cat(rows, dim=1)
        else:
            h = h.reshape(1, -1, h.shape[-1])
        c = canvas.shape[1]
        h = self._layers(dec, h, segments, c, next_token)
        if next_token and any(n for *_, n in segments):  # each part's kept rows: its last new token (if any), canvas
            rows, canvas_rows, at = h[0], [], 0
            for b, (*_, n) in enumerate(segments):
                if n:
                    after[b] = self._next(rows[at])
                    at += 1
                canvas_rows.append(rows[at:at + c])
                at += c
            h = torch.cat(canvas_rows)[None]
        logits = self._head(_rms(h, dec.norm.weight, _eps(dec.norm))).view(canvas.shape[0], c, -1)
        return (logits, after) if next_token else logits

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """``lm_head``, in float32, soft-capped."""
        logits = _linear(h, self.model.lm_head).to(torch.float32)
        if self.softcap is not None:  # in place: the same three operations without two (γ, V) temporaries
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def _next(self, h: torch.Tensor) -> torch.Tensor:
        """The encoder's next-token logits (1, V) from its last layer's output for one token (D,)."""
        norm = self.encoder.norm
        return self._head(_rms(h[None], norm.weight, _eps(norm)))

    def _layers(self, stack: Any, h: torch.Tensor, segments: list[tuple[Any, int, int]], c: int,
                next_token: bool = False) -> torch.Tensor:
        """Rows h (1, R, D): per segment (cache, start, n), its n new prefix tokens (positions start..) then c
        canvas tokens, through ``stack``'s layers. Returns the rows kept past the last layer's keys and values: per
        segment, its last new token's (with ``next_token``, when it has new ones) then its canvas rows (with neither,
        nothing useful: the last layer stops at its keys and values)."""
        firsts = [n - 1 if next_token and n else n for *_, n in segments]  # each segment's first kept row
        if len(segments) == 1:
            _, start, n = segments[0]
            rope = {kind: self._rope(stack.rotary_emb, kind, start, n + c, h) for kind in set(self.types)}
            kept: slice | torch.Tensor = slice(firsts[0], None)
        else:  # one table slice covering every segment, rows picked by position
            lo, hi = min(s for _, s, _ in segments), max(s + n + c for _, s, n in segments)
            index = torch.cat([torch.arange(s - lo, s - lo + n + c, device=h.device) for _, s, n in segments])
            rope = {kind: tuple(t[:, index] for t in self._rope(stack.rotary_emb, kind, lo, hi - lo, h))
                    for kind in set(self.types)}
            ends = list(itertools.accumulate(n + c for *_, n in segments))
            kept = torch.cat([torch.arange(end - n - c + first, end, device=h.device)
                              for end, (*_, n), first in zip(ends, segments, firsts)])
        masks: dict[tuple[str, int], torch.Tensor | None] = {}
        last = len(self.types) - 1
        for i, layer in enumerate(stack.layers[:len(self.types)]):
            h = self._layer(layer, i, h, rope[self.types[i]], segments, c, kept, firsts, masks, last=i == last)
        return h

    def _rope(self, rotary: Any, kind: str, start: int, rows: int,
              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (1, rows, 1, D) at positions start.., sliced from a table of the positions ahead
        that the model's own rotary embedding computed (position by position, so the rows are the ones it computes
        for these positions alone); per call for RoPE types whose frequencies depend on the length (dynamic,
        longrope). The table covers the positions asked and the next ``AHEAD``, and is rebuilt when decoding passes
        its end or the frequencies changed."""
        end = start + rows
        if getattr(rotary, "rope_type", {}).get(kind) in ("dynamic", "longrope"):
            return self._fold(*rotary(like, torch.arange(start, end, device=like.device)[None], kind))
        freq = getattr(rotary, f"{kind}_inv_freq")
        key = (id(rotary), kind, like.dtype, like.device)
        entry = self._tables.get(key)
        if entry is None or entry[0] is not freq or entry[1] != freq._version or \
                not entry[2] <= start <= end <= entry[3]:
            pos = torch.arange(start, end + self.AHEAD, device=like.device)[None]
            table = self._fold(*rotary(like, pos, kind))
            entry = self._tables[key] = (freq, freq._version, start, end + self.AHEAD, table)
        first = start - entry[2]
        cos, sin = entry[4]
        return cos[:, first:first + rows], sin[:, first:first + rows]

    @staticmethod
    def _fold(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = sin.shape[-1] // 2
        return cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None]

    def _mask(self, kind: str, start: int, n: int, c: int, keys: int, device: torch.device) -> torch.Tensor | None:
        """Which keys (the prefix's ``keys`` cached ones, then the canvas's) each row sees. New prefix tokens:
        causal, and within the window on sliding layers (the encoder's masks); canvas rows: every canvas key and
        the prefix the decoder reads from the cache (on sliding layers only its last window - 1 positions)."""
        if n == 0 or (n == 1 and c == 0):  # nothing to hide
            return None
        end = start + n  # the prefix length once the new tokens are in
        query = torch.arange(start, end + c, device=device)[:, None]
        key = torch.arange(end - keys, end + c, device=device)[None]
        prefix_row = query < end
        mask = torch.where(prefix_row, key <= query, True)
        if kind == "sliding_attention":
            mask &= key > torch.where(prefix_row, query, end) - self.window
        return mask[None, None]

    def _layer(self, layer: Any, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               segments: list[tuple[Any, int, int]], c: int, kept: slice | torch.Tensor, firsts: list[int],
               masks: dict, last: bool) -> torch.Tensor:
        """One layer over each segment's n new prefix rows and c canvas rows: :meth:`_attention`, then
        :meth:`_feed_forward`, scaled by the layer's scalar (the last layer stops at its keys and values when no row
        is read past them)."""
        attended = self._attention(layer, i, h, rope, segments, c, kept, firsts, masks, last)
        if attended is None:
            return h
        return self._feed_forward(layer, attended) * layer.layer_scalar

    def _attention(self, layer: Any, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   segments: list[tuple[Any, int, int]], c: int, kept: slice | torch.Tensor, firsts: list[int],
                   masks: dict, last: bool) -> torch.Tensor | None:
        """Layer ``i``'s attention block over each segment's n new prefix rows and c canvas rows, with its residual:
        the new rows' keys and values join the segment's cache; with none new, the canvas reads the cache as the
        decoder does. The last layer goes on past its keys and values only for the ``kept`` rows (from row
        ``firsts[b]`` of segment b on); None when no row is read past them."""
        attn, eps = layer.self_attn, self.eps
        x = _rms(h, layer.input_layernorm.weight, eps)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        cos, sin = rope
        k = _linear(x, attn.k_proj).view(shape)
        v = _linear(x, attn.v_proj).view(shape) if attn.v_proj is not None else k
        k = _rotate(_rms(k, attn.k_norm.weight, eps), cos, sin).transpose(1, 2)
        v = (_rms(v, None, eps) if _normalises(attn.v_norm) else v).transpose(1, 2)
        kind, keys, offset = self.types[i], [], 0
        for b, (cache, start, n) in enumerate(segments):
            own_k, own_v = (k, v) if len(segments) == 1 else (k[:, :, offset:offset + n + c],
                                                                v[:, :, offset:offset + n + c])
            offset += n + c
            if n:
                past_k, past_v = cache.update(own_k[:, :, :n], own_v[:, :, :n], i)  # what the encoder's attention reads
            else:
                past_k, past_v = cache.layers[i].keys, cache.layers[i].values
            if (kind, b) not in masks:
                masks[kind, b] = self._mask(kind, start, n, c, past_k.shape[-2], x.device)
            keys.append((torch.cat([past_k, own_k[:, :, n:]], dim=-2) if c else past_k,
                         torch.cat([past_v, own_v[:, :, n:]], dim=-2) if c else past_v))
        if last and all(first == n + c for first, (*_, n) in zip(firsts, segments)):  # no row is read past here
            return None
        trim = last and any(firsts)
        if trim:  # the last layer's other new rows only had to leave their keys and values
            h, x, cos, sin = h[:, kept], x[:, kept], cos[:, kept], sin[:, kept]
        q = _rotate(_rms(_linear(x, attn.q_proj).view(*x.shape[:-1], -1, attn.head_dim), attn.q_norm.weight, eps),
                    cos, sin).transpose(1, 2)
        outs, offset = [], 0
        for b, ((_, _, n), (k, v), first) in enumerate(zip(segments, keys, firsts)):
            rows = n + c - first if trim else n + c
            own_q = q if len(segments) == 1 else q[:, :, offset:offset + rows]
            offset += rows
            mask = masks[kind, b]
            if trim and mask is not None:
                mask = mask[:, :, first:]
            outs.append(self._attend(attn, own_q, k, v, mask))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        out = _linear(out.transpose(1, 2).reshape(*x.shape[:-1], -1), attn.o_proj)
        return h + _rms(out, layer.post_attention_layernorm.weight, eps)

    def _feed_forward(self, layer: Any, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward block with its residual: the dense MLP and the experts side by side; their two input
        norms and the router's norm normalise the same residual (same eps), so it is normalised once and scaled
        three ways."""
        eps = self.eps
        mlp, residual = layer.mlp, h
        base = _normalised(h, eps)
        x = _scaled(base, layer.pre_feedforward_layernorm.weight, h)
        dense = _linear(mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
        if _normalises(layer.post_feedforward_layernorm_1):  # (Gemma 3's value path has no second MLP norm)
            dense = _rms(dense, layer.post_feedforward_layernorm_1.weight, eps)
        flat = base.reshape(-1, base.shape[-1])
        weights, index = self._route(layer.router, _scaled(flat, None, h))
        experts = self._experts(layer.experts, _scaled(flat, layer.pre_feedforward_layernorm_2.weight, h), index,
                                weights).reshape(residual.shape)
        experts = _rms(experts, layer.post_feedforward_layernorm_2.weight, eps)
        return residual + _rms(dense + experts, layer.post_feedforward_layernorm.weight, eps)

    @staticmethod
    def _attend(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention of one sequence's queries over its keys and values."""
        groups = attn.num_key_value_groups
        # grouped keys as they are (CPU: with a mask too, bitwise the same as repeating them); elsewhere as
        # transformers' sdpa_attention_forward decides
        gqa = groups > 1 and (k.device.type == "cpu" or (mask is None and k.shape[-1] <= 256))
        if groups > 1 and not gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=gqa)

    def _route(self, router: Any, normalised: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``DiffusionGemmaTextRouter`` from its (scale-free) norm's output: top-k weights (normalised, per-expert
        scaled) and expert indices."""
        h = normalised * router.scale * router.scalar_root_size
        probs = _linear(h, router.proj).softmax(dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=router.config.top_k_experts, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * router.per_expert_scale[index], index

    @staticmethod
    def _experts(experts: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum per row (N, D), each row summing its top-k experts' outputs.

        Few experts (at most twice top-k): every expert on every row, in one matmul against the stacked gate/up
        weights (a view, no copy) and one batched matmul, weighted by the routing weights scattered over the experts
        (zero elsewhere, so the sum is the same two terms). Otherwise, on CPU: the grouped matmul of transformers'
        ``grouped_mm`` path with less bookkeeping (a stable sort and a bincount). Elsewhere, or for experts of
        another layout: the module itself."""
        plain = (getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True)
                 and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_post_expert_norm", True)
                 and not getattr(experts, "_is_expert_parallel", True))
        rows, k, dtype = x.shape[0], index.shape[-1], x.dtype
        if plain and experts.num_experts <= 2 * k:
            e = experts.num_experts
            x = x.to(experts.gate_up_proj.dtype)
            gate, up = F.linear(x, experts.gate_up_proj.view(-1, x.shape[-1])).view(rows, e, -1).chunk(2, dim=-1)
            out = torch.bmm((experts.act_fn(gate) * up).transpose(0, 1), experts.down_proj.transpose(1, 2))  # (E, N, D)
            spread = torch.zeros((e, rows), dtype=weights.dtype, device=x.device).scatter_(0, index.T, weights.T)
            return (out * spread[..., None]).sum(dim=0).to(dtype)
        if x.device.type != "cpu" or not plain or not hasattr(torch, "_grouped_mm"):
            return experts(x, index, weights)
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)  # (N·k,) pairs grouped by expert
        offsets = torch.bincount(flat, minlength=experts.num_experts).cumsum(0).to(torch.int32)
        picked = x[order // k].to(experts.gate_up_proj.dtype)
        gate, up = torch._grouped_mm(picked, experts.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offs=offsets)
        pairs = torch.empty_like(out)
        pairs[order] = out
        return (pairs.view(rows, k, -1) * weights.reshape(rows, k, 1)).sum(dim=1).to(dtype)

    # ---------------------------------------------------------------------------------------------- the check

    def check(self, prefix: torch.Tensor, canvas: torch.Tensor, self_conditioning: torch.Tensor | None,
              state: PrefixState, logits: torch.Tensor,
              after: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compare the first lean pass with the model's own forward (prefix cache, logits, and the encoder's
        next-token logits ``after`` when given); on a difference beyond float tolerance warn, stop using the lean
        pass and return the model's own."""
        model = self.model
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            encoded = model.model.encoder(input_ids=prefix, **with_cache(cache),
                                          position_ids=torch.arange(prefix.shape[1], device=prefix.device)[None])
            plain_after = None if after is None else lm_logits(model, encoded.last_hidden_state[:, -1])
            plain = model(**with_cache(cache), decoder_input_ids=canvas,
                          self_conditioning_logits=self_conditioning).logits
        tolerance = self.TOLERANCE.get(model.dtype, self.TOLERANCE[None])

        def near(a: torch.Tensor, b: torch.Tensor) -> bool:
            return a.shape == b.shape and float((a - b).abs().max()) <= tolerance * (1 + float(b.abs().max()))

        same = near(logits, plain) and all(near(ours.keys, theirs.keys) and near(ours.values, theirs.values)
                                           for ours, theirs in zip(state.cache.layers, cache.layers))
        same = same and (after is None or near(after, plain_after))
        self.checked = True
        if same:
            return logits, after
        import warnings

        self.usable = False
        warnings.warn("the lean DiffusionGemma decoding pass differs from the model's own forward with this "
                      "transformers version; decoding uses the model's forward", RuntimeWarning, stacklevel=2)
        state.cache = cache
        return plain, plain_after
