"""Build the tiny zoo: world -> tokenizer -> verifier and drafters, each saved atomically with ``save_pretrained``.

Deterministic from ``ZooSpec.seed``. A model folder is complete when its ``zoo.json`` exists; it is written last,
after the model was saved under a temporary name and renamed, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from align.errors import AlignError
from align.files import atomic_folder, discard_partial
from align.loading import pretrained
from align.locks import exclusive
from align.machine import usable_cores
from align.prompts import encode_prompt
from align.tinyworld.corpus import read_jsonl, write_world
from align.tinyworld.tokenizer import train_tokenizer
from align.zoo.registry import DEFAULT_BUILD, MODELS, REAL, cache_dir, is_built, model_dir, packages_dir, world_dir
from align.zoo.models import BOS, EOS, PAD, dflash_model, diffusiongemma_model, mdlm_model, verifier_model
from align.families import traits
from align.zoo.pairs import REAL_BUILDS
from align.zoo.replicas import REPLICAS, build_replica
from align.zoo.pretrain import Doc, pretrain_drafter, pretrain_verifier


@dataclass
class ZooSpec:
    """Everything a zoo build depends on (tests build a miniature zoo by shrinking these)."""

    seed: int = 0
    docs_per_kind: int = 3000
    test_per_kind: int = 25
    vocab_size: int = 2048
    batch_size: int = 32
    lr: float = 2e-3
    replica_scale: str = "cpu"  # sizes of the random-weight replicas (align/zoo/replicas.py SCALES)
    verifier: dict = field(default_factory=lambda: {"hidden": 256, "layers": 4, "heads": 4, "steps": 1000})
    drafters: dict = field(default_factory=lambda: {
        "tiny-diffusiongemma": {"hidden": 128, "layers": 3, "heads": 4, "steps": 200, "offsets": 2, "sliding": 2,
                                "next_token": 1.0},
        "tiny-mdlm": {"hidden": 128, "layers": 3, "heads": 4, "steps": 1800},
        # the feature-conditioned drafter (align.dflash): the verifier's width, reading its layers 1 and 2;
        # random weights (no pretraining: it learns from the verifier's rollouts, as DFlash drafters do). Two
        # narrow layers beat one wide one of the same size (docs/dflash.md): 0.82M, 24% of the verifier's layers
        "tiny-dflash": {"layers": 2, "intermediate": 192, "kv_heads": 2, "target_layers": [1, 2], "steps": 0},
    })
    # what is made from the real verifiers (their pairs' build specs, align/zoo/pairs.py)
    real: dict = field(default_factory=lambda: copy.deepcopy(REAL_BUILDS))


def tokenizer_dir() -> Path:
    return model_dir("tokenizer")


def ensure_world(spec: ZooSpec) -> None:
    """Write the tiny world and train its tokenizer, unless they exist already (one process at a time)."""
    with exclusive(cache_dir(), "tinyworld", "the tiny world and its tokenizer"):
        _ensure_world(spec)


def _ensure_world(spec: ZooSpec) -> None:
    if not (world_dir() / "world.json").is_file():
        print(f"writing the tiny world into {world_dir()}", flush=True)
        discard_partial(world_dir().with_name(world_dir().name + ".partial"), "the tiny world")
        write_world(world_dir(), spec.docs_per_kind, spec.test_per_kind, spec.seed)
    if not (tokenizer_dir() / "tokenizer.json").is_file():
        docs = read_jsonl(world_dir() / "train_docs.jsonl")
        tokenizer = train_tokenizer([d["prompt"] for d in docs] + [d["response"] for d in docs], spec.vocab_size)
        partial = tokenizer_dir().with_name("tokenizer.partial")
        discard_partial(partial, "the tokenizer")
        tokenizer.save_pretrained(str(partial))
        partial.rename(tokenizer_dir())
        print(f"trained a {len(tokenizer)}-entry tokenizer into {tokenizer_dir()}", flush=True)


def tokenized_docs(tokenizer) -> list[Doc]:
    """Train documents as (prompt ‖ response ‖ eos ids, prompt length)."""
    out = []
    for d in read_jsonl(world_dir() / "train_docs.jsonl"):
        prompt = encode_prompt(tokenizer, d["prompt"])
        response = tokenizer(d["response"], add_special_tokens=False)["input_ids"]
        out.append((prompt + response + [tokenizer.eos_token_id], len(prompt)))
    return out


def build(names: list[str] | None = None, spec: ZooSpec | None = None, force: bool = False) -> list[str]:
    """Build the named zoo models (default: all) that are not built yet; returns the names built. One process
    builds at a time (a lock in the cache): the others wait and then find the models built."""
    with exclusive(cache_dir(), "zoo", "the tiny zoo"):
        threads = torch.get_num_threads()
        # under a launcher each local process got its share of the cores; the others wait on the lock, so take theirs
        torch.set_num_threads(max(threads, min(usable_cores(), threads * int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
        try:
            return _build(names, spec, force)
        finally:
            torch.set_num_threads(threads)


def _build(names: list[str] | None, spec: ZooSpec | None, force: bool) -> list[str]:
    spec = spec or ZooSpec()
    names = [n for n in MODELS if n in (names or DEFAULT_BUILD)]
    for name in names:  # before anything is built: every package the real models need is there
        if name in REAL:
            from align.zoo.real import REAL_VERIFIERS, check_installed

            if (force or not is_built(name)) and name in REAL_VERIFIERS:
                check_installed(name)
    built = [name for name in names if name in REAL and _build_real(name, spec, force)]
    names = [n for n in names if n not in REAL]
    if not names:
        return built
    ensure_world(spec)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    vocab = len(tokenizer)
    docs = None
    for name in names:
        if is_built(name) and not force:
            changed = _stale(name, spec)
            if changed is None:
                continue
            print(f"zoo:{name} was built with other settings ({changed}): rebuilding it", flush=True)
        start = time.time()
        if name in REPLICAS:  # random weights: nothing to train
            model, replica_tokenizer, code = build_replica(name, tokenizer, spec.replica_scale, spec.seed)
            _save(name, model, replica_tokenizer, {
                "name": name, "description": MODELS[name], "scale": spec.replica_scale,
                "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                "tokens": len(replica_tokenizer), "seconds": round(time.time() - start, 1)}, code)
            built.append(name)
            continue
        if name == "tiny-dflash":  # random weights, sized from the verifier it reads
            from transformers import AutoConfig

            d = spec.drafters[name]
            model = dflash_model(AutoConfig.from_pretrained(str(model_dir("tiny-verifier"))), d["target_layers"], tokenizer.mask_token_id, d["layers"],
                                 d["intermediate"], kv_heads=d.get("kv_heads"), seed=spec.seed)
            _save(name, model, tokenizer, {
                "name": name, "description": MODELS[name], "spec": dataclasses.asdict(spec),
                "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - start, 1)})
            built.append(name)
            continue
        docs = docs or tokenized_docs(tokenizer)
        if name == "tiny-verifier":
            v = spec.verifier
            model = verifier_model(vocab, v["hidden"], v["layers"], v["heads"], seed=spec.seed)
            losses = pretrain_verifier(model, docs, v["steps"], spec.batch_size, spec.lr, spec.seed, desc=name)
            model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                                       do_sample=False)
        else:
            d = spec.drafters[name]
            family = "diffusiongemma" if name == "tiny-diffusiongemma" else "mdlm"
            model = drafter_model(name, spec, vocab)
            losses = pretrain_drafter(model, family, docs, d["steps"], tokenizer.mask_token_id, vocab,
                                      spec.batch_size, spec.lr, spec.seed, desc=name, offsets=d.get("offsets", 1),
                                      next_token=d.get("next_token", 0.0))
        _save(name, model, tokenizer, {
            "name": name, "description": MODELS[name], "spec": dataclasses.asdict(spec),
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - start, 1),
            "loss_first": losses[0], "loss_last": sum(losses[-50:]) / len(losses[-50:]),
        })
        built.append(name)
    return built


def _build_real(name: str, spec: ZooSpec, force: bool) -> bool:
    """Build real model ``name`` (a converted verifier, or a drafter made from one and adapted) unless it is built
    with ``spec``'s settings already; returns whether it was built."""
    if is_built(name) and not force:
        changed = _stale(name, spec)
        if changed is None:
            return False
        print(f"zoo:{name} was built with other settings ({changed}): rebuilding it", flush=True)
    start = time.time()
    from align.zoo.real import REAL_VERIFIERS, convert

    if name in REAL_VERIFIERS:
        with atomic_folder(model_dir(name), f"zoo:{name}") as partial:
            meta = convert(name, partial)
            meta.update(name=name, description=MODELS[name], seconds=round(time.time() - start, 1))
            (partial / "zoo.json").write_text(json.dumps(meta, indent=1))
        print(f"saved zoo:{name} ({meta['parameters'] / 1e6:.1f}M parameters, {meta['seconds']:.0f} s) into "
              f"{model_dir(name)}", flush=True)
        return True
    from transformers import AutoModelForCausalLM

    r = spec.real[name]
    if "count" in r:  # prompts: the verifier writes them itself, and (``tasks``) passages of the English text give them
        return _build_real_prompts(name, r, start, spec)
    source = model_dir(r["verifier"])
    if not is_built(r["verifier"]):
        _build_real(r["verifier"], spec, False)
    if "derive" not in r:  # random layers over the verifier's features: nothing to derive or adapt
        return _build_real_dflash(name, r, source, spec, start)
    import align.zoo.derive as derive
    from align.zoo.adapt import adapt, text_docs

    verifier = pretrained(AutoModelForCausalLM, str(source), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    model, tokenizer = getattr(derive, r["derive"])(verifier, tokenizer, r["layers"])
    if not r.get("steps"):  # nothing to adapt: the verifier's own layers as they are (an early exit)
        _save(name, model, tokenizer, {
            "name": name, "description": MODELS[name], "spec": {"real": {name: r}, "seed": spec.seed},
            "verifier": f"zoo:{r['verifier']}", "layers": r["layers"],
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - start, 1)})
        return True
    from align.zoo.text import read_text

    text = english_text()
    vocab = verifier.config.vocab_size  # what the drafter learns to propose: the verifier's tokens
    del verifier
    docs = text_docs([d["text"] for d in read_text(text)], tokenizer, r["seq"],
                     limit=r["steps"] * r["batch_size"] * 2)
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # the verifier's, kept
        module.weight.requires_grad_(False)
    checkpoint = model_dir(name).with_name(f"{name}.adapt.pt")
    torch.manual_seed(spec.seed)
    losses = adapt(model, r["family"], docs, r["steps"], r["batch_size"], r["lr"], vocab, tokenizer.mask_token_id,
                   checkpoint, spec.seed, r.get("offsets", 4), r.get("next_token", 0.0), desc=f"adapt {name}")
    code = [Path(inspect.getfile(type(model)))] if traits(r["family"]).remote_code else []  # its own modelling code
    _save(name, model, tokenizer, {
        "name": name, "description": MODELS[name], "spec": {"real": {name: r}, "seed": spec.seed},
        "verifier": f"zoo:{r['verifier']}", "layers": r["layers"], "documents": len(docs),
        "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(time.time() - start, 1),
        "loss_first": losses[0], "loss_last": sum(losses[-20:]) / len(losses[-20:]),
    }, code)
    checkpoint.unlink(missing_ok=True)
    return True


def english_text() -> Path:
    """The folder of the English text (adaptation, task prompts), extracted from the packages on first use."""
    from align.zoo.text import build_text

    text = cache_dir() / "text"
    if not (text / "english.jsonl").is_file():
        print(f"extracting English text from the packages in {packages_dir()}", flush=True)
        summary = build_text(packages_dir(), text)
        print(f"{summary['documents']} documents, {summary['words']} words into {text}", flush=True)
    return text


def _build_real_prompts(name: str, r: dict, start: float, spec: ZooSpec) -> bool:
    """Training prompts for real verifier ``r["model"]``: ``count`` it writes itself (Magpie) and ``tasks`` built
    from passages of the English text (summarize, extract, answer from a passage: align/zoo/tasks.py), taken in
    turn; none overlapping the evaluation sets."""
    from transformers import AutoModelForCausalLM

    from align.zoo.magpie import OVERLAP, magpie_prompts

    if not is_built(r["model"]):
        _build_real(r["model"], spec, False)
    model = pretrained(AutoModelForCausalLM, str(model_dir(r["model"])), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir(r["model"])))
    rows, dropped = magpie_prompts(model, tokenizer, r["count"], r["seed"])
    if r.get("tasks"):
        from align.zoo.tasks import task_prompts
        from align.zoo.text import read_text

        tasks, task_dropped = task_prompts(read_text(english_text()), r["tasks"], r["seed"])
        dropped = {"magpie": dropped, "tasks": task_dropped}
        rows = [row for pair in itertools.zip_longest(rows, tasks) for row in pair if row is not None]
    with atomic_folder(model_dir(name), f"zoo:{name}") as partial:
        (partial / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        meta = {"name": name, "description": MODELS[name], "spec": {"real": {name: r}}, "prompts": len(rows),
                "dropped": dropped, "overlap_words": OVERLAP, "seconds": round(time.time() - start, 1)}
        (partial / "zoo.json").write_text(json.dumps(meta, indent=1))
    print(f"saved zoo:{name}: {len(rows)} prompts (dropped: {dropped}) into {model_dir(name)}", flush=True)
    return True


def _build_real_dflash(name: str, r: dict, source: Path, spec: ZooSpec, start: float) -> bool:
    """A feature-conditioned drafter for the real verifier in ``source``: random weights sized from its config (or,
    ``r["init_layers"]``, its layers starting as those of the verifier), its tokenizer, and as mask token one of the
    verifier's own tokens (``r["mask_token"]``: the drafter embeds with the verifier's embeddings, so it needs no new
    row)."""
    from transformers import AutoConfig

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    mask = tokenizer.convert_tokens_to_ids(r["mask_token"])
    if mask is None or mask == tokenizer.unk_token_id:
        raise AlignError(f"zoo:{name}: the verifier's tokenizer has no token {r['mask_token']!r} to mask with")
    config = AutoConfig.from_pretrained(str(source))
    text = config.get_text_config()
    model = dflash_model(config, r["target_layers"], mask, r["layers"], text.intermediate_size,
                         kv_heads=text.num_key_value_heads, head_dim=getattr(text, "head_dim", None), seed=spec.seed)
    if r.get("init_layers"):  # its layers start as the verifier's own (r["init_layers"]), not at random
        from transformers import AutoModelForCausalLM

        from align.zoo.derive import dflash_layers_from

        dflash_layers_from(model, pretrained(AutoModelForCausalLM, str(source), dtype=torch.float32), r["init_layers"])
    _save(name, model, tokenizer, {
        "name": name, "description": MODELS[name], "spec": {"real": {name: r}, "seed": spec.seed},
        "verifier": f"zoo:{r['verifier']}", "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.time() - start, 1)})
    return True


def drafter_model(name: str, spec: ZooSpec, vocab: int) -> torch.nn.Module:
    """The zoo drafter ``name`` as ``spec`` shapes it, with random weights (before pretraining)."""
    d = spec.drafters[name]
    if name == "tiny-diffusiongemma":
        return diffusiongemma_model(vocab, d["hidden"], d["layers"], d["heads"], seed=spec.seed,
                                    sliding=d.get("sliding", 0))
    return mdlm_model(vocab, d["hidden"], d["layers"], d["heads"], seed=spec.seed)


def _stale(name: str, spec: ZooSpec) -> str | None:
    """What differs between the settings zoo:NAME was built with and ``spec`` (None: nothing that shapes it)."""
    meta = json.loads((model_dir(name) / "zoo.json").read_text())
    if name in REAL:
        if name not in spec.real:  # a converted verifier: its source is pinned
            return None
        before, after = meta.get("spec", {}).get("real", {}).get(name), spec.real[name]
        return None if before == after else f"{before} -> {after}"
    if name in REPLICAS:
        return None if meta.get("scale") == spec.replica_scale else f"scale {meta.get('scale')} -> {spec.replica_scale}"
    old, new = meta.get("spec", {}), dataclasses.asdict(spec)
    own = "verifier" if name == "tiny-verifier" else "drafters"
    before = old.get(own, {}) if own == "verifier" else old.get(own, {}).get(name)
    after = new[own] if own == "verifier" else new[own].get(name)
    if before != after:
        return f"{before} -> {after}"
    shared = ("seed", "docs_per_kind", "test_per_kind", "vocab_size", "batch_size", "lr")
    return next((f"{k} {old.get(k)} -> {new[k]}" for k in shared if old.get(k) != new[k]), None)


def _save(name: str, model: torch.nn.Module, tokenizer, meta: dict, code: list[Path] = ()) -> None:
    """Save model, tokenizer, the model's own code files and zoo.json under a temporary name, then rename."""
    out = model_dir(name)
    with atomic_folder(out, f"zoo:{name}") as partial:
        model.save_pretrained(str(partial))
        if not (partial / "config.json").is_file():  # transformers skips the write on a non-zero distributed rank
            raise AlignError(f"transformers wrote no model for zoo:{name} (this process is rank "
                             f"{os.environ.get('RANK')} of a distributed run, and only rank 0 writes); build the zoo "
                             "first: python -m align.zoo build")
        tokenizer.save_pretrained(str(partial))
        for file in code:
            shutil.copy(file, partial / file.name)
        (partial / "zoo.json").write_text(json.dumps(meta, indent=1))
    trained = f", loss {meta['loss_first']:.2f} -> {meta['loss_last']:.2f}" if "loss_first" in meta else ""
    print(f"saved zoo:{name} ({meta['parameters'] / 1e6:.2f}M parameters, {meta['seconds']:.0f} s{trained}) "
          f"into {out}", flush=True)
