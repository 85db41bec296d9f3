"""DeepSeek-V4.1-Flash as a functional JAX program.

    from dsv41 import ModelConfig, init_params, forward
    cfg = preset("tiny"); params = init_params(cfg); logits = forward(params, cfg, token_ids)
"""

from dsv41.config import ConfigError, ModelConfig, preset
from dsv41.model import InputError, forward, forward_with_trace
from dsv41.params import abstract_params, dequantize_params, init_params
from dsv41.quant import EXACT_F32, REFERENCE, Numerics
from dsv41.sharding import Parallelism, ParallelismError, make_mesh, param_shardings, per_device_bytes


def load_checkpoint(*args, **kwargs):
    """See dsv41.checkpoint.load_checkpoint (imported lazily: it pulls in orbax)."""
    from dsv41 import checkpoint

    return checkpoint.load_checkpoint(*args, **kwargs)


__all__ = ["ModelConfig", "ConfigError", "InputError", "Numerics", "REFERENCE", "EXACT_F32", "preset", "init_params",
           "abstract_params", "dequantize_params", "forward", "forward_with_trace", "load_checkpoint",
           "Parallelism", "ParallelismError", "make_mesh", "param_shardings", "per_device_bytes"]
