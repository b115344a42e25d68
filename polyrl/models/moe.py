"""Mixture-of-Experts support for HF models, applied from outside the model code.

transformers 5 writes an MoE block as a router module (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, ...: a
`[num_experts, hidden]` weight, `top_k`, `norm_topk_prob`) returning `(router_logits, top_k_weights, top_k_index)`,
and an experts module holding every expert as one 3-D tensor, run through the `experts_implementation` interface
(`grouped_mm` by default: `torch._grouped_mm` on CUDA and on CPU). polyrl trains that module as it is; this file
adds what RL needs around the router, through one forward hook per router (`MoERouting`), so the model code knows
nothing of replay:

- **Routing replay** (verl's `actor.router_replay.mode`): the hook swaps the router's own top-k ids for recorded ones
  (`[tokens, num_moe_layers, top_k]`, -1 rows: keep the router's own choice). The gate weights still come from the
  live logits, `softmax(logits)` over all experts gathered at the replayed ids and renormalised when the config says
  `norm_topk_prob`, so the router keeps getting gradients (R3, arXiv 2510.11370).
- **Recording**: the ids the router chose, per layer (the trainer's own routes for R2, the hf rollout's for R3).
- **Router agreement**: under replay, the share of (token, layer) pairs whose own top-k set equals the replayed one.
- **Load-balancing loss**: the router logits of the last forward, for the model's own `load_balancing_loss_func`
  (Switch-Transformer aux loss, scaled by `router_aux_loss_coef` when `output_router_logits` is set).

State set by `begin()` stays until the next `begin()`: a checkpointed layer re-runs its forward during backward and
must route exactly as in the forward (a recorded layer is overwritten with the same ids; replay replays again).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch


_GROUPED_MM_AUTOCAST = False


def grouped_mm_under_autocast() -> None:
    """Put `torch._grouped_mm` on CUDA autocast's lower-precision list (once per process). It is not on it, so HF's
    `grouped_mm` experts ran fp32 GEMMs over the fp32 master weights under bf16 autocast: two thirds of a 30B-A3B
    token's FLOPs off the tensor cores (the 12-layer step's update at 4% MFU on 2 H200s)."""
    global _GROUPED_MM_AUTOCAST
    if not _GROUPED_MM_AUTOCAST:
        torch.library.register_autocast("aten::_grouped_mm", "cuda", torch.bfloat16)
        _GROUPED_MM_AUTOCAST = True


def find_routers(model) -> list[torch.nn.Module]:
    """The router of every MoE layer, in decoder-layer order (peft wrappers looked through); [] for a dense model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = []
    for name, mod in base.named_modules():
        w = getattr(mod, "weight", None)
        if (hasattr(mod, "top_k") and hasattr(mod, "num_experts") and isinstance(w, torch.Tensor) and w.dim() == 2
                and w.shape[0] == mod.num_experts and type(mod).__name__.endswith("Router")):
            out.append(mod)
    return out


def is_moe_config(config) -> bool:
    return bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)
                or getattr(config, "n_routed_experts", 0))


def _same_sets(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    return (a_NK.sort(-1).values == b_NK.sort(-1).values).all(-1)


class MoERouting:
    """Forward hooks on every router of one model (module doc). They act only inside `plan(...)`, which says what the
    forwards in it do; `begin()` hands each forward its routes. Copies of the model (a reference policy made with
    deepcopy) carry copies of the hooks, which see a router that is not this model's and do nothing."""

    def __init__(self, model):
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router module this version of polyrl recognises.")
        self.num_layers = len(self.routers)
        grouped_mm_under_autocast()
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = base.config
        self._aux_fn = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
        self._planned = False
        self._apply = self._record = self._collect = False
        self._routes_NLK: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        self.recorded: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.agreement: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # one hook object for every router, kept out of torch.compile: a per-layer closure made compiled decoder
        # layers recompile once per layer (dynamo guards the closure's layer index) until the recompile limit
        # (8) sent the rest eager, with more activation memory than planned (an OOM on 2 H200s, 12-layer 30B-A3B)
        self._layer_of = {id(r): i for i, r in enumerate(self.routers)}
        hook = torch.compiler.disable(self._on_router)
        self._handles = [r.register_forward_hook(hook) for r in self.routers]

    # ---- what the forwards do ----------------------------------------------------------------------------------
    @contextmanager
    def plan(self, *, replay: bool = False, record: bool = False, collect_logits: bool = False):
        """Inside: forwards given routes (`begin`) replay them (`replay`; else they only measure the agreement),
        record the ids chosen (`record`) and keep the router logits for the aux loss (`collect_logits`). State
        lasts until the next `begin()` (a checkpointed layer's recomputation in backward must route as its
        forward did) and is dropped on exit."""
        self._planned, self._apply, self._record, self._collect = True, replay, record, collect_logits
        try:
            yield self
        finally:
            self._planned = self._apply = self._record = self._collect = False
            self.begin()

    @property
    def planned(self) -> bool:
        return self._planned

    def begin(self, routes_NLK: torch.Tensor | None = None, token_mask: torch.Tensor | None = None) -> None:
        """Before each forward: its recorded routes `[tokens in the forward's order, num_moe_layers, top_k]` (or
        None) and, for the aux loss of a padded forward, its attention mask. The previous forward's state goes."""
        if routes_NLK is not None:
            assert routes_NLK.shape[1:] == (self.num_layers, self.top_k), (tuple(routes_NLK.shape), self.num_layers,
                                                                           self.top_k)
        self._routes_NLK, self.token_mask = routes_NLK, token_mask
        self.recorded, self.logits, self.agreement = {}, {}, {}

    def take_recorded(self) -> torch.Tensor:
        """`[tokens, num_moe_layers, top_k]` int16: the ids each layer used in the last forward."""
        assert len(self.recorded) == self.num_layers, "record=True was not planned, or the forward did not run"
        return torch.stack([self.recorded[i] for i in range(self.num_layers)], dim=1)

    def agreement_counts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(matching (token, layer) pairs, pairs with a recorded route) of the last forward; None without routes."""
        if not self.agreement:
            return None
        match = sum(m for m, _ in self.agreement.values())
        total = sum(t for _, t in self.agreement.values())
        return match, total

    def aux_loss(self) -> torch.Tensor:
        """The model's own load-balancing loss over the last forward's router logits (unscaled; the padding of a
        padded forward excluded through `token_mask`)."""
        assert self._aux_fn is not None, "this model family has no load_balancing_loss_func"
        assert len(self.logits) == self.num_layers, "collect_logits=True was not planned, or the forward did not run"
        logits = tuple(self.logits[i] for i in range(self.num_layers))
        return self._aux_fn(logits, self.num_experts, self.top_k, self.token_mask)

    @property
    def aux_loss_coef(self) -> float:
        """`router_aux_loss_coef` when the config asks for the aux loss (`output_router_logits`), else 0."""
        if not getattr(self.config, "output_router_logits", False):
            return 0.0
        return float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- the hook ----------------------------------------------------------------------------------------------
    def _on_router(self, module, args, output):
        layer = self._layer_of.get(id(module))
        if not self._planned or layer is None or module is not self.routers[layer]:
            return None
        logits, weights, ids = output
        if self._collect:
            self.logits[layer] = logits
        if self._record:
            self.recorded[layer] = ids.detach().to(torch.int16)
        if self._routes_NLK is None:
            return None
        want = self._routes_NLK[:, layer]
        if want.shape[0] != ids.shape[0]:
            raise RuntimeError(f"routing replay: {want.shape[0]} recorded rows for a forward of {ids.shape[0]} "
                               "tokens (the routes must be laid out as the forward's input ids).")
        want = want.to(ids.device, torch.long)
        have = want[:, 0] >= 0  # -1 rows: not recorded, the router's own choice stands
        with torch.no_grad():
            self.agreement[layer] = ((_same_sets(ids, want) & have).sum(), have.sum())
        if not self._apply:
            return None
        chosen = torch.where(have[:, None], want, ids)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        gate = probs.gather(1, chosen)
        if getattr(module, "norm_topk_prob", False):
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return logits, gate.to(weights.dtype), chosen


# ------------------------------------------------------------------------------------------- training experts
def _grouped_experts_forward(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor):
    """An HF experts module's forward as two `torch._grouped_mm` calls in the compute dtype: the expert weights are
    cast the way autocast casts a Linear's (the cast is differentiable, so fp32 master weights get their gradients).
    HF's own `grouped_mm` forward runs a Python loop of per-expert fp32 matmuls instead whenever the weights are not
    bf16 under torch.compile (transformers' `_can_use_grouped_mm`): the trainer's fp32 master weights with compiled
    decoder layers, i.e. every planned GPU update. Other dtypes (fp32 on CPU) keep HF's forward."""
    kind = hidden_TD.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.gate_up_proj.dtype
    if dtype != torch.bfloat16:
        return self._hf_forward(hidden_TD, ids_TK, weights_TK)
    T, K = ids_TK.shape
    expert_S, order_S = torch.sort(ids_TK.reshape(-1))
    offs_E = torch.searchsorted(expert_S, torch.arange(self.num_experts, device=expert_S.device), right=True,
                                out_int32=True)  # cumulative rows through each expert
    x_SD = hidden_TD[order_S // K].to(dtype)
    gate_up_SN = torch._grouped_mm(x_SD, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs_E)
    gate, up = gate_up_SN.chunk(2, dim=-1)
    y_SD = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offs=offs_E)
    y_SD = y_SD * weights_TK.reshape(-1)[order_S, None].to(dtype)
    out_SD = torch.empty_like(y_SD).index_copy(0, order_S, y_SD)  # back to (token, k) order: a permutation
    return out_SD.view(T, K, -1).sum(dim=1).to(hidden_TD.dtype)


def grouped_experts(model) -> int:
    """Give every routed-experts module of `model` `_grouped_experts_forward` (applied per instance, from outside the
    model code; deep copies keep it). Modules in a layout it does not cover (transposed, biased, ungated, a post
    norm, expert-parallel) keep HF's. Returns how many modules changed."""
    changed = 0
    for mod in model.modules():
        gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
                and hasattr(mod, "num_experts") and hasattr(mod, "act_fn")):
            continue
        E, two_i, D = gate_up.shape
        if (down.shape != (E, D, two_i // 2) or getattr(mod, "is_transposed", False) or getattr(mod, "has_bias", False)
                or not getattr(mod, "has_gate", True) or not getattr(mod, "is_concatenated", True)
                or getattr(mod, "has_post_expert_norm", False) or getattr(mod, "_is_expert_parallel", False)
                or "_hf_forward" in vars(mod)):
            continue
        mod._hf_forward = mod.forward
        mod.forward = types.MethodType(_grouped_experts_forward, mod)
        changed += 1
    return changed


# ---------------------------------------------------------------------------------------------- parameter counts
def expert_parameters(model) -> list[torch.nn.Parameter]:
    """The routed experts' weights (3-D `[num_experts, ...]` tensors of `*.experts.*` modules)."""
    return [p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]


def expert_parameter_targets(model) -> list[str]:
    """peft `target_parameters` for LoRA on every routed expert tensor (`experts.gate_up_proj`, ...); [] if dense."""
    names = {n.split(".experts.")[-1] for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    return sorted(f"experts.{n}" for n in names)


def parameter_counts(model) -> tuple[int, int]:
    """(total, active per token): a token runs top_k of num_experts routed experts, and every other weight.

    Weights, gradients and optimizer state scale with the total; a token's FLOPs and activations with the active
    count. Dense models: both equal."""
    total = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if config is None or not is_moe_config(config):
        return total, total
    experts = sum(p.numel() for p in expert_parameters(model))
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) \
        or getattr(config, "n_routed_experts")
    top_k = getattr(config, "num_experts_per_tok")
    return total, total - experts + experts * top_k // num_experts


REPLAY_MODES = ("disabled", "R2", "R3")


def check_router_replay(mode: str, rollout_records: bool, model_is_moe: bool, sp_size: int = 1) -> None:
    """verl's rules for `actor.router_replay.mode` and `rollout.enable_rollout_routing_replay`, as one sentence each."""
    from polyrl.errors import ConfigError

    key = "actor_rollout_ref.actor.router_replay.mode"
    if mode not in REPLAY_MODES:
        raise ConfigError(f"{key}={mode!r} is not a routing-replay mode; use one of {', '.join(REPLAY_MODES)}.")
    if (mode != "disabled" or rollout_records) and not model_is_moe:
        raise ConfigError(f"{key}={mode} / actor_rollout_ref.rollout.enable_rollout_routing_replay="
                          f"{rollout_records} need a Mixture-of-Experts model and this one is dense; leave both unset.")
    if mode == "R3" and not rollout_records:
        raise ConfigError(f"{key}=R3 replays the rollout's routes; set actor_rollout_ref.rollout."
                          "enable_rollout_routing_replay=True so the engine records them.")
    if mode == "R2" and rollout_records:
        raise ConfigError(f"{key}=R2 replays the old-log-prob pass's own routes, so actor_rollout_ref.rollout."
                          "enable_rollout_routing_replay=True (R3's) conflicts with it (as in verl); drop one.")
    if mode != "disabled" and sp_size > 1:
        raise ConfigError(f"{key}={mode} does not run with ulysses_sequence_parallel_size={sp_size} yet; set "
                          "router_replay.mode=disabled or ulysses_sequence_parallel_size=1.")
