"""FP8 (float8_e4m3fn) weights read from the checkpoint, with FP8 activations where the format says.

Two checkpoint formats, one runtime layout:

* ``quant_method: fp8`` (vLLM's Fp8LinearMethod, transformers' FineGrainedFP8):
      weight              float8_e4m3fn [out, in]
      weight_scale        float32 []/[1]                 per-tensor (AutoFP8, vLLM), or
      weight_scale_inv    float32 []/[1] or [ceil(out/bn), ceil(in/bk)]
                                                         per-tensor (transformers) or block-wise
                                                         (``weight_block_size: [bn, bk]``, DeepSeek/Qwen)
      input_scale / activation_scale  float32 []/[1]     ``activation_scheme: static`` only
  ``activation_scheme: dynamic`` quantizes the activations per token (block-wise: per token
  and block of ``bk`` inputs, as DeepSeek's ``act_quant``).
* compressed-tensors ``float-quantized`` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK):
      weight              float8_e4m3fn [out, in]
      weight_scale        [1] (tensor), [out, 1] (channel) or [ceil(out/bn), ceil(in/bk)] (block)
      input_scale         [1]                            static tensor activations only
  ``input_activations``: null (W8A16: weight-only), dynamic ``token`` or ``group`` (of the
  block's ``bk``), or static ``tensor``.

    W[o, i] = e4m3(weight[o, i]) * scale[o, i / group]

Runtime layout (``native/csrc/fp8_linear.c``): ``weight`` stays float8_e4m3fn (1 byte per
weight), ``weight_scale`` is float32 ``[out, in / group]``: a per-tensor or per-channel scale
is one group per row, a block scale is expanded over its block's rows (so any row slice, a
tensor-parallel shard or a fused q/k/v part, keeps its own scales; a quarter of a percent of
the weight's bytes for 128-wide blocks). Row-parallel shards must hold whole input blocks.

Activations (``quantize_activations``): W8A8 formats compute what the format means: the
activation is rounded to e4m3 with its scale (``amax / 448`` per token or token-block, or the
static ``input_scale``) and the product taken with the dequantized weight, as compressed-tensors'
fake-quantized forward does (and as ``torch._scaled_mm`` computes in one step on sm_89+ GPUs).
Fused projections (q/k/v, gate/up) read one input: their static input scales collapse to the
largest, as vLLM does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.linear import QUANTIZED_FORWARD, ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.base import QuantMethod, native_f32, scratch_buffer
from pagedllm.layers.quantization.checkpoint import CheckpointTensor, shard_into
from pagedllm.layers.quantization.config import require
from pagedllm.native import abi, bindings
from pagedllm.native.build import HEADER

# largest finite float8_e4m3fn, from the header the C kernels use (native/abi.py reads constants this way)
FP8_MAX = float(abi.header_constant(HEADER.read_text(), "PN_FP8_E4M3_MAX"))
# up to this many rows the C kernel (bytes widened in registers) beats dequantize + MKL GEMM;
# measured with the AVX-512 kernel on the ~200M model's 64 projections, 2 threads
# (benchmarks/quant_kernels.py --tokens T --kinds fp8,fp8-gemm, ms per step, kernel / widen +
# GEMM): 16 rows 45.0 / 71.8, 24 rows 63.7 / 78.6, 32 rows 81.7 / 86.6, 40 rows 102.3 / 98.5,
# 48 rows 119.4 / 110.0 (capped at run time by the library's own limit,
# NativeLibrary.max_decode_tokens). Block-wise scales (128) measure the same: 87.0 at 32 rows.
C_MAX_ROWS = 32
ACT_MODES = ("none", "token", "group", "static")
CT_WEIGHT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme:
    """What one FP8 checkpoint's layers hold and how activations are quantized."""

    block: tuple[int, int] | None  # (bn, bk) block-wise weight scales, else None
    per_channel: bool  # one weight scale per output row (compressed-tensors "channel")
    act: str  # one of ACT_MODES
    scale_names: tuple[str, ...]  # the weight-scale tensor's names in the checkpoint (one is present)
    input_scale_names: tuple[str, ...]  # static activation scale names (one is present)


class Fp8Method(QuantMethod):
    """FP8 weights (and activations) from a ``fp8`` or compressed-tensors ``float-quantized`` checkpoint."""

    name = "fp8"
    bits = 8
    scale_bytes_per_group = 4  # float32 scale, no zero point (``projection_layout``)

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme
        self.group_size = scheme.block[1] if scheme.block else -1

    # --- reading quantization_config ---------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: dict) -> Fp8Method:
        """``quant_method: fp8`` (vLLM / transformers)."""
        fmt = cfg.get("fmt", "e4m3")
        require(fmt == "e4m3", "fmt", fmt, "'e4m3' (float8_e4m3fn weights)")
        act = cfg.get("activation_scheme", "dynamic")  # transformers' and vLLM's default
        require(act in ("dynamic", "static"), "activation_scheme", act, "one of ('dynamic', 'static')")
        require(cfg.get("scale_fmt", "float") == "float", "scale_fmt", cfg.get("scale_fmt"), "'float'")
        block = cfg.get("weight_block_size")
        require(block is None or (len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)),
                "weight_block_size", block, "null or two positive integers [block_out, block_in]")
        mode = "static" if act == "static" else ("group" if block else "token")
        return cls(Fp8Scheme(tuple(block) if block else None, False, mode, ("weight_scale", "weight_scale_inv"),
                             ("input_scale", "activation_scale")))

    @classmethod
    def from_compressed_tensors(cls, scheme: dict) -> Fp8Method:
        """One ``config_groups`` scheme with ``format: float-quantized``."""
        w = scheme.get("weights") or {}
        require(w.get("type") == "float" and w.get("num_bits") == 8, "weights.(type, num_bits)",
                (w.get("type"), w.get("num_bits")), "('float', 8)")
        require(w.get("symmetric", True), "weights.symmetric", w.get("symmetric"), "true")
        strategy = w.get("strategy")
        require(strategy in CT_WEIGHT_STRATEGIES, "weights.strategy", strategy, f"one of {CT_WEIGHT_STRATEGIES}")
        require(not w.get("dynamic", False), "weights.dynamic", w.get("dynamic"), "false")
        block = tuple(w.get("block_structure") or ()) if strategy == "block" else None
        require(block is None or len(block) == 2, "weights.block_structure", block, "[block_out, block_in]")
        act = _ct_activation_mode(scheme.get("input_activations"), block)
        return cls(Fp8Scheme(block, strategy == "channel", act, ("weight_scale",), ("input_scale",)))

    # --- before loading ------------------------------------------------------------------------

    def create_weights(self, layer: torch.nn.Module) -> None:
        out_features, in_features = layer.weight.shape
        device = layer.weight.device
        del layer.weight  # the fp8 weight takes its place
        groups = self._local_groups(layer, in_features)
        self._register(layer, CheckpointTensor("weight", "codes"),
                       torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        for name in self.scheme.scale_names:
            self._register(layer, CheckpointTensor(name, "scale", optional=True),
                           torch.zeros(out_features, groups, device=device))
        if self.scheme.act == "static":
            for name in self.scheme.input_scale_names:
                self._register(layer, CheckpointTensor(name, "input_scale", optional=True),
                               torch.zeros(1, device=device))

    def _register(self, layer: torch.nn.Module, spec: CheckpointTensor, data: torch.Tensor) -> None:
        param = torch.nn.Parameter(data, requires_grad=False)
        param.weight_loader = functools.partial(self._load, layer, spec)
        param.raw_checkpoint_tensor = True  # an fp8 weight must not be cast; scales are expanded first
        param.optional_in_checkpoint = spec.optional
        param.loaded = False
        layer.register_parameter(spec.name, param)

    def _local_groups(self, layer: torch.nn.Module, in_features: int) -> int:
        """Weight-scale groups per row in this rank's slice of the inputs."""
        if self.scheme.block is None:
            return 1
        bk, tp = self.scheme.block[1], layer.tp_size if isinstance(layer, RowParallelLinear) else 1
        if (in_features * tp) % bk:
            raise ValueError(f"quantization_config block size {list(self.scheme.block)}: a layer's {in_features * tp} "
                             f"inputs are not whole blocks of {bk} (partial blocks are not supported)")
        if in_features % bk:
            raise ValueError(f"quantization_config block size {list(self.scheme.block)}: tensor_parallel_size={tp} "
                             f"splits a row-parallel layer's inputs into {in_features} per rank, not whole blocks of "
                             f"{bk}; use a tensor_parallel_size that keeps whole blocks")
        return in_features // bk

    # --- loading -------------------------------------------------------------------------------

    def _load(self, layer: torch.nn.Module, spec: CheckpointTensor, param: torch.nn.Parameter,
              loaded: torch.Tensor, shard_id=None) -> None:
        if spec.kind == "input_scale":  # fused projections share one input: the largest scale
            value = loaded.float().reshape(-1)[:1]
            param.data.copy_(torch.maximum(param.data, value) if param.loaded else value)
        elif spec.kind == "codes":
            if loaded.dtype != torch.float8_e4m3fn:
                raise ValueError(f"checkpoint tensor 'weight' has dtype {loaded.dtype}; an fp8 checkpoint's weights "
                                 "must be float8_e4m3fn")
            shard_into(layer, param, loaded, shard_id, spec)
        else:
            shard_into(layer, param, self._scale_rows(layer, param, loaded.float()), shard_id, spec)
        param.loaded = True

    def _scale_rows(self, layer: torch.nn.Module, param: torch.nn.Parameter, scale: torch.Tensor) -> torch.Tensor:
        """The checkpoint's weight scale as one row per output row, ``[rows, groups]``. A per-tensor
        scale is the same for every row: it becomes a column tall enough for the layer's own
        loader to take any shard's rows from (``shard_into``)."""
        tall = param.shape[0] * (layer.tp_size if isinstance(layer, ColumnParallelLinear) else 1)
        if self.scheme.block is not None:
            return scale.repeat_interleave(self.scheme.block[0], dim=0)[:tall]  # [>= out, in / bk]
        if self.scheme.per_channel:
            return scale.reshape(-1, 1)  # [out, 1]
        if scale.numel() != 1:
            raise ValueError(f"checkpoint weight scale of shape {tuple(scale.shape)}: a per-tensor scale has one "
                             "element (quantization_config says per-tensor)")
        return scale.reshape(1, 1).expand(tall, 1)

    # --- after loading -------------------------------------------------------------------------

    def process_weights(self, layer: torch.nn.Module) -> None:
        scales = [getattr(layer, n) for n in self.scheme.scale_names if getattr(layer, n).loaded]
        if len(scales) != 1:
            raise ValueError(f"an fp8 layer needs exactly one of the weight scales {self.scheme.scale_names} in the "
                             f"checkpoint, found {len(scales)}")
        scale, input_scale, weight = scales[0].data, self._input_scale(layer), layer.weight.data
        for name in ("weight", *self.scheme.scale_names, *self.scheme.input_scale_names):
            if hasattr(layer, name):
                delattr(layer, name)
        install(layer, weight, scale, self.scheme.act, input_scale)

    def _input_scale(self, layer: torch.nn.Module) -> torch.Tensor | None:
        if self.scheme.act != "static":
            return None
        found = [getattr(layer, n) for n in self.scheme.input_scale_names if getattr(layer, n).loaded]
        if not found:
            raise ValueError(f"activation_scheme static needs one of {self.scheme.input_scale_names} per layer in "
                             "the checkpoint; none found")
        if not bool((found[0].data > 0).all()):
            raise ValueError(f"checkpoint input scale {found[0].data.tolist()}: a static activation scale must be > 0")
        return found[0].data.clone()


def _ct_activation_mode(act: dict | None, block: tuple[int, int] | None) -> str:
    """The activation quantization a compressed-tensors FP8 scheme asks for (ACT_MODES)."""
    if act is None:
        return "none"
    require(act.get("type") == "float" and act.get("num_bits") == 8, "input_activations.(type, num_bits)",
            (act.get("type"), act.get("num_bits")), "('float', 8)")
    require(act.get("symmetric", True), "input_activations.symmetric", act.get("symmetric"), "true")
    strategy, dynamic = act.get("strategy"), act.get("dynamic")
    if dynamic is True and strategy == "token":
        return "token"
    if dynamic is True and strategy == "group" and block is not None and act.get("group_size") == block[1]:
        return "group"
    require(dynamic is False and strategy == "tensor", "input_activations.(dynamic, strategy)", (dynamic, strategy),
            "dynamic 'token', dynamic 'group' of the weight block's input size, or static 'tensor'")
    return "static"


def install(layer: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor, act: str,
            input_scale: torch.Tensor | None) -> None:
    """Sets the runtime tensors of ``layer`` (module docstring): ``weight`` float8_e4m3fn
    ``[out, in]``, ``weight_scale`` float32 ``[out, in / group]``."""
    if act not in ACT_MODES:
        raise ValueError(f"act={act!r}; allowed: {ACT_MODES}")
    out_features, in_features = weight.shape
    groups = scale.shape[1]
    if scale.shape[0] != out_features or in_features % groups:
        raise ValueError(f"fp8 weight scale {tuple(scale.shape)} does not fit a weight {tuple(weight.shape)}")
    if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():  # the C kernel's widening has no NaN
        raise ValueError("the checkpoint's fp8 weight holds NaN (bytes 0x7f / 0xff); refusing to compute with it")
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    layer.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
    layer.register_buffer("input_scale", None if input_scale is None else input_scale.float(), persistent=False)
    layer.fp8_group, layer.fp8_act = in_features // groups, act


# --- the forward -----------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor, act: str, group: int, input_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded to e4m3 with the format's activation scale and scaled back (``act`` in
    ACT_MODES; "group": per token and group of ``group`` inputs). A zero scale becomes float32's
    eps, as compressed-tensors does, so an all-zero row stays zero."""
    if act == "none":
        return x
    if act == "static":
        return _round_fp8(x, input_scale.to(x.dtype))
    if act == "group":
        xg = x.unflatten(-1, (x.shape[-1] // group, group))  # [..., in / group, group]
        return quantize_activations(xg, "token", group, None).flatten(-2)  # [..., in]
    scale = x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return _round_fp8(x, scale.to(x.dtype))


def _round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[out, in]`` of the runtime layout, in torch (any device)."""
    group = weight.shape[1] // scale.shape[1]
    return weight.to(dtype) * scale.to(dtype).repeat_interleave(group, dim=1)


def fp8_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T + bias`` for a layer in the runtime layout (what ``LinearBase.forward`` calls)."""
    if x.device.type == "cuda" and _scaled_mm_applies(layer, x):
        return _scaled_mm_linear(layer, x)
    native = native_f32(x)
    if layer.fp8_act != "none" and native is not None:
        x = _c_quantize_activations(native, x, layer)
    else:
        x = quantize_activations(x, layer.fp8_act, layer.fp8_group, layer.input_scale)
    return fp8_matmul(x, layer.weight, layer.weight_scale, layer.bias, native)


def _c_quantize_activations(native: bindings.NativeLibrary, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``quantize_activations`` in one C pass (bit-identical; torch's seven ops per call were as
    slow as the batch-1 matmul itself)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [tokens, in]
    out = torch.empty_like(x2)
    group = layer.fp8_group if layer.fp8_act == "group" else x2.shape[1]
    static = float(layer.input_scale) if layer.fp8_act == "static" else 0.0
    native.fp8_quantize_activations(x2, group, static, out, torch.get_num_threads())
    return out.view(x.shape)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               native: bindings.NativeLibrary | None = None) -> torch.Tensor:
    """The C kernel for small float32 CPU batches, else the weight widened (in C into a reused
    buffer on the CPU, in torch elsewhere) for one GEMM; ``native``: ``native_f32(x)`` when the
    caller has it already."""
    native = native or native_f32(x)
    if native is None:
        return torch.nn.functional.linear(x, dequantize(weight, scale, x.dtype), bias)
    lead, in_features = x.shape[:-1], x.shape[-1]
    out_features, group = weight.shape[0], in_features // scale.shape[1]
    x2 = x.reshape(-1, in_features).contiguous()  # [tokens, in]
    codes = weight.view(torch.uint8)
    if 0 < x2.shape[0] <= min(C_MAX_ROWS, native.max_decode_tokens):
        y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        native.fp8_linear(x2, codes, scale, b, group, y, torch.get_num_threads())
    else:
        w = scratch_buffer(out_features * in_features).view(out_features, in_features)  # [out, in]
        native.dequantize_fp8(codes, scale, w, group, torch.get_num_threads())
        y = cpu_ops.unpacked_linear(x2, w, bias)
    return y.view(*lead, out_features)


# --- CUDA: torch._scaled_mm on GPUs with FP8 tensor cores ------------------------------------


def _scaled_mm_applies(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """sm_89+ and a layout ``_scaled_mm`` takes: one weight scale per row (row-wise scaling, which
    outputs bfloat16 only), activations per token or static, dimensions multiples of 16
    (block-wise layers, weight-only W8A16 and other shapes take the dequantize path)."""
    out_features, in_features = layer.weight.shape
    return (torch.cuda.get_device_capability(x.device) >= (8, 9) and layer.weight_scale.shape[1] == 1
            and layer.fp8_act in ("token", "static") and x.dtype == torch.bfloat16
            and out_features % 16 == 0 and in_features % 16 == 0)


def _scaled_mm_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if layer.fp8_act == "static":
        sx = layer.input_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    else:
        sx = (rows.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).eps)
    xq = (rows.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    sw = layer.weight_scale.reshape(1, -1)  # [1, out]
    y = torch._scaled_mm(xq, layer.weight.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
    if layer.bias is not None:  # added here: not every scaling mode takes a bias
        y = y + layer.bias
    return y.view(*x.shape[:-1], layer.weight.shape[0])  # [..., out]


QUANTIZED_FORWARD[torch.float8_e4m3fn] = fp8_linear
