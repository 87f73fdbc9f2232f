"""Semantic adaptive tokens (SATs): the spec, the lossless adapter, and the model wrapper.

A SAT placed j positions after the last real token stands in for the token it cannot see and is
asked to predict the token one further on (paper, section 3). Two kinds of SAT weights share one
forward path:

* ``vocab``: the paper's kind. The model itself was fine-tuned and each SAT is an ordinary row of
  its vocabulary (the official CodeLlama-SDSAT checkpoints repeat id 32011).
* ``adapter``: a frozen base model plus learned SAT input embeddings and low-rank updates that are
  applied only at SAT positions. Standard tokens never attend to SATs, so every standard-token
  computation is bit-identical to the base model.

Files: ``sat_spec.json`` (the spec, next to a model or an adapter) and, for the adapter kind,
``adapter_model.safetensors`` plus ``adapter_config.json``; loading is the exact inverse of saving.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from . import cpu_kernels, sat_kernel
from .head import head_beside

SPEC_FILE = "sat_spec.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

# The SAT rows of the current forward pass: (n, (B, T - n) slot of each SAT row) when rows n.. of
# every sequence are SATs, or None when there are none. A ContextVar rather than an attribute on the
# model, so concurrent requests in different threads never see each other's rows.
_SAT_ROWS: contextvars.ContextVar[tuple[int, torch.Tensor] | None] = contextvars.ContextVar("sat_rows", default=None)


@dataclass
class SatSpec:
    """Which tokens are adaptive tokens and where their weights live."""

    kind: str = "adapter"  # "vocab" (SAT ids are rows of the fine-tuned model) or "adapter"
    sat_ids: list[int] = field(default_factory=list)  # vocab kind: id of SAT j (ids may repeat)
    max_k: int = 8  # largest number of SATs (drafts) per step
    adapter: str | None = None  # adapter kind: folder with adapter_config.json + weights

    def __post_init__(self) -> None:
        if self.kind not in ("vocab", "adapter"):
            raise ValueError(f"SAT spec kind must be 'vocab' or 'adapter', got {self.kind!r}")
        if self.max_k < 1:
            raise ValueError(f"SAT spec max_k must be at least 1, got {self.max_k}")
        if self.kind == "vocab":
            if not self.sat_ids:
                raise ValueError("a 'vocab' SAT spec needs sat_ids (one or more token ids)")
            # One id may serve every position, as in the official checkpoints: repeat it up to max_k.
            if len(self.sat_ids) < self.max_k:
                self.sat_ids = [self.sat_ids[i % len(self.sat_ids)] for i in range(self.max_k)]

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / SPEC_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "SatSpec":
        path = Path(folder) / SPEC_FILE
        data = json.loads(path.read_text())
        spec = cls(**data)
        if spec.adapter is not None and not Path(spec.adapter).is_absolute():
            spec.adapter = str((path.parent / spec.adapter).resolve())
        return spec


@dataclass
class AdapterConfig:
    """Shape of a SAT adapter; saved as adapter_config.json."""

    base_model: str  # name of the base model it was trained for (informational)
    hidden_size: int  # must equal the base model's hidden size
    num_layers: int  # must equal the base model's number of decoder layers
    num_sats: int = 8  # number of distinct SAT embeddings (= largest k)
    rank: int = 8  # LoRA rank of the SAT-only updates (0: embeddings only)
    alpha: float = 16.0  # LoRA scale numerator; the update is scaled by alpha / rank
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj", "o_proj", "down_proj"])
    layers: list[int] | None = None  # decoder layers that get updates; None means inject_layer and above
    inject_layer: int = 0  # the SAT embeddings enter here: 0 is the input; above 0 they are added to the
    # residual stream entering that decoder layer, SAT rows start from a fixed token embedding, and
    # training backpropagates through the layers from inject_layer up only (less work per step)
    per_position: bool = False  # each SAT position j gets low-rank updates of its own (columns j*rank.. of A,
    # rows j*rank.. of B) instead of sharing one pair: num_sats times the room for the same work per row
    mlp_width: int = 0  # extra MLP neurons (SwiGLU) in each adapted layer that only SAT rows use: new nonlinear
    # features, where LoRA can only tilt the base model's own; their output weights start at 0

    @property
    def lora_width(self) -> int:
        """Columns of each A (rows of each B): the rank, times num_sats when every position has its own."""
        return self.rank * (self.num_sats if self.per_position else 1)


class SatAdapter(nn.Module):
    """Learned SAT embeddings plus low-rank updates (and, optionally, MLP neurons) that only touch SAT rows.

    The updates are hooks run after the base model's linear layers (`hooked`): ``y = W x + (x A) B * s`` on
    the SAT rows only (the tail of the block), so standard rows get ``W x`` untouched and stay
    bit-identical. With ``mlp_width`` > 0, a hook on each adapted layer's MLP adds ``(silu(x G) * (x U)) D`` to its
    SAT rows the same way. With ``inject_layer > 0`` a pre-hook adds the SAT embeddings to the SAT rows entering
    that layer. The hooks are in place only while a pass with SAT rows runs (`hooked`): a module with any hook takes
    PyTorch's slower call path, which would tax every plain pass, vanilla's included.
    """

    def __init__(self, config: AdapterConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Parameter(torch.zeros(config.num_sats, config.hidden_size))  # (K, H)
        self.lora_a = nn.ParameterDict()  # "layer_module" -> (in, config.lora_width)
        self.lora_b = nn.ParameterDict()  # "layer_module" -> (config.lora_width, out); zero-initialised
        self.mlp_in = nn.ParameterDict()  # "layer" -> (H, 2 * mlp_width): gate and up of the SAT-only neurons
        self.mlp_out = nn.ParameterDict()  # "layer" -> (mlp_width, H); zero-initialised
        # Input embedding of every SAT row when the SAT embeddings are injected higher up; fixed.
        self.register_buffer("base_embedding", torch.zeros(config.hidden_size))  # (H,)
        self._hooks: list[tuple[nn.Module, object, bool]] = []  # (module, hook, is a pre-hook): see `hooked`
        self._installed: list = []  # what `hooked` put in: forwards with their hooks, pre-hook handles
        self._passes = 0  # passes with SAT rows running now (threads may share the model)
        self._lock = threading.Lock()
        self._last_input: tuple[torch.Tensor, int, torch.Tensor] | None = None  # see _sat_input
        self._last_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # see _position_mask
        self._scaled_b: dict[str, tuple[torch.Tensor, tuple, torch.Tensor]] = {}  # see _scaled
        self._kernel = None  # sat_kernel.compiled(), read when the hooks go in (not in each of a pass's 140 hooks)

    @property
    def scale(self) -> float:
        return self.config.alpha / max(self.config.rank, 1)

    @classmethod
    def for_model(cls, model: nn.Module, config: AdapterConfig, init_token_id: int | None = None) -> "SatAdapter":
        """A fresh adapter shaped for `model`; SAT embeddings start as one existing token's embedding."""
        adapter = cls(config)
        check_shapes(model, config)
        emb = model.get_input_embeddings().weight
        with torch.no_grad():
            row = emb[init_token_id] if init_token_id is not None else emb.mean(0)
            adapter.base_embedding.copy_(row.float())
            if config.inject_layer == 0:
                adapter.embeddings.copy_(row.float().expand_as(adapter.embeddings))
        if config.rank > 0:
            gen = torch.Generator().manual_seed(0)
            for key, linear in _target_linears(model, config):
                a = torch.randn(linear.in_features, config.lora_width, generator=gen) / math.sqrt(linear.in_features)
                adapter.lora_a[key] = nn.Parameter(a)
                adapter.lora_b[key] = nn.Parameter(torch.zeros(config.lora_width, linear.out_features))
        hidden, gen = config.hidden_size, torch.Generator().manual_seed(1)
        for key, _ in _adapted_mlps(model, config):
            adapter.mlp_in[key] = nn.Parameter(torch.randn(hidden, 2 * config.mlp_width, generator=gen)
                                               / math.sqrt(hidden))
            adapter.mlp_out[key] = nn.Parameter(torch.zeros(config.mlp_width, hidden))
        return adapter

    def copy(self) -> "SatAdapter":
        """A detached copy with the same weights (to attach to another copy of the model)."""
        twin = SatAdapter(self.config)
        with torch.no_grad():
            twin.embeddings = nn.Parameter(self.embeddings.detach().clone())
            twin.base_embedding.copy_(self.base_embedding)
            for name in ("lora_a", "lora_b", "mlp_in", "mlp_out"):
                for key, value in getattr(self, name).items():
                    getattr(twin, name)[key] = nn.Parameter(value.detach().clone())
        return twin

    def attach(self, model: nn.Module) -> None:
        """Register the SAT-row hooks on `model` and move the weights to its device and dtype."""
        check_shapes(model, self.config)
        self.detach()
        param = next(model.parameters())
        self.to(device=param.device, dtype=param.dtype)
        for key, linear in _target_linears(model, self.config):
            if key not in self.lora_a:
                raise ValueError(f"SAT adapter has no weights for {key}; it was saved for another layout")
            width = self.config.lora_width
            want = [(linear.in_features, width), (width, linear.out_features)]
            have = [tuple(self.lora_a[key].shape), tuple(self.lora_b[key].shape)]
            if have != want:
                raise ValueError(f"SAT adapter weights for {key} have shapes {have[0]} and {have[1]}, but this model "
                                 f"needs {want[0]} and {want[1]}: the adapter was saved for another model")
            self._hooks.append((linear, self._make_hook(key), False))
        for key, mlp in _adapted_mlps(model, self.config):
            hidden, width = self.config.hidden_size, self.config.mlp_width
            if key not in self.mlp_in or [tuple(self.mlp_in[key].shape), tuple(self.mlp_out[key].shape)] != [
                    (hidden, 2 * width), (width, hidden)]:
                raise ValueError(f"SAT adapter has no SAT-only MLP weights of width {width} for layer {key}; "
                                 "it was saved for another layout")
            self._hooks.append((mlp, self._make_mlp_hook(key), False))
        if self.config.inject_layer > 0:
            self._hooks.append((_decoder_layers(model)[self.config.inject_layer], self._inject, True))

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """The SAT hooks in place for a pass with SAT rows: put in by the first such pass, taken out by the last.
        A layer's hook runs inside its forward, not as a registered forward hook: a module with hooks takes
        PyTorch's general call path, which costs more than a draft pass's small updates. A layer with routed CPU
        kernels calls it itself (cpu_kernels.AFTER); any other gets a forward that calls it (`_ForwardHook`). Only
        the injection's pre-hook is registered. Routing a layer's kernels (cpu_kernels.install) or timing its
        forward (pass_parts) while a pass with SAT rows runs is not supported: what either puts in place then
        is left alone, and such a layer may miss its update for that pass."""
        with self._lock:
            if not self._passes:
                self._kernel = None if self.config.per_position else sat_kernel.compiled()
                try:
                    for module, hook, pre in self._hooks:
                        self._installed.append(module.register_forward_pre_hook(hook, with_kwargs=True) if pre
                                               else _AfterProduct(module, hook) if cpu_kernels.routed(module)
                                               else _ForwardHook(module, hook))
                except BaseException:
                    self._remove_installed()
                    raise
            self._passes += 1
        try:
            yield
        finally:
            with self._lock:
                self._passes -= 1
                if not self._passes:
                    self._remove_installed()

    def _remove_installed(self) -> None:
        for installed in reversed(self._installed):
            installed.remove()
        self._installed = []

    def input_embeddings(self, slots: torch.Tensor) -> torch.Tensor:
        """(B, T) SAT slots -> (B, T, H) what the SAT rows feed into the first layer."""
        if self.config.inject_layer == 0:
            return self.embeddings[slots]
        return self.base_embedding.expand(*slots.shape, -1)

    def _inject(self, module: nn.Module, args: tuple, kwargs: dict):
        current = _SAT_ROWS.get()
        if current is None:
            return None
        start, slots = current
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden = _add_to_tail(hidden, start, self.embeddings[slots].to(hidden.dtype), in_place=False)  # may be kept
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def detach(self) -> None:
        with self._lock:
            if self._passes:
                raise RuntimeError("the SAT adapter cannot be detached while a pass with SAT rows runs")
            self._hooks.clear()
        self._last_input = self._last_mask = None
        self._scaled_b.clear()

    def _make_hook(self, key: str):
        # what the compiled path reads, bound once: it runs for each of a draft pass's 140 adapted layers, where
        # every lookup counts (the parameters by their dicts: a ParameterDict's item costs module attribute lookups)
        lora_a, lora_b, scale = self.lora_a._parameters, self.lora_b._parameters, self.scale

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            current = _SAT_ROWS.get()
            if current is None:
                return None
            start, x = current[0], inputs[0]
            decoding = output.shape[0] == 1 and not torch.is_grad_enabled()
            kernel = self._kernel  # None with per-position updates (see `hooked`)
            if decoding and kernel is not None and kernel.sat_update(output, x, start, lora_a[key], lora_b[key], scale):
                return output  # one call, where it applies (sat_kernel.py)
            a, b = self.lora_a[key], self.lora_b[key]
            if decoding:
                # Decoding: this hook runs for every adapted layer of a draft pass, so each op counts on a CPU:
                # the SAT rows' input is cast once for the layers that share it (q/k/v, gate/up), the scale
                # is folded into B, and the float32 update of a bfloat16 model is added without a cast.
                low = self._sat_input(x, start, a.dtype) @ a
                if self.config.per_position:
                    low.mul_(self._position_mask(current[1], a.dtype)[0])
                b = self._scaled(key, b)
                if b.dtype == output.dtype:
                    output[0, start:].addmm_(low, b)
                else:
                    output[0, start:] += low @ b
                return output
            low = x[:, start:].to(a.dtype) @ a
            if self.config.per_position:
                low = low * self._position_mask(current[1], a.dtype)
            return _add_to_tail(output, start, (low @ b * self.scale).to(output.dtype))

        return hook

    def _make_mlp_hook(self, key: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            current = _SAT_ROWS.get()
            if current is None:
                return None
            start, w_in, w_out = current[0], self.mlp_in[key], self.mlp_out[key]
            gate, up = (inputs[0][:, start:].to(w_in.dtype) @ w_in).chunk(2, dim=-1)
            return _add_to_tail(output, start, (nn.functional.silu(gate) * up @ w_out).to(output.dtype))

        return hook

    def _sat_input(self, x: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
        """The SAT rows of a layer input in the adapter's dtype, cast once per input tensor."""
        last = self._last_input
        if last is not None and last[0] is x and last[1] == start and last[2].dtype == dtype:
            return last[2]
        rows = x[0, start:].to(dtype)
        self._last_input = (x, start, rows)  # one tuple: a thread decoding beside this one sees old or new, whole
        return rows

    def _position_mask(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, T - n, num_sats * rank): 1 in the rank columns of each SAT row's own position, 0 elsewhere,
        made once per pass (every hooked layer of the pass gets the same `slots` tensor)."""
        kept = self._last_mask
        if kept is not None and kept[0] is slots and kept[1].dtype == dtype:
            return kept[1]
        mask = nn.functional.one_hot(slots, self.config.num_sats).to(device=self.embeddings.device, dtype=dtype)
        mask = mask.repeat_interleave(self.config.rank, dim=-1)
        self._last_mask = (slots, mask)  # one tuple, as in _sat_input
        return mask

    def _scaled(self, key: str, b: torch.Tensor) -> torch.Tensor:
        """B times the LoRA scale, kept until B changes: another parameter, moved or converted (new storage),
        trained or loaded in place (a new version)."""
        stamp = (b.data_ptr(), b._version, b.dtype, self.scale)
        kept = self._scaled_b.get(key)
        if kept is None or kept[0] is not b or kept[1] != stamp:
            kept = self._scaled_b[key] = (b, stamp, b.detach() * self.scale)
        return kept[2]

    def save(self, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Weights as `dtype`: float32 loads back bit-exactly, float16 halves the file (the shipped adapter)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {"embeddings": self.embeddings, "base_embedding": self.base_embedding}
        tensors.update({f"lora_a.{k}": v for k, v in self.lora_a.items()})
        tensors.update({f"lora_b.{k}": v for k, v in self.lora_b.items()})
        tensors.update({f"mlp_in.{k}": v for k, v in self.mlp_in.items()})
        tensors.update({f"mlp_out.{k}": v for k, v in self.mlp_out.items()})
        save_file({k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()},
                  str(folder / ADAPTER_WEIGHTS_FILE))
        (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "SatAdapter":
        folder = Path(folder)
        config_path, weights_path = folder / ADAPTER_CONFIG_FILE, folder / ADAPTER_WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ValueError(f"SAT adapter file not found: {path}")
        try:
            config = AdapterConfig(**json.loads(config_path.read_text()))
            tensors = {k: v.float() for k, v in load_file(str(weights_path)).items()}  # may be stored as float16
        except (json.JSONDecodeError, TypeError, SafetensorError, OSError) as err:
            raise ValueError(f"SAT adapter in {folder} is unreadable ({err}); re-save or re-train it") from err
        adapter = cls(config)
        expected = (config.num_sats, config.hidden_size)
        if "embeddings" not in tensors or tuple(tensors["embeddings"].shape) != expected:
            raise ValueError(f"SAT adapter in {folder}: embeddings must have shape {expected}")
        adapter.embeddings.data = tensors.pop("embeddings")
        if "base_embedding" in tensors:
            adapter.base_embedding.copy_(tensors.pop("base_embedding"))
        for name, tensor in tensors.items():
            part, _, key = name.partition(".")
            if part not in ("lora_a", "lora_b", "mlp_in", "mlp_out"):
                raise ValueError(f"SAT adapter in {folder}: unexpected tensor {name}")
            getattr(adapter, part)[key] = nn.Parameter(tensor)
        return adapter


def check_shapes(model: nn.Module, config: AdapterConfig) -> None:
    """Refuse an adapter made for a model of another shape, naming the mismatch."""
    hidden = model.get_input_embeddings().weight.shape[1]
    layers = len(_decoder_layers(model))
    if (hidden, layers) != (config.hidden_size, config.num_layers):
        raise ValueError(
            f"SAT adapter is for a model with hidden size {config.hidden_size} and {config.num_layers} layers "
            f"(base model {config.base_model!r}), but this model has hidden size {hidden} and {layers} layers"
        )
    if not 0 <= config.inject_layer < layers:
        raise ValueError(f"SAT adapter inject_layer must be between 0 and {layers - 1}, got {config.inject_layer}")


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.layers


def _adapted_layers(config: AdapterConfig, count: int) -> range | list[int]:
    """The decoder layers an adapter updates: `layers`, or inject_layer and above of `count`."""
    return range(config.inject_layer, count) if config.layers is None else config.layers


def _target_linears(model: nn.Module, config: AdapterConfig) -> Iterator[tuple[str, nn.Linear]]:
    layers = _decoder_layers(model)
    if config.rank == 0:
        return
    for i in _adapted_layers(config, len(layers)):
        for name, module in layers[i].named_modules():
            if name.split(".")[-1] in config.target_modules and isinstance(module, nn.Linear):
                yield f"{i}_{name.replace('.', '_')}", module


def _adapted_mlps(model: nn.Module, config: AdapterConfig) -> Iterator[tuple[str, nn.Module]]:
    """The MLP of every adapted layer, by layer number, when the adapter has SAT-only MLP neurons."""
    if config.mlp_width == 0:
        return
    layers = _decoder_layers(model)
    for i in _adapted_layers(config, len(layers)):
        if not isinstance(getattr(layers[i], "mlp", None), nn.Module):
            raise ValueError(f"mlp_width needs decoder layers with an `mlp` module; layer {i} of this model has none")
        yield str(i), layers[i].mlp


def _add_to_tail(x: torch.Tensor, start: int, delta: torch.Tensor, in_place: bool = True) -> torch.Tensor:
    """x (B, T, D) with delta (B, T - start, D) added to rows start..; the rows before are not touched.

    Only the SAT rows pay for the low-rank update (a masked update of the whole block would cost the
    standard rows too). In place (into a linear layer's fresh output) unless training.
    """
    if not in_place or torch.is_grad_enabled():
        return torch.cat([x[:, :start], x[:, start:] + delta], dim=1)
    x[:, start:] += delta
    return x


def cache_keyword(module: nn.Module) -> str:
    """The keyword a model takes its KV cache by: `cache` in recent transformers, `past_key_values` in
    releases before the rename (which take `cache=` into **kwargs and silently decode without the cache).
    Read off the model class, under a wrapper such as peft's, whose forward takes **kwargs only."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return _cache_keyword(type(base))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters or "past_key_values" not in parameters else "past_key_values"


def call_with_cache(module: nn.Module, cache, **kwargs):
    """`module(**kwargs)` with `cache` (or None) passed by the keyword the model takes."""
    return module(**kwargs, use_cache=cache is not None, **{cache_keyword(module): cache})


class _AfterProduct:
    """`hook` called by a routed layer after its product (cpu_kernels.AFTER), until `remove`."""

    def __init__(self, module: nn.Module, hook):
        self.module, self.hook = module, hook
        module.__dict__[cpu_kernels.AFTER] = hook

    def remove(self) -> None:
        if self.module.__dict__.get(cpu_kernels.AFTER) is self.hook:
            del self.module.__dict__[cpu_kernels.AFTER]


class _ForwardHook:
    """`module`'s forward followed by `hook(module, args, output)` (which returns None or the output to use), as
    PyTorch calls a forward hook, until `remove`. The forward wrapped is the one in place: routed kernels' or a
    timer's, put back as it was."""

    def __init__(self, module: nn.Module, hook):
        self.module, self.previous = module, module.__dict__.get("forward")
        inner = module.forward

        def forward(*args, **kwargs):
            output = inner(*args, **kwargs)
            changed = hook(module, args, output)
            return output if changed is None else changed

        module.forward = self.forward = forward

    def remove(self) -> None:
        """Put back the forward that was there, unless something has replaced this one since."""
        if self.module.__dict__.get("forward") is not self.forward:
            return
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


@contextlib.contextmanager
def sat_rows(start: int, slots: torch.Tensor) -> Iterator[None]:
    """Mark rows start.. of every sequence in this block as SATs, with their (B, T - start) slots."""
    token = _SAT_ROWS.set((start, slots))
    try:
        yield
    finally:
        _SAT_ROWS.reset(token)


class SatModel:
    """A causal LM with its SATs: the one forward path the decoders and the trainer use."""

    def __init__(self, model: nn.Module, spec: SatSpec, adapter: SatAdapter | None = None):
        if spec.kind == "adapter" and adapter is None:
            raise ValueError("an 'adapter' SAT spec needs a SatAdapter")
        vocab = model.get_input_embeddings().weight.shape[0]
        if spec.kind == "vocab":
            bad = sorted({i for i in spec.sat_ids if not 0 <= i < vocab})  # one id may repeat for every position
            if bad:
                raise ValueError(f"SAT ids {bad} are outside the vocabulary (allowed 0..{vocab - 1})")
        if adapter is not None:
            spec.max_k = min(spec.max_k, adapter.config.num_sats)
            adapter.attach(model)
        self.model, self.spec, self.adapter = model, spec, adapter
        # The sampler head saved beside the adapter, if any (head.py): it conditions each draft on the token before it.
        self.sampler = head_beside(spec.adapter) if spec.kind == "adapter" else None
        if self.sampler is not None:
            self.sampler.to(self.device)

    @property
    def max_k(self) -> int:
        return self.spec.max_k

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sat_block(self, k: int) -> torch.Tensor:
        """Slots 0..k-1: the `sat_slots` values of a run of k SATs, shape (k,)."""
        if not 1 <= k <= self.max_k:
            raise ValueError(f"k (number of adaptive tokens) must be between 1 and {self.max_k}, got {k}")
        return torch.arange(k, device=self.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T); ignored where sat_slots >= 0
        sat_slots: torch.Tensor | None = None,  # (B, T): -1 for standard tokens, j for the j-th SAT of a run
        cache=None,
        attention_mask: torch.Tensor | None = None,  # 2-D padding mask or a 4-D additive mask
        position_ids: torch.Tensor | None = None,  # (B, T)
        logits_to_keep: int | torch.Tensor = 0,  # 0: every position; a 1-D tensor: those positions only
    ) -> torch.Tensor:
        """Logits (B, T, V) for a block that may contain SATs (T' positions if `logits_to_keep` selects)."""
        return self._run(self.model, input_ids, sat_slots, cache=cache, attention_mask=attention_mask,
                         position_ids=position_ids, logits_to_keep=logits_to_keep).logits

    # Families whose logits are exactly lm_head(last hidden state): no soft-capping or logit scaling.
    _PLAIN_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

    @property
    def plain_head(self) -> bool:
        """True when `head(hidden_states(...))` equals `forward(...)`, so rows can be projected on demand."""
        return getattr(self.model.config, "model_type", None) in self._PLAIN_HEAD_TYPES

    def hidden_states(self, input_ids: torch.Tensor, sat_slots: torch.Tensor | None = None, cache=None,
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, H) of the same block `forward` takes; `head` turns chosen rows into logits."""
        return self._run(self.model.get_decoder(), input_ids, sat_slots, cache=cache, attention_mask=attention_mask,
                         position_ids=position_ids).last_hidden_state

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states (only valid when `plain_head`)."""
        return self.model.get_output_embeddings()(hidden)

    def _run(self, module: nn.Module, input_ids: torch.Tensor, sat_slots: torch.Tensor | None, cache, **kwargs):
        if sat_slots is None or not bool((sat_slots >= 0).any()):
            return call_with_cache(module, cache, input_ids=input_ids, **kwargs)
        is_sat = sat_slots >= 0
        if self.spec.kind == "vocab":
            ids = torch.as_tensor(self.spec.sat_ids, device=input_ids.device)
            input_ids = torch.where(is_sat, ids[sat_slots.clamp(min=0)], input_ids)
            return call_with_cache(module, cache, input_ids=input_ids, **kwargs)
        start = int((~is_sat[0]).sum())
        if bool(is_sat[:, :start].any()) or not bool(is_sat[:, start:].all()):
            raise ValueError("SAT rows must come after the standard tokens of a block (see SatLayout)")
        slots = sat_slots[:, start:]
        embed = self.model.get_input_embeddings()(input_ids[:, :start])  # (B, n, H)
        sat_embed = self.adapter.input_embeddings(slots).to(embed.dtype)  # (B, T - n, H)
        with sat_rows(start, slots), self.adapter.hooked():
            return call_with_cache(module, cache, inputs_embeds=torch.cat([embed, sat_embed], dim=1), **kwargs)
