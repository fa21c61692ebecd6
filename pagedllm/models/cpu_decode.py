"""The Llama-family decoder stack in one C call, for small float32 or bfloat16 CPU batches.

At decode batch sizes every matmul is a weight-streaming matrix-vector product that runs at
memory bandwidth in MKL and in ``native/csrc/llama_decode.c`` alike; what the C path removes is the
Python and dispatch cost of the ~25 ops per layer around them (~1.7 ms of a ~9 ms batch-1 step
on the 34M benchmark model; ``benchmarks/RESULTS.md``). Decode batches of 18-96 tokens are
compute bound: where every projection has its panel copy (float32: ``cpu_ops.pack_model``,
``csrc/dense_gemm.c``; 4/8-bit codes: ``grouped.install``, ``csrc/quant_gemm.c``) the decoder
runs them on that copy's GEMM, the module path's for those rows, and still saves the Python and
the unfused ops between them (batch 64: 1.23x on the 34M model, 1.09x on the 200M in float32
and int4). Larger batches (prefill chunks) keep the torch path, where oneDNN/MKL GEMMs win.

Used only when it computes exactly what the torch path computes: float32 weights (or int8
projection weights with per-row scales, ``quantization="int8"``, or group-wise 4/8-bit codes of
one bit width without act-order permutation: own int4, GPTQ, AWQ, compressed-tensors; or FP8
e4m3 weights with float, per-token or per-group dynamic activations, as fp8.py computes them) and KV cache
on the CPU, one tensor-parallel rank, the compiled CPU attention backend selected, and
``PAGEDLLM_FUSED_DECODE`` not ``0`` (the A/B switch for benchmarks).

bfloat16 models (every floating parameter bfloat16, projections not quantized): the projections
run on ``csrc/bf16_linear.c`` (each weight widened in registers: half of float32's bytes read),
and the activations inside the decoder are float32, not bfloat16. Why: the module path rounds
every op's output to bfloat16 (8 significant bits), which is where a bf16 model's error against
its float32 reference comes from; widening costs nothing here (the step is bound by reading the
weights), so the decoder computes what transformers computes in float32 on the same bf16 weights,
up to K/V, which a bfloat16 cache stores rounded (the bits the module path stores). Norm weights
and biases are read as float32 copies made here (they are tiny); the final hidden states leave
in float32, and the LM head takes them in float32 (``cpu_ops.linear``: logits in float32). The
module path (prefill chunks, big batches) keeps bfloat16 activations: the two paths agree on
greedy tokens up to near ties (tests/models/test_bf16_decode.py).

LoRA (``enable_lora``): the decoder reads the projections' adapter slots (``layers/lora.py``: A
and B per slot, scale folded into B) and, each step, the shared ``LoRABatch`` the runner sets (the
tokens grouped by slot); the C side adds the adapters right after each base projection with
``csrc/lora_sgmv.c``, the module path's kernel. Base-model tokens are in no segment and pay
nothing; a step without adapter tokens runs as without LoRA. Float32 slots only: other slot
dtypes leave the steps with adapter tokens to the module path.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers import cpu_ops
from pagedllm.layers.lora import LoRABatch
from pagedllm.layers.quantization import fp8, grouped
from pagedllm.native import bindings
from pagedllm.native.bindings import LAYER_ARRAY_FIELDS, LdBatch, LdModel

logger = logging.getLogger(__name__)

# up to this many tokens per step: measured against the oneDNN-packed torch path (RESULTS.md);
# capped by the library's own limit (NativeLibrary.max_decode_tokens)
DEFAULT_MAX_TOKENS = 48
# inside the decoder, attention runs on the thread team from the backend's threshold
# (CpuAttentionBackend.parallel_work: query rows x keys x head_dim) divided by this: the
# backend's bar assumes a team to wake, but here it has just run the QKV projection and still
# spins. At batch 1 on the ~200M model (context 128..256) the lower bar (1 << 16 for the
# default 1 << 19) took the step from 7.17 to 6.67 ms (int4; RESULTS.md, issue 14), the
# attention having run on one thread of two.
FUSED_WORK_DIVISOR = 8

_VP = ctypes.c_void_p


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptr_array(values: list) -> ctypes.Array:
    return (_VP * len(values))(*values)


# projection weights the decoder reads: int8 (own, per row), uint8 4/8-bit codes, FP8 e4m3 bytes
QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)
# the model dtypes (every floating parameter but quantized projections) and KV cache dtypes it takes
MODEL_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.bfloat16)
# forward_host's arrays, in _run's order, with the dtypes ld_forward reads
HOST_INPUTS = (("input_ids", np.int64), ("positions", np.int64), ("query_start_loc", np.int32),
               ("seq_lens", np.int32), ("block_tables", np.int32), ("slot_mapping", np.int64))
# LdModel.fp8_act: how an FP8 layer's activations enter its matmul (layers/quantization/fp8.py's modes)
FP8_ACT_CODES = {"none": 1, "token": 2, "group": 3}


def unsupported_reason(model, backend) -> str | None:
    """Why ``model`` (a LlamaModel) cannot take the fused path, or None if it can."""
    if not envs.PAGEDLLM_FUSED_DECODE:
        return "disabled by PAGEDLLM_FUSED_DECODE=0"
    if getattr(backend, "name", None) != "cpu":
        return f"attention backend {getattr(backend, 'name', backend)!r} is not the compiled CPU kernel"
    if model.tp.size != 1:
        return "tensor parallelism"
    for name, p in model.named_parameters():
        quantized = p.dtype in QUANTIZED_DTYPES and name.endswith("proj.weight")
        if p.device.type != "cpu" or not (p.dtype in MODEL_DTYPES or quantized) or not p.is_contiguous():
            return f"parameter {name} is not a contiguous float32 / bfloat16 (or quantized projection) CPU tensor"
    # the embedding's dtype is the model's: a bf16 one takes bf16 projections (norms and biases are read as float32)
    embed, proj = model.embed_tokens.weight.dtype, _projections(model)[0].weight.dtype
    if (embed == torch.bfloat16) != (proj == torch.bfloat16):
        return f"{proj} projections with a {embed} embedding"
    return _projection_mix_reason(model)


def _projections(model) -> list:
    return [linear for layer in model.layers for linear in _by_kind(layer).values()]


def _projection_mix_reason(model) -> str | None:
    """The C decoder takes one weight kind for all projections, and no act-order gather."""
    projections = _projections(model)
    kinds = {(p.weight.dtype, getattr(p, "quant_bits", 0)) for p in projections}
    if len(kinds) > 1:
        return f"projections mix weight kinds {sorted(str(k) for k in kinds)}"
    if any(getattr(p, "act_perm", None) is not None for p in projections):
        return "act-order (desc_act) projections gather their inputs per call"
    acts = {getattr(p, "fp8_act", None) for p in projections}
    if len(acts) > 1 or not acts <= {None, *FP8_ACT_CODES}:
        return f"FP8 activation schemes {sorted(map(str, acts))} (the decoder rounds none, per token or per group)"
    return None


def _quantized_max_tokens(model) -> int:
    """Group-wise 4/8-bit, FP8 or bfloat16 projections: the measured token count
    (grouped.C_MAX_ROWS, fp8.C_MAX_ROWS, cpu_ops.BF16_C_MAX_ROWS) past which the module path
    (one GEMM on widened weights; oneDNN's AMX GEMM for bf16) beats the one-call decoder; no
    limit otherwise."""
    first = _projections(model)[0]
    if first.weight.dtype == torch.bfloat16:
        return cpu_ops.BF16_C_MAX_ROWS
    if getattr(first, "fp8_act", None) is not None:
        return fp8.C_MAX_ROWS
    bits = getattr(first, "quant_bits", None)
    return grouped.C_MAX_ROWS[bits] if bits in grouped.C_MAX_ROWS else DEFAULT_MAX_TOKENS


def _panels(linear) -> torch.Tensor | None:
    """A projection's panel copy, or None: a float32 weight's in ``dense_gemm.c``'s layout
    (``cpu_ops.pack_model``), group-wise 4/8-bit codes' in ``quant_gemm.c``'s (``grouped.install``;
    with ``panel_scale`` / ``panel_szero``)."""
    if getattr(linear, "quant_bits", None) in grouped.BITS and getattr(linear, "act_perm", None) is None:
        return getattr(linear, "panel_codes", None)
    packed = getattr(linear, "packed_weight", None)
    return packed.panels if isinstance(packed, cpu_ops.PanelWeight) and linear.weight.dtype == torch.float32 else None


def _max_tokens(model, native) -> int:
    """The decoder's token limit: the measured one per weight kind (``_quantized_max_tokens``),
    raised to ``cpu_ops.PANEL_MAX_ROWS`` when every projection has a panel copy: the decoder then
    runs them on the module path's GEMM for those rows (float32: ``dense_gemm.c`` from
    ``cpu_ops.DECODE_PANEL_MIN_ROWS`` rows; 4/8-bit codes: ``quant_gemm.c`` past
    ``grouped.SMALL_MAX_ROWS``),
    without the module path's Python and unfused ops between them."""
    if all(_panels(p) is not None for p in _projections(model)):
        return min(cpu_ops.PANEL_MAX_ROWS, native.max_panel_decode_tokens)
    return min(native.max_decode_tokens, _quantized_max_tokens(model))


def _panel_min(model) -> int:
    """LdModel.panel_min: projections with a panel copy take its GEMM from this many tokens.
    Group-wise codes: quant_gemm.c's where the module path switches (grouped.SMALL_MAX_ROWS + 1);
    float32: dense_gemm.c's from ``cpu_ops.decode_panel_min()`` (measured at start-up, kernel_tuning.py)."""
    bits = getattr(_projections(model)[0], "quant_bits", None)
    return grouped.SMALL_MAX_ROWS[bits] + 1 if bits in grouped.SMALL_MAX_ROWS else cpu_ops.decode_panel_min()


def _lora_slots(model) -> tuple[LoRABatch | None, bool]:
    """The projections' shared ``LoRABatch`` (None without adapter slots) and whether the C decoder
    applies their adapters: float32 slots, one rank per projection kind across the layers."""
    slots = [p.lora for p in _projections(model) if getattr(p, "lora", None) is not None]
    if not slots:
        return None, False
    ranks: dict[str, set[int]] = {}
    for layer in model.layers:
        for kind, linear in _by_kind(layer).items():
            if linear.lora is not None:
                ranks.setdefault(kind, set()).add(linear.lora.a.shape[1])
    ok = all(s.a.dtype == s.b.dtype == torch.float32 and s.a.is_contiguous() and s.b.is_contiguous() for s in slots)
    return slots[0].batch, ok and all(len(r) == 1 for r in ranks.values())


def _by_kind(layer) -> dict:
    """A decoder layer's projections by LdModel's name for them."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def _group(linear) -> int:
    """A projection's group size as LdModel takes it: 4/8-bit codes' or FP8 scales' inputs per group."""
    return getattr(linear, "quant_group", 0) or getattr(linear, "fp8_group", 0)


class FusedCpuDecoder:
    """Runs a ``LlamaModel`` forward (embedding through final norm) in one ``ld_forward`` call.

    Holds raw pointers into the model's parameters (which must not be replaced afterwards) and,
    per KV-cache list it has seen, into the cache tensors; keeps the tensors referenced so the
    pointers stay valid. In a bfloat16 model the norm weights and biases are float32 copies
    taken here, so the weights must be loaded before it is built (``enable_fused_decode``).
    """

    def __init__(self, model, backend, max_tokens: int | None = None):
        self._native = bindings.library()
        self._bf16 = model.embed_tokens.weight.dtype == torch.bfloat16
        self._f32_copies: list[torch.Tensor] = []  # keeps the float32 copies of a bf16 model's small tensors alive
        limit = _max_tokens(model, self._native)
        self.max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        self.parallel_work = backend.parallel_work // FUSED_WORK_DIVISOR
        # enable_lora: the step's token -> slot mapping, and whether the adapters run in here
        self._lora_batch, self._lora_in_c = _lora_slots(model)
        self.lora_steps = 0  # steps run here with adapter tokens (tests check the path is taken)
        self._arrays = {f: _ptr_array(self._layer_ptrs(model, f)) for f in LAYER_ARRAY_FIELDS}
        self._caches_key: tuple | None = None
        self._struct = self._build_struct(model)
        self._batch = LdBatch()

    def _f32_ptr(self, t: torch.Tensor | None) -> int | None:
        """A norm weight or bias as the C side reads it: float32 (a bf16 model's: a copy)."""
        if t is None or t.dtype == torch.float32:
            return _ptr(t)
        self._f32_copies.append(t.float().contiguous())
        return self._f32_copies[-1].data_ptr()

    def _layer_ptrs(self, model, field: str) -> list[int | None]:
        def pick(layer):
            attn = layer.self_attn
            if field in ("input_norm", "post_norm"):
                return (layer.input_layernorm if field == "input_norm" else layer.post_attention_layernorm).weight
            if field in ("q_norm", "k_norm"):
                return getattr(attn, field).weight if attn.qk_norm else None
            proj, kind = field.rsplit("_", 1)
            linear = _by_kind(layer)[proj]
            if kind == "p":
                return _panels(linear)
            if kind in ("la", "lb"):
                lora = linear.lora if self._lora_in_c else None
                return None if lora is None else (lora.a if kind == "la" else lora.b)
            return {"w": linear.weight, "b": linear.bias, "s": getattr(linear, "weight_scale", None),
                    "z": getattr(linear, "weight_szero", None), "ps": getattr(linear, "panel_scale", None),
                    "pz": getattr(linear, "panel_szero", None)}[kind]
        as_f32 = not field.endswith(("_w", "_s", "_z", "_p", "_ps", "_pz", "_la", "_lb"))  # norms, biases
        return [self._f32_ptr(pick(layer)) if as_f32 else _ptr(pick(layer)) for layer in model.layers]

    def _build_struct(self, model) -> LdModel:
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        rotary = attn.rotary
        m = LdModel(
            num_layers=len(model.layers), hidden=model.embed_tokens.weight.shape[1],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=mlp.gate_up_proj.weight.shape[0] // 2,  # rows: not packed (codes pack along inputs)
            quant_bits=getattr(attn.qkv_proj, "quant_bits", 0), panel_min=_panel_min(model),
            fp8_act=FP8_ACT_CODES.get(getattr(attn.qkv_proj, "fp8_act", None), 0), bf16=int(self._bf16),
            qkv_group=_group(attn.qkv_proj), o_group=_group(attn.o_proj),
            gate_up_group=_group(mlp.gate_up_proj), down_group=_group(mlp.down_proj),
            vocab_size=model.embed_tokens.weight.shape[0], max_position=rotary.cos.shape[0],
            eps=model.norm.eps, scale=attn.scale, embed=_ptr(model.embed_tokens.weight),
            final_norm=self._f32_ptr(model.norm.weight), cos=_ptr(rotary.cos), sin=_ptr(rotary.sin),
        )  # fmt: skip
        for field, arr in self._arrays.items():
            setattr(m, field, ctypes.cast(arr, ctypes.POINTER(_VP)))
        if self._lora_in_c:  # slots [lora_slots, R, in] per projection; R uniform per kind (_lora_slots)
            for kind, linear in _by_kind(model.layers[0]).items():
                if linear.lora is not None:
                    m.lora_slots = linear.lora.a.shape[0]
                    setattr(m, f"{kind}_lora_rank", linear.lora.a.shape[1])
        self._windows = (ctypes.c_int32 * len(model.layers))(
            *[layer.self_attn.sliding_window or 0 for layer in model.layers])
        m.window = ctypes.cast(self._windows, ctypes.POINTER(ctypes.c_int32))
        return m

    def _bind_caches(self, kv_caches) -> bool:
        """Points the struct at this KV cache list; False if the cache is not a float32 or
        bfloat16 CPU one."""
        key_cache = kv_caches[0][0]
        key = (id(kv_caches), key_cache.data_ptr())
        if key == self._caches_key:
            return True
        if key_cache.dtype not in CACHE_DTYPES or key_cache.device.type != "cpu":
            return False
        if not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return False
        num_blocks, _, block_size, _ = key_cache.shape
        self._cache_refs = (kv_caches, _ptr_array([k.data_ptr() for k, _ in kv_caches]),
                            _ptr_array([v.data_ptr() for _, v in kv_caches]))
        m = self._struct
        m.key_cache = ctypes.cast(self._cache_refs[1], ctypes.POINTER(_VP))
        m.value_cache = ctypes.cast(self._cache_refs[2], ctypes.POINTER(_VP))
        m.num_blocks, m.block_size = num_blocks, block_size
        m.cache_dtype = self._native.dtype_code(key_cache.dtype)
        self._caches_key = key
        return True

    def applies(self, num_tokens: int, kv_caches) -> bool:
        lora_elsewhere = self._lora_batch is not None and self._lora_batch.active and not self._lora_in_c
        return 0 < num_tokens <= self.max_tokens and not lora_elsewhere and self._bind_caches(kv_caches)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` (float32, in a bfloat16 model too);
        the KV cache is written in place."""
        return self._run(input_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(),
                         meta.query_start_loc.to(torch.int32).contiguous(), meta.seq_lens.to(torch.int32).contiguous(),
                         meta.block_tables.to(torch.int32).contiguous(), meta.slot_mapping.to(torch.int64).contiguous())

    def forward_host(self, host: dict[str, np.ndarray]) -> torch.Tensor:
        """``__call__`` on the step's host arrays (``AttentionMetadata.host_arrays`` with
        ``input_ids``): the C call reads them in place, so a decode step builds no tensors and
        no metadata object for it (the model runner's CPU fast path)."""
        arrays = [np.ascontiguousarray(host[name], dtype=dtype) for name, dtype in HOST_INPUTS]
        return self._run(*(torch.from_numpy(a) for a in arrays))

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
             tables: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        batch = self._batch  # one struct, refilled each step
        batch.query_start_loc, batch.seq_lens, batch.block_tables = qsl.data_ptr(), seq_lens.data_ptr(), \
            tables.data_ptr()
        batch.slot_mapping, batch.positions, batch.input_ids = slots.data_ptr(), pos.data_ptr(), ids.data_ptr()
        batch.num_reqs, batch.max_blocks, batch.bt_stride = seq_lens.shape[0], tables.shape[1], tables.stride(0)
        batch.num_tokens, batch.parallel_work = ids.shape[0], self.parallel_work
        self._set_lora(batch)
        out = torch.empty(ids.shape[0], self._struct.hidden, dtype=torch.float32)
        self._native.decoder_forward(self._struct, batch, out, torch.get_num_threads())
        return out

    def _set_lora(self, batch: LdBatch) -> None:
        """The step's adapter segments, or none: the struct is reused, so a step without adapter
        tokens must clear the last one's."""
        lora = self._lora_batch
        if lora is not None and lora.active:  # applies(): only when the C side takes the adapters
            batch.lora_rows = None if lora.whole else lora.perm.data_ptr()
            batch.lora_seg_slot, batch.lora_seg_start = lora.seg_slot.data_ptr(), lora.seg_start.data_ptr()
            batch.lora_num_segs = len(lora.segments)
            self.lora_steps += 1
        else:
            batch.lora_rows, batch.lora_num_segs = None, 0
