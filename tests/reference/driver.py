"""Drive the PyTorch reference (nemo-automodel's DeepSeek-V4.1, in ``.venv-ref``) from our Python 3.12 tests.

The reference lives in its own Python 3.11 environment (``scripts/setup_reference_env.sh``); this module only
starts ``tests/reference/nemo_runner.py`` there in a subprocess and exchanges files with it. It never imports
torch. See the runner's docstring for the output names and docs/REFERENCE_NOTES.md for nemo's numerics.

    from tests.reference.driver import reference_available, run_reference
    if not reference_available(): pytest.skip(REFERENCE_MISSING)
    out = run_reference(ckpt_dir, tokens, dtype="float32", dump=True, cache_qdq=False)
    out["logits"]            # float32 [batch, seq, vocab]
    out["layer6.topk_idxs"]  # int64 [batch, seq, k]
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
REF_VENV = REPO_ROOT / ".venv-ref"
REF_PYTHON = REF_VENV / "bin" / "python"
RUNNER = Path(__file__).resolve().with_name("nemo_runner.py")
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup_reference_env.sh"
REFERENCE_MISSING = "reference env missing: run scripts/setup_reference_env.sh"

_PROBE = "import torch, transformers, safetensors, nemo_automodel.components.models.deepseek_v41.model"


class ReferenceUnavailable(RuntimeError):
    """The ``.venv-ref`` environment is absent or cannot import nemo's deepseek_v41."""


class ReferenceError(RuntimeError):
    """The reference runner failed (bad checkpoint, bad input, crash); the message holds its stderr."""


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    # Our 3.12 venv's variables must not leak into the 3.11 interpreter.
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(key, None)
    env["TORCHDYNAMO_DISABLE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    n = str(threads if threads is not None else int(os.environ.get("DSV41_REF_THREADS", "1")))
    env["DSV41_REF_THREADS"] = n
    env["OMP_NUM_THREADS"] = n
    env["MKL_NUM_THREADS"] = n
    return env


def _env_stamp() -> str:
    """What the probe's answer depends on: the interpreter and the installed packages (pip changes the
    site-packages directory whenever it adds or removes one)."""
    site = sorted(REF_VENV.glob("lib/python*/site-packages"))
    return repr([(str(p), p.stat().st_mtime_ns) for p in [REF_PYTHON.resolve(), *site]])


def rel(a, b) -> float:
    """Relative L2 difference ||a - b|| / ||b||, in float64: how the equivalence tests compare with the reference."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


@functools.cache
def reference_available() -> bool:
    """True iff ``.venv-ref/bin/python`` exists and imports nemo's deepseek_v41 model.

    Importing torch and nemo takes ~7 s of CPU, and every test process asks (each xdist worker and the GPU
    conversion rerun, while collecting): a passed probe is remembered beside the environment
    (``.venv-ref/.dsv41_probe``) until the interpreter or the installed packages change."""
    if not REF_PYTHON.exists():
        return False
    stamp_file = REF_VENV / ".dsv41_probe"
    stamp = _env_stamp()
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return True
    try:
        probe = subprocess.run(
            [str(REF_PYTHON), "-c", _PROBE],
            env=_child_env(1),
            capture_output=True,
            timeout=300,
            cwd=str(REPO_ROOT),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    if probe.returncode != 0:
        return False
    try:
        tmp = stamp_file.with_suffix(f".{os.getpid()}")
        tmp.write_text(stamp)
        tmp.replace(stamp_file)  # atomic: two workers may probe at once
    except OSError:  # a read-only environment: the probe is only not remembered
        pass
    return True


def run_reference(
    checkpoint_dir: str | os.PathLike,
    tokens: np.ndarray | None,
    dtype: str = "float32",
    dump: bool = False,
    *,
    cache_qdq: bool = True,
    act_quant: bool = False,
    layer_inputs: Mapping[str, np.ndarray] | None = None,
    attn: str = "eager",
    dspark_anchors: np.ndarray | None = None,
    dspark_prev: np.ndarray | None = None,
    threads: int | None = None,
    timeout: float | None = 900,
    chat: list | None = None,
) -> dict[str, np.ndarray]:
    """Run nemo's DeepSeek-V4.1 forward on ``tokens`` and return its outputs.

    Args:
      checkpoint_dir: release-format checkpoint directory (config.json, tokenizer.json, *.safetensors).
      tokens: integer token ids [batch, seq] (1-D is taken as batch 1; outputs keep the batch axis).
      dtype: "float32" or "bfloat16" (module storage/compute dtype inside nemo).
      dump: also return per-layer intermediates (names in nemo_runner's docstring).
      cache_qdq: False replaces nemo's FP8 SWA / NVFP4 compressed-KV / MXFP4 indexer quantize-dequantize by the
        identity (smooth float32 comparisons; see docs/REFERENCE_NOTES.md).
      act_quant: quantize the input of every FP8/FP4 linear to FP8 per 32, as the official inference code does and
        nemo does not (the runner's --act-quant): with dtype="bfloat16", the release's serving numerics.
      layer_inputs: teacher forcing: module inputs to replace, keyed like the dump (layer{l}.block_in_raw,
        layer{l}.block_in, layer{l}.pre_mix_in, layer{l}.attn_in, layer{l}.ffn_in).
      attn: nemo attention backend, "eager" (fp32 softmax) or "sdpa".
      dspark_anchors, dspark_prev: also draft one DSpark block per anchor (int [batch, anchors] positions) with
        these previous tokens for the Markov bias (int [batch, anchors, block]); adds dspark.* outputs.
      threads: torch threads in the child (default $DSV41_REF_THREADS or 1).
      timeout: seconds before the child is killed.
      chat: instead of tokens (pass None): a message list, content blocks may be {"type": "image", "path": FILE};
        nemo's processor renders and tokenizes it and preprocesses the images (outputs: the runner's --chat).

    Returns:
      dict name -> array; always "logits" float32 [batch, seq, vocab].

    Raises:
      ReferenceUnavailable: ``.venv-ref`` is missing or broken.
      ReferenceError: the runner failed; the message carries its stderr.
    """
    if not reference_available():
        raise ReferenceUnavailable(REFERENCE_MISSING)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if (tokens is None) == (chat is None):
        raise ValueError("pass exactly one of tokens and chat")
    if tokens is not None:
        tokens = np.asarray(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integer [batch, seq], got {tokens.dtype} {tokens.shape}")
    checkpoint_dir = Path(checkpoint_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="dsv41-ref-") as tmp:
        tmp_path = Path(tmp)
        tokens_path = tmp_path / "tokens.npy"
        out_path = tmp_path / "out.npz"
        if chat is None:
            np.save(tokens_path, tokens.astype(np.int32))
            source = ["--tokens", str(tokens_path)]
        else:
            source = ["--chat", str(tmp_path / "chat.json")]
            (tmp_path / "chat.json").write_text(json.dumps(chat))
        cmd = [
            str(REF_PYTHON),
            str(RUNNER),
            "--checkpoint", str(checkpoint_dir),
            *source,
            "--out", str(out_path),
            "--dtype", dtype,
            "--attn", attn,
            "--quiet",
        ]  # fmt: skip
        if dump:
            cmd.append("--dump")
        if not cache_qdq:
            cmd.append("--no-cache-qdq")
        if act_quant:
            cmd.append("--act-quant")
        if threads is not None:
            cmd += ["--threads", str(threads)]
        if (dspark_anchors is None) != (dspark_prev is None):
            raise ValueError("dspark_anchors and dspark_prev go together")
        if dspark_anchors is not None:
            np.save(tmp_path / "dspark_anchors.npy", np.asarray(dspark_anchors, np.int64))
            np.save(tmp_path / "dspark_prev.npy", np.asarray(dspark_prev, np.int64))
            cmd += ["--dspark-anchors", str(tmp_path / "dspark_anchors.npy"),
                    "--dspark-prev", str(tmp_path / "dspark_prev.npy")]
        if layer_inputs:
            forced_path = tmp_path / "layer_inputs.npz"
            np.savez(forced_path, **{k: np.asarray(v) for k, v in layer_inputs.items()})
            cmd += ["--layer-inputs", str(forced_path)]
        try:
            proc = subprocess.run(
                cmd,
                env=_child_env(threads),
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=str(REPO_ROOT),
            )
        except subprocess.TimeoutExpired as exc:
            raise ReferenceError(f"reference runner timed out after {timeout}s: {' '.join(cmd)}") from exc
        if proc.returncode != 0 or not out_path.is_file():
            hint = f" ({REFERENCE_MISSING})" if proc.returncode == 3 else ""
            raise ReferenceError(
                f"reference runner failed with exit code {proc.returncode}{hint}\n"
                f"command: {' '.join(cmd)}\n"
                f"stderr (tail):\n{proc.stderr[-6000:]}"
            )
        with np.load(out_path) as data:
            return {key: data[key] for key in data.files}


def skip_unless_reference() -> None:
    """pytest helper: skip the calling test when the reference env is not installed."""
    if not reference_available():
        import pytest

        pytest.skip(REFERENCE_MISSING)


if __name__ == "__main__":  # python -m tests.reference.driver: report availability
    print("reference available:", reference_available(), f"({REF_PYTHON})")
    sys.exit(0 if reference_available() else 1)
