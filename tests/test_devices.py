"""Every tensor lives where its model lives, checked without a GPU (issue "On a GPU").

On a CPU-only machine a tensor made on the default device and a model's weights are both on the CPU, so the bug that
breaks a GPU run ("Expected all tensors to be on the same device ... cpu ... cuda:0") never shows. Two checks make it
show here:

- **the factory audit** (static): every tensor factory under align/, eval/ and bench/ names its device
  (``torch.zeros(..., device=x.device)``; host-side bookkeeping says ``device="cpu"``), and every
  ``torch.Generator`` too; a module's own parameters (``nn.Parameter(torch.ones(n))``) follow the default device on
  purpose (meta initialisation) and are left out;
- **the stray-device run** (:func:`elsewhere`): the real code runs on the CPU while the *default* device is
  ``meta``, under a dispatch mode that refuses any operation mixing devices. A tensor made without a device lands on
  ``meta`` and meets the CPU tensors of the models: the first operation that mixes them raises, as CUDA would.
  Decoding with every kind of drafter and a training step of every strategy run under it.

Beside them: the strategy moves its verifier to its own device, the decoder refuses a drafter on another device than
its verifier, the process group follows DeepSpeed's accelerator (gloo under ``DS_ACCELERATOR=cpu`` even where CUDA is
visible), and no model load asks transformers for the Hub's kernels.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import MASK, VOCAB, tiny_drafter, tiny_verifier

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
             "randperm", "eye", "linspace", "logspace"}


# ------------------------------------------------------------------------------------------------ the factory audit


def factories_without_device(source: str) -> list[tuple[int, str]]:
    """(line, call) of every ``torch.<factory>(...)`` without a ``device=`` and every ``torch.Generator()`` without
    a device, in ``source``; a factory that is the argument of ``nn.Parameter`` is a module's own weight (it follows
    the default device on purpose, as ``nn.Linear``'s do)."""
    tree = ast.parse(source)
    owned = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "Parameter" for arg in node.args}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch") or id(node) in owned:
            continue
        named = any(k.arg == "device" for k in node.keywords)
        if node.func.attr == "Generator" and not (named or node.args):
            found.append((node.lineno, ast.unparse(node)))
        elif node.func.attr in FACTORIES and not named:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_every_tensor_factory_names_its_device():
    """A tensor made without a device is made on the CPU while the model may be on a GPU: every factory under
    align/, eval/ and bench/ says where (the model's device, or ``"cpu"`` for host-side bookkeeping)."""
    found = [f"{path.relative_to(ROOT)}:{line}: {call}"
             for folder in ("align", "eval", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for line, call in factories_without_device(path.read_text())]
    assert found == [], "\n".join(found)


def test_the_audit_finds_a_factory_or_generator_without_a_device():
    source = ("import torch\nfrom torch import nn\n"
              "a = torch.zeros(3)\nb = torch.arange(4, device=x.device)\nc = torch.Generator()\n"
              "d = torch.Generator(x.device)\ne = nn.Parameter(torch.ones(3))\n"
              "f = torch.tensor([1], dtype=torch.long)\n")
    assert [line for line, _ in factories_without_device(source)] == [3, 5, 8]


# ------------------------------------------------------------------------------------------------ the stray-device run


class _OneDevice(TorchDispatchMode):
    """Refuses any operation whose tensor arguments (other than 0-dim scalars, which CUDA also takes from the CPU)
    lie on more than one device; copies between devices are what ``.to`` does, and pass."""

    PASS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.lift_fresh.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.PASS:
            devices = {x.device for x in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(x, torch.Tensor) and x.dim() > 0}
            if len(devices) > 1:
                raise RuntimeError(f"{func} mixes devices {sorted(map(str, devices))}: a tensor was made on the "
                                   "default device instead of its model's")
        return func(*args, **kwargs)


@contextmanager
def elsewhere():
    """Run the block with the default device on ``meta`` and no operation mixing devices: a tensor made without a
    device (on the default device) cannot meet the models' CPU tensors unnoticed."""
    torch.set_default_device("meta")
    try:
        with _OneDevice():
            yield
    finally:
        torch.set_default_device(None)


def test_the_stray_device_run_catches_a_tensor_made_without_a_device():
    embed = torch.nn.Embedding(10, 4)  # its weights on the CPU, made before the check
    with elsewhere():
        embed(torch.tensor([1, 2], device="cpu"))  # made where the model is: fine
        with pytest.raises(RuntimeError, match="mixes devices"):
            embed(torch.tensor([1, 2]))  # made on the default device
        with pytest.raises(RuntimeError, match="mixes devices"):
            torch.cat([torch.zeros(2, device="cpu"), torch.zeros(2)])


def drafters_of_every_kind(verifier):
    from align.drafters.ar import ARDrafter
    from align.drafters.dflash import DFlashDrafter
    from align.drafters.diffusion import Drafter
    from align.drafters.ngram import FallbackDrafter, NGramDrafter
    from align.zoo.models import dflash_model

    return {
        "diffusiongemma": Drafter(tiny_drafter("diffusiongemma"), "diffusiongemma", VOCAB, MASK),
        "diffusiongemma-canvas-seed-encoder": Drafter(tiny_drafter("diffusiongemma"), "diffusiongemma", VOCAB, MASK,
                                                      canvas_seed=0, first_token="encoder"),
        "mdlm": Drafter(tiny_drafter("mdlm"), "mdlm", VOCAB, MASK),
        "dream": Drafter(tiny_drafter("dream"), "dream", VOCAB, MASK),
        "dflash": DFlashDrafter(dflash_model(verifier.config, [0], MASK, layers=1, intermediate=32), verifier,
                                VOCAB),
        "ar": ARDrafter(tiny_verifier(1, dtype=torch.float32), VOCAB),
        "ngram+mdlm": FallbackDrafter(NGramDrafter(VOCAB), Drafter(tiny_drafter("mdlm"), "mdlm", VOCAB, MASK)),
    }


KINDS = ("diffusiongemma", "diffusiongemma-canvas-seed-encoder", "mdlm", "dream", "dflash", "ar", "ngram+mdlm")


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_makes_every_tensor_on_its_models_device(kind):
    """Greedy and sampled decoding, T = 2, the stop rule, and K = 4 drafts scored by the verifier in one
    tree-masked pass: no tensor of the loop, the verifier or the drafter is made on the default device."""
    from align.selection import make_selection
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, verifier_alone

    model = tiny_verifier(dtype=torch.float32)
    verifier = Verifier(model)
    decoder = SpeculativeDecoder(drafters_of_every_kind(model)[kind], verifier, [1])
    prompt = [5, 6, 7, 8, 5, 6]
    reference = decoder.generate(prompt, 12, 4).tokens  # before the check: what the loop gives
    with elsewhere():
        assert decoder.generate(prompt, 12, 4).tokens == reference
        decoder.generate(prompt, 12, 4, steps=2, temperature=1.0, seed=3)
        decoder.generate(prompt, 12, 4, stop_below=0.3)
        if kind not in ("ar", "ngram+mdlm", "dflash"):  # K drafts from the marginals of a one-pass drafter
            decoder.generate(prompt, 12, 4, selection=make_selection(4, 1.0, "verifier"))
            decoder.generate(prompt, 12, 4, temperature=1.0, selection=make_selection(4, 1.0, "verifier"))
        assert verifier_alone(verifier, prompt, 6).tokens == ar_generate(model, prompt, 6)


def test_the_servings_batched_drafting_makes_every_tensor_on_its_models_device():
    """The vLLM proposer's pass: every running request drafted together, each against its own kept state."""
    from align.drafters.diffusion import Drafter

    drafter = Drafter(tiny_drafter("diffusiongemma"), "diffusiongemma", VOCAB, MASK)
    prefixes = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9, 10, 11, 12]])]
    states = [drafter.new_state(), drafter.new_state()]
    with elsewhere():
        rows = drafter.marginals_many(prefixes, states, 4, 2)
    assert rows.shape[:2] == (2, 4)


STRATEGY_CASES = {  # case -> (family, objective, more overrides)
    "window-kd": ("mdlm", "kd", []),
    "window-dream-T2": ("dream", "streak_ce", ["distill.denoise_steps=2"]),
    "packed": ("diffusiongemma", "streak_ce", ["distill.next_token_weight=0.5"]),
    "packed-T2-kd": ("diffusiongemma", "kd", ["distill.denoise_steps=2"]),
    "dflash-tv": ("dflash", "tv", []),
    "dflash-draft-vocabulary-T2": ("dflash", "streak_ce", ["drafter.draft_vocab=40", "distill.denoise_steps=2"]),
}


@pytest.mark.parametrize("case", sorted(STRATEGY_CASES))
def test_a_training_step_of_every_strategy_makes_every_tensor_on_its_models_device(case, model_dirs, tmp_path):
    """A micro-batch's loss, its backward and the held-out metrics of each strategy (the bare drafter: what the
    engine runs), every family and the objectives that read the verifier's logits."""
    from align.config import load_recipe
    from align.distill.strategy import heldout_metrics, strategy_for
    from align.distill.windows import window_index
    from align.loading import load_drafter_model, load_verifier_model
    from test_strategy import rollouts

    family, objective, more = STRATEGY_CASES[case]
    recipe = load_recipe("recipes/tiny.yaml", [
        f"verifier.path={model_dirs['verifier']}", f"drafter.path={model_dirs[family]}", f"drafter.family={family}",
        f"distill.objective={objective}", "distill.gamma=4", f"drafter.trust_remote_code={family == 'dream'}",
        "distill.canvas_seed=null" if family == "dflash" else "distill.canvas_seed=0", "distill.first_token=canvas",
        "distill.next_token_weight=0", f"run.output_dir={tmp_path}", *more])
    verifier, _ = load_verifier_model(str(model_dirs["verifier"]))
    verifier.requires_grad_(False)
    model, tokenizer = load_drafter_model(str(model_dirs[family]), family, trust_remote_code=family == "dream")
    vocab = verifier.config.vocab_size
    rows = rollouts(vocab)
    Strategy = strategy_for(recipe)
    prepared = Strategy.prepare(recipe, model, verifier, tokenizer, rows)
    strategy = Strategy(recipe, model.train(), rows, vocab, prepared["mask_id"], verifier)
    windows = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))[:8]
    arranged, given = strategy.arrange(windows, 0)
    dens = strategy.denominators(arranged, given)
    with elsewhere():
        for step in range(2):  # T > 1: the second step trains a later pass
            loss = strategy.micro_loss(strategy.batch(arranged, given, train=True), step, 0, dens, 1.0)
            loss.backward()
        heldout_metrics(strategy, windows, 4)
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters())


def test_the_strategy_runs_its_verifier_where_its_drafter_runs(model_dirs, tmp_path):
    """The engine puts the drafter on the accelerator; the verifier the trainer hands over goes there too (on the
    GPU it stayed on the CPU: "index is on cpu, different from other tensors on cuda:0")."""
    from align.config import load_recipe
    from align.distill.strategy import FeatureStrategy
    from align.loading import load_drafter_model, load_verifier_model

    recipe = load_recipe("recipes/tiny-dflash.yaml", [f"verifier.path={model_dirs['verifier']}",
                                                      f"drafter.path={model_dirs['dflash']}"])
    verifier, _ = load_verifier_model(str(model_dirs["verifier"]))
    model, _ = load_drafter_model(str(model_dirs["dflash"]), "dflash")
    strategy = FeatureStrategy(recipe, model.to("meta"), [], VOCAB, MASK, verifier)  # the model's device by default
    assert strategy.device.type == "meta"
    assert {p.device.type for p in strategy.verifier.parameters()} == {"meta"}


def test_the_decoder_refuses_a_drafter_on_another_device_than_its_verifier():
    from align.drafters.diffusion import Drafter
    from align.errors import AlignError
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier

    drafter = Drafter(tiny_drafter("mdlm").to("meta"), "mdlm", VOCAB, MASK)
    with pytest.raises(AlignError, match="load both on one device"):
        SpeculativeDecoder(drafter, Verifier(tiny_verifier()), [1])


# ------------------------------------------------------------------------------------------------ the process group


def test_a_cpu_run_on_a_machine_with_cuda_uses_gloo_and_the_cpu():
    """``DS_ACCELERATOR=cpu`` where CUDA is visible (here: made to look visible): the process group is gloo, the
    models load on the CPU and an all-reduce runs (on the GPU machine NCCL was chosen: "No backend type associated
    with device type cpu")."""
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "import torch.distributed as dist\n"
            "from align.distill.distributed import all_reduce, init_distributed\n"
            "from align.machine import default_device\n"
            "init_distributed(); x = torch.ones(2, device='cpu'); all_reduce(x)\n"
            "print(dist.get_backend(), default_device(), x.tolist())\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "gloo cpu [1.0, 1.0]"


def test_the_default_device_follows_ds_accelerator(monkeypatch):
    from align.machine import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert default_device() == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert default_device() == "cuda:1"


@pytest.mark.parametrize("avx512_bf16, amx, arm, cuda_bf16", [(False, False, False, False), (True, False, False, True),
                                                              (False, True, False, False), (False, False, True, True)])
def test_auto_is_bfloat16_only_where_the_device_computes_in_it(monkeypatch, avx512_bf16, amx, arm, cuda_bf16):
    """``verifier.dtype: auto`` and ``deepspeed.bf16: null``: bfloat16 on a CPU with AVX-512 BF16, AMX or Arm's BF16
    and on a GPU that supports it; float32 on a CPU that converts bfloat16 in software (AVX2 only); what a recipe
    names is kept."""
    import align.machine as machine
    from align.machine import bf16_training, resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(machine, "_arm_bf16", lambda: arm)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    native = avx512_bf16 or amx or arm
    assert resolve_dtype("auto") == resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert bf16_training(None) is native and bf16_training(True) is True and bf16_training(False) is False
    assert resolve_dtype("auto", "cuda:0") == ("bfloat16" if cuda_bf16 else "float32")
    assert [resolve_dtype(d) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float16"]


def test_a_recipe_on_auto_names_its_data_by_the_dtype_it_ran_in(monkeypatch, model_dirs):
    """Rollouts and labels made in bfloat16 on one machine are not taken for float32 ones on another: their folders'
    fingerprints hold the concrete dtype, and the verifier loads in it."""
    import align.machine as machine
    from align.config import build_recipe
    from align.labels import label_meta
    from align.loading import load_verifier_model
    from align.rollouts import rollout_meta

    recipe = build_recipe({"verifier": {"path": str(model_dirs["verifier"]), "dtype": "auto"}})
    found = {}
    for native in (False, True):
        monkeypatch.setattr(machine, "native_bf16", lambda device=None, native=native: native)
        model, _ = load_verifier_model(recipe.verifier.path, recipe.verifier.dtype, "cpu")
        found[native] = (rollout_meta(recipe)["verifier_dtype"], label_meta(recipe)["verifier_dtype"], model.dtype)
    assert found == {False: ("float32", "float32", torch.float32), True: ("bfloat16", "bfloat16", torch.bfloat16)}


def test_the_two_process_tests_find_the_launcher_however_deepspeed_was_installed():
    """``python -m deepspeed.launcher.runner``: no ``deepspeed`` script next to the interpreter is needed (a
    ``pip install --target`` puts none there)."""
    from test_train import DEEPSPEED

    assert DEEPSPEED[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    done = subprocess.run(DEEPSPEED[:3] + ["--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--num_gpus" in done.stdout


# ------------------------------------------------------------------------------------------------ hub kernels


def test_no_model_weights_are_read_but_through_the_one_loader():
    """Every ``from_pretrained`` of a model goes through ``align.loading.pretrained``, which keeps transformers'
    Hub kernels off; configs and tokenizers read no weights."""
    found = []
    for folder in ("align", "eval", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "from_pretrained":
                    receiver = ast.unparse(node.func.value).lower()
                    if not receiver.endswith(("config", "tokenizer", "tokenizerfast")) and \
                            str(path.relative_to(ROOT)) != "align/loading.py":
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "\n".join(found)


def test_the_guard_catches_a_load_that_would_ask_for_hub_kernels(model_dirs):
    """tests/conftest.py refuses, in every test, a model whose load turns transformers' Hub kernels on (its default
    in 5.2x: on a GPU that fetches ``kernels-community/*`` from the Hub, and fails offline)."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(AssertionError, match="Hub's kernels"):
        AutoModelForCausalLM.from_pretrained(str(model_dirs["verifier"]))


def test_every_loading_path_keeps_hub_kernels_off_unless_asked(model_dirs):
    """The verifier, every drafter kind, an assistant and an n-gram fallback load with the kernels off whatever
    USE_HUB_KERNELS says (tests/conftest.py sets it to YES); ``hub_kernels=True`` is what asks for them."""
    from transformers import AutoModelForCausalLM

    from align.drafters import load_drafter, load_pair
    from align.loading import load_verifier_model, pretrained

    assert os.environ.get("USE_HUB_KERNELS") == "YES"
    verifier = str(model_dirs["verifier"])
    for kind in ("diffusiongemma", "mdlm", "dream", "dflash"):
        drafter, checked, _ = load_pair(str(model_dirs[kind]), verifier, kind, trust_remote_code=kind == "dream")
        assert not checked.model.use_kernels and not getattr(drafter, "model", checked.model).use_kernels
    model, _ = load_verifier_model(verifier, role="assistant")
    assert not model.use_kernels
    load_drafter(f"ngram:2+{model_dirs['mdlm']}", verifier, model)
    with pytest.raises(AssertionError, match="Hub's kernels"):
        pretrained(AutoModelForCausalLM, verifier, hub_kernels=True)


def test_vllm_on_the_cpu_runs_its_engine_here_and_its_model_on_every_core(monkeypatch):
    """vLLM's CPU build keeps a core for its engine process unless told otherwise (2 cores: the model on one)."""
    from align.machine import vllm_on_every_core

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a copy of the environment without vLLM's variables, so that nothing set here outlives the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})
    vllm_on_every_core()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's engine process keeps its core
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    vllm_on_every_core()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU build: vLLM's own defaults
    vllm_on_every_core()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
