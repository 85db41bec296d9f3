"""scripts/profile_step.py's mapping from kernels to model parts (the CUPTI part needs a GPU)."""

import jax
import jax.numpy as jnp

import profile_step as ps


def test_kernels_are_summed_by_named_scope():
    def f(x, w):
        with jax.named_scope("layer3"), jax.named_scope("moe"), jax.named_scope("router"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("layer3"), jax.named_scope("mhc"):
            z = jnp.sum(y * 2, axis=-1)
        return z, y.T

    parts = ps.hlo_parts([jax.jit(f).lower(jnp.ones((64, 128)), jnp.ones((128, 256))).compile().as_text()])
    assert "moe/router" in parts.values() and "mhc" in parts.values()  # layer numbers and jit levels dropped
    tanh = next(k for k, v in parts.items() if v == "moe/router" and "tanh" in k)
    got = ps.by_part([(tanh, 0.1), ("expert_gemm_fp4_mosaic_gpu_kernel", 0.5), ("nvjet_sm90_x", 0.3)], parts)
    assert got == {"moe/router": (1, 0.1), "pallas expert_gemm_fp4": (1, 0.5), "unmatched": (1, 0.3)}
    # a step of two programs (the split decode step): a kernel name both give to different parts is not guessed
    text = f'  %{tanh} = f32[2] tanh(%x), metadata={{op_name="jit(g)/attention/tanh"}}'
    assert ps.hlo_parts([jax.jit(f).lower(jnp.ones((64, 128)), jnp.ones((128, 256))).compile().as_text(),
                         text])[tanh] == ps.AMBIGUOUS


def test_timeline_places_gaps_and_host_time_on_one_clock(tmp_path):
    """A two-kernel GPU trace (jax.profiler's XSpace): busy 20 us of a 59 us span, the 39 us gap charged to the
    kernel it waits for, and the host event inside the span counted."""
    def ev(meta, start_us, dur_us):
        return f"events {{ metadata_id: {meta} offset_ps: {start_us * 10**6} duration_ps: {dur_us * 10**6} }}"

    space = f'''
    planes {{ id: 1 name: "/device:GPU:0"
      lines {{ id: 1 name: "Stream #13(Compute)" timestamp_ns: 0 {ev(1, 1, 10)} {ev(2, 50, 10)} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "fp8_linear_mosaic_gpu_kernel" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "loop_fusion_1" }} }} }}
    planes {{ id: 2 name: "/host:CPU"
      lines {{ id: 1 name: "python" timestamp_ns: 0 {ev(1, 5, 30)} {ev(1, 90, 5)} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "cuGraphLaunch" }} }} }}'''
    path = tmp_path / "t.xplane.pb"
    path.write_bytes(jax.profiler.ProfileData.text_proto_to_serialized_xspace(space))
    t = ps.timeline(str(path), steps=1)
    assert (t["span_us"], t["busy_us"]) == (59.0, 20.0)
    assert t["gaps"] == {"XLA other (fusions, copies, scatters)": [1, 39.0]}
    assert t["longest"] == [(39.0, "fp8_linear_mosaic_gpu_kernel", "loop_fusion_1")]
    assert t["host"] == {"python | cuGraphLaunch": [1, 30.0]}  # the event after the last kernel is outside
