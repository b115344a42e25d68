"""What `rollout.name=native` does with a model the native engine cannot run: the `hf` backend, said in one line.

The native engine implements a few decoder families (model.py's SUPPORTED_MODEL_TYPES). Any other model (another
architecture, or a supported one with a feature the engine lacks: sliding-window layers, biases, a rope type) still
trains: generation runs on the `hf` backend (transformers' own forward; slower, but any causal LM), and the log says
why. Where the hf backend cannot do what the config asks either (FP8 KV or weights, the routing record for R3), the
run stops with one sentence naming the families the native engine runs.
"""

from __future__ import annotations

import torch

from polyrl.errors import ConfigError
from polyrl.rollout.native.model import SUPPORTED_MODEL_TYPES, UnsupportedModel


def fall_back_to_hf(cfg, model, why: UnsupportedModel, *, record_routes: bool, pad_token_id: int,
                    device: torch.device, max_model_len: int):
    """The hf rollout for a model `why` says the native engine cannot run, or a ConfigError where hf cannot serve
    `cfg` (its FP8 keys, or R3's routing record)."""
    from polyrl.rollout.hf import build_hf_rollout

    needs = [k for k, on in (("kv_cache_dtype=" + str(cfg.kv_cache_dtype), cfg.kv_cache_dtype != "auto"),
                             ("quantization=" + str(cfg.quantization), cfg.quantization is not None),
                             ("enable_rollout_routing_replay=True", record_routes)) if on]
    if needs:
        raise ConfigError(f"actor_rollout_ref.rollout.name=native cannot run this model ({why.reason}) and the hf "
                          f"backend it falls back to has no actor_rollout_ref.rollout.{needs[0]}; drop "
                          f"{', '.join(k.split('=')[0] for k in needs)}, or use a model the native engine runs "
                          f"(model_type in {SUPPORTED_MODEL_TYPES}).")
    print(f"polyrl: {why.reason}: generating with actor_rollout_ref.rollout.name=hf (transformers' forward, slower) "
          "for this model")
    if device.type == "cuda" and next(model.parameters()).device != device:  # multi-GPU runs keep it on the host
        model.to(device)
    return build_hf_rollout(cfg, model, pad_token_id=pad_token_id, device=device, max_model_len=max_model_len)


def check_routing_record(cfg, spec, record_routes: bool) -> None:
    """R3 records routed experts: a dense model has none."""
    if record_routes and not spec.num_experts:
        raise ConfigError(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True records routed experts, but "
                          f"model_type={spec.model_type!r} has none; set it to False (routing replay is for "
                          "Mixture-of-Experts models).")
