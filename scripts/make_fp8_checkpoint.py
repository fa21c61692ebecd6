"""Writes an FP8 (``quant_method: fp8``) copy of a float checkpoint, quantized by transformers' own
FineGrainedFP8 quantizer (``Fp8Quantize``): per-tensor scales, or block-wise with ``--block``.
Every linear projection of the decoder layers is quantized; embeddings, norms and the LM head
stay as they are. For benchmarks (``benchmarks/throughput.py --model <out>``).

    python scripts/make_fp8_checkpoint.py SRC OUT [--block 128 128]
"""
from __future__ import annotations

import argparse
import json
import shutil
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(state: dict[str, torch.Tensor], block: list[int] | None) -> dict[str, torch.Tensor]:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    config = types.SimpleNamespace(weight_block_size=block, scale_fmt="float")
    quantizer = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            out.update(quantizer.convert({name: tensor.float()}))
        else:
            out[name] = tensor
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--block", type=int, nargs=2, default=None, help="weight_block_size [out, in]")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, args.out / f.name)
    for f in sorted(args.src.glob("*.safetensors")):
        save_file(quantize(load_file(str(f)), args.block), str(args.out / f.name))
    config = json.loads((args.out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": args.block}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
