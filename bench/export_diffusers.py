"""Export small diffusion models (diffusers' UNet and VAE decoder, random weights from a fixed
seed, configs of the Stable Diffusion layout at small widths) with both PyTorch exporters.

    <venv with torch and diffusers>/bin/python bench/export_diffusers.py OUT_DIR

Writes OUT_DIR/diffusers_<model>_<exporter>.onnx (opset 18; TorchScript and dynamo exporters)
and OUT_DIR/diffusers_<model>_<exporter>.npz, the inputs to compare on: a latent, a timestep
of 981 (late in a 1000-step schedule) and a text context. Run by bench/bench_exporters.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel


class _Decoder(torch.nn.Module):
    def __init__(self, vae: AutoencoderKL) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent).sample


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ).eval()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
        norm_num_groups=8, sample_size=32,
    ).eval()
    rng = np.random.default_rng(0)
    unet_inputs = {
        "sample": rng.standard_normal((1, 4, 16, 16)).astype(np.float32),
        "timestep": np.array([981.0], np.float32),
        "context": rng.standard_normal((1, 7, 32)).astype(np.float32),
    }
    vae_inputs = {"latent": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)}
    models = (("unet", unet, unet_inputs, ["noise"]), ("vae_decoder", _Decoder(vae), vae_inputs, ["image"]))
    for name, module, inputs, outputs in models:
        for exporter, dynamo in (("ts", False), ("dynamo", True)):
            stem = out / f"diffusers_{name}_{exporter}"
            args = tuple(torch.from_numpy(v) for v in inputs.values())
            torch.onnx.export(
                module, args, stem.with_suffix(".onnx"), input_names=list(inputs), output_names=outputs,
                opset_version=18, dynamo=dynamo, external_data=False,
            )
            np.savez(stem.with_suffix(".npz"), **inputs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
