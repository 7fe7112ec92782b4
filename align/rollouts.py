"""Verifier rollouts: continuations of the recipe's prompts sampled from the verifier, stored with ``datasets``.

    python -m align.rollouts recipes/tiny.yaml [section.key=value ...] [--shard I/N] [--device cuda:1]

Prompts are cut into chunks of ``data.batch_size``; each chunk is generated (``hf``: transformers batched
``generate``; ``vllm``: ``LLM.generate``), saved as its own dataset under ``chunks/`` and renamed into place when
complete, so a killed run continues where it stopped with nothing lost or duplicated. Shards (``--shard I/N``, or
the ranks of a distributed run) take every N-th chunk; whoever finds all chunks done merges them into
``dataset/``, whose ``info.description`` holds the metadata (verifier, sampling settings, seed). Chunk seeds depend
only on the chunk's index, so results do not depend on sharding or resuming.

Rows: ``prompt_id``, ``prompt_index``, ``sample``, ``category``, ``prompt_ids``, ``response_ids`` (ending with EOS
when the verifier stopped by itself), ``finished``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from align.config import Recipe, load_recipe
from align.errors import AlignError, run_cli
from align.files import discard_partial, write_text
from align.locks import exclusive
from align.machine import resolve_dtype
from align.prompts import encode_prompt
from align.verifier import plain_generation, sampling_config
from align.zoo import cache_dir, check_model, check_prompts, load_prompts, resolve

CHUNKS, DATASET, META = "chunks", "dataset", "meta.json"


def rollout_meta(recipe: Recipe) -> dict[str, Any]:
    """What determines a set of rollouts (and names its folder). Greedy rollouts draw nothing, so their seed is 0
    whatever run.seed is: runs of several seeds share one set instead of generating the same tokens again."""
    d = recipe.data
    return {"verifier": recipe.verifier.path, "verifier_dtype": resolve_dtype(recipe.verifier.dtype),
            "prompts": d.prompts, "num_prompts": d.num_prompts, "backend": d.backend, "n": d.n,
            "temperature": d.temperature, "top_p": d.top_p, "max_new_tokens": d.max_new_tokens,
            "chunk_size": d.batch_size, "seed": recipe.run.seed if d.temperature > 0 else 0}


def rollouts_dir(recipe: Recipe) -> Path:
    """``data.rollouts_dir``, or a folder in the cache named by a fingerprint of the rollout settings."""
    if recipe.data.rollouts_dir:
        return Path(recipe.data.rollouts_dir).expanduser()
    digest = hashlib.sha256(json.dumps(rollout_meta(recipe), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "rollouts" / digest


def is_complete(out: Path) -> bool:
    return (out / DATASET / "dataset_info.json").is_file()


def load_rollouts(recipe: Recipe):
    """The finished rollout dataset for ``recipe`` (refusing one made with other settings)."""
    from datasets import load_from_disk

    out = rollouts_dir(recipe)
    _check_meta(out, rollout_meta(recipe))
    try:
        dataset = load_from_disk(str(out / DATASET))
    except Exception as error:  # a damaged folder: say which and how to recover
        raise AlignError(f"the rollouts in {out} are corrupt ({str(error).splitlines()[0]}); delete the folder and "
                         "run again to regenerate them") from None
    if len(dataset) == 0:
        raise AlignError(f"the rollouts in {out} are empty; delete the folder and check data.prompts")
    missing = {"prompt_ids", "response_ids"} - set(dataset.column_names)
    if missing:
        raise AlignError(f"the rollouts in {out} lack the columns {sorted(missing)}; delete the folder to regenerate")
    for column in ("prompt_ids", "response_ids"):  # lists of token ids, nothing else
        feature = dataset.features[column]
        inner = getattr(feature, "feature", None)
        if inner is None or not str(getattr(inner, "dtype", "")).startswith(("int", "uint")):
            raise AlignError(f"the rollouts in {out} hold {column} of type {feature}, not lists of token ids; delete "
                             "the folder to regenerate them")
    return dataset


def _check_meta(out: Path, meta: dict[str, Any]) -> None:
    path = out / META
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise AlignError(f"{path} is corrupt; delete {out} to regenerate the rollouts") from None
        if old != meta:
            diff = next(k for k in meta if old.get(k) != meta[k])
            raise AlignError(f"{out} holds rollouts made with other settings ({diff}: {old.get(diff)!r}, now "
                             f"{meta[diff]!r}); choose another data.rollouts_dir or delete that folder")


def generate_rollouts(recipe: Recipe, shard: int = 0, shards: int = 1, barrier=None, progress: bool = True,
                      device: str | None = None):
    """Make (or finish) the rollouts of ``recipe``; returns the merged dataset when all shards are done. The hf
    backend runs on ``device`` (default: the accelerator when present)."""
    out = rollouts_dir(recipe)
    meta = rollout_meta(recipe)
    if is_complete(out):
        return load_rollouts(recipe)
    _check_meta(out, meta)
    prompts = load_prompts(recipe.data.prompts)[: recipe.data.num_prompts]  # read (and checked) before any write
    (out / CHUNKS).mkdir(parents=True, exist_ok=True)
    if shard == 0 and not (out / META).is_file():
        write_text(out / META, json.dumps(meta, indent=1))
    size = recipe.data.batch_size
    chunks = [list(range(i, min(len(prompts), i + size))) for i in range(0, len(prompts), size)]
    todo = [i for i in range(len(chunks)) if i % shards == shard and not (out / CHUNKS / f"{i:05d}").is_dir()]
    if todo:
        backend = make_backend(recipe, device)
        tokenizer = backend.tokenizer
        for i in tqdm(todo, desc=f"rollouts (shard {shard}/{shards})", disable=not progress, dynamic_ncols=True):
            with exclusive(out, f"chunk-{i:05d}", f"rollout chunk {i} in {out}"):  # another run may share the cache
                if (out / CHUNKS / f"{i:05d}").is_dir():
                    continue
                ids = [encode_prompt(tokenizer, prompts[j]["prompt"]) for j in chunks[i]]
                seed = zlib.crc32(f"{recipe.run.seed}/{i}".encode())
                responses = backend.generate(ids, seed)
                rows = [{"prompt_id": str(prompts[j]["id"]), "prompt_index": j, "sample": s,
                         "category": str(prompts[j].get("category", "all")), "prompt_ids": p, "response_ids": r,
                         "finished": bool(r) and r[-1] in backend.eos}
                        for j, p, samples in zip(chunks[i], ids, responses) for s, r in enumerate(samples)]
                _save_chunk(out / CHUNKS, i, rows)
    if barrier is not None:
        barrier()
    done = sum((out / CHUNKS / f"{i:05d}").is_dir() for i in range(len(chunks)))
    if done < len(chunks):
        print(f"shard {shard}/{shards} finished; {len(chunks) - done} chunks are still to come from other shards")
        return None
    if shard == 0 or barrier is None:
        with exclusive(out, "merge", f"the rollout dataset in {out}"):
            _merge(out, len(chunks), meta)
    if barrier is not None:
        barrier()
    return load_rollouts(recipe)


def _save_chunk(folder: Path, index: int, rows: list[dict]) -> None:
    from datasets import Dataset

    partial = folder / f".{index:05d}.partial"
    discard_partial(partial, f"rollout chunk {index}")
    Dataset.from_list(rows).save_to_disk(str(partial))
    partial.rename(folder / f"{index:05d}")


def _merge(out: Path, count: int, meta: dict) -> None:
    from datasets import concatenate_datasets, load_from_disk

    if is_complete(out):
        return
    parts = [load_from_disk(str(out / CHUNKS / f"{i:05d}")) for i in range(count)]
    dataset = concatenate_datasets(parts)
    dataset.info.description = json.dumps(meta)
    partial = out / f".{DATASET}.partial"
    discard_partial(partial, "the merged rollout dataset")
    dataset.save_to_disk(str(partial))
    shutil.rmtree(out / DATASET, ignore_errors=True)
    partial.rename(out / DATASET)


# ------------------------------------------------------------------------------------------------ backends


class HFBackend:
    """Batched ``generate`` with left padding, on the accelerator when present; sampling exactly as the recipe says
    (nothing from the verifier's own generation config)."""

    def __init__(self, recipe: Recipe, device: str | None = None):
        from align.loading import default_device, load_verifier_model
        from align.verifier import eos_ids

        self.model, self.tokenizer = load_verifier_model(recipe.verifier.path, recipe.verifier.dtype,
                                                         device or default_device(),
                                                         hub_kernels=recipe.run.hub_kernels)
        self.eos = eos_ids(self.model, self.tokenizer)
        self.data = recipe.data

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
        d = self.data
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(map(len, prompts))
        device = self.model.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        torch.manual_seed(seed)
        config = sampling_config(d.max_new_tokens, d.temperature, d.top_p, self.eos, pad, d.n)
        with plain_generation(self.model):
            gen = self.model.generate(ids, attention_mask=mask, generation_config=config)
        rows = [_cut(r, self.eos) for r in gen[:, width:].tolist()]
        return [rows[i * d.n:(i + 1) * d.n] for i in range(len(prompts))]


class VLLMBackend:
    """``vllm.LLM.generate`` over token-id prompts, one seeded ``SamplingParams`` per prompt."""

    def __init__(self, recipe: Recipe):
        from align.machine import vllm_on_every_core

        vllm_on_every_core()
        try:
            from vllm import LLM
        except ImportError:
            raise AlignError("data.backend: vllm needs vLLM in this environment (pip install 'align[vllm]' on a "
                             "GPU machine, or make vllm-env on a CPU machine); or set data.backend: hf") from None
        from align.loading import load_tokenizer

        path = resolve(recipe.verifier.path)
        self.tokenizer = load_tokenizer(path, "verifier")
        # on CPU vLLM's KV cache is a fixed size: ALIGN_VLLM_KV_GIB (default 0.25) sets it; larger batches of longer
        # prompts need more (SmolLM2-135M: 46 KB a token, so 64 sequences of 500 tokens take 1.5 GiB)
        kv = int(float(os.environ.get("ALIGN_VLLM_KV_GIB", "0.25")) * (1 << 30))
        extra = {} if torch.cuda.is_available() else {"enforce_eager": True, "kv_cache_memory_bytes": kv}
        # generation_config="vllm": nothing from the model's generation_config.json (the SamplingParams below say all)
        self.llm = LLM(model=path, dtype=resolve_dtype(recipe.verifier.dtype), seed=recipe.run.seed,
                       generation_config="vllm", max_model_len=min(4096, _context(path)), **extra)
        self.eos = folder_eos(path, self.tokenizer)
        self.data = recipe.data

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
        from vllm import SamplingParams

        d = self.data
        params = [SamplingParams(n=d.n, temperature=d.temperature, top_p=d.top_p if d.temperature > 0 else 1.0,
                                 max_tokens=d.max_new_tokens, seed=(seed + i * d.n) % (1 << 31))
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[_cut(list(c.token_ids), self.eos) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def _context(path: str) -> int:
    from transformers import AutoConfig

    from align.verifier import context_length

    return context_length(AutoConfig.from_pretrained(path)) or 4096


def folder_eos(path: str, tokenizer) -> list[int]:
    """The tokens that end the verifier's text, read from its folder (no model loaded): its generation config's EOS
    ids, else its tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _cut(tokens: list[int], eos: list[int]) -> list[int]:
    """Tokens up to and including the first EOS; padding after it dropped."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def make_backend(recipe: Recipe, device: str | None = None):
    if recipe.data.backend == "vllm":  # vLLM places the model itself
        return VLLMBackend(recipe)
    return HFBackend(recipe, device)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.rollouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--shard", default="0/1", help="I/N: this process makes every N-th chunk starting at I")
    parser.add_argument("--device", default=None, help="hf backend: cpu, cuda, cuda:N (default: the accelerator when "
                        "present)")
    args = parser.parse_args(argv)
    try:
        shard, shards = (int(x) for x in args.shard.split("/"))
        assert 0 <= shard < shards
    except (ValueError, AssertionError):
        raise AlignError(f"--shard must be I/N with 0 <= I < N, got {args.shard}") from None
    recipe = load_recipe(args.recipe, args.overrides)
    check_model(recipe.verifier.path, "verifier")  # every input before anything is built or generated
    check_prompts(recipe.data.prompts)
    resolve(recipe.verifier.path)  # a zoo verifier is built now, if it has to be
    dataset = generate_rollouts(recipe, shard, shards, device=args.device)
    if dataset is not None:
        lengths = [len(r) for r in dataset["response_ids"]]
        print(f"{len(dataset)} rollouts ({sum(lengths)} tokens, mean {sum(lengths) / len(lengths):.1f}) in "
              f"{rollouts_dir(recipe) / DATASET}")
    return 0


if __name__ == "__main__":
    run_cli(main)
