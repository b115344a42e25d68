"""polyrl's native rollout engine (`actor_rollout_ref.rollout.name=native`): paged KV cache, continuous batching,
prompt sharing, CUDA-graph decode and on-device sampling for Qwen2/2.5/3, Llama and Qwen2/3-MoE, with no vLLM
dependency. Other models run on the `hf` backend (fallback.py; docs/models.md).

Files, in reading order: model.py (the decoder, fused projections, HF weight mapping), moe.py (MoE layers: router,
grouped expert GEMMs, the routing record), attention.py (+ paged_decode.py,
the Triton kernel), block_manager.py, scheduler.py, fused.py (the fused sampling and norm kernels), cuda_graph.py, engine.py (the loop and public API).
Importing this package registers the backend under "native".
"""

from polyrl.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
