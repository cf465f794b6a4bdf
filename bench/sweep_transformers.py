"""Sweep: Hugging Face `transformers` architectures built from tiny configs, exported to ONNX
and converted with mixprec, then checked independently of mixprec's own validation.

Every model is built from a small config with a fixed seed (no downloads), exported with
``torch.onnx.export`` twice (``dynamo=True`` at the exporter's default opset, and
``dynamo=False`` TorchScript at opset 17), and each export is converted to

* float16 with the default runtime profile (``ort-cuda``),
* float16 with ``runtime="ort-cpu"``,
* bfloat16 with the default runtime profile.

Each converted model is then checked: ``onnx.checker.check_model(full_check=True)``, an
onnxruntime CPU session with default options, and a run on 3 random batches (token ids in
range with a padded row, images ~N(0,1), audio ~0.1*N(0,1), log-mel spectrograms ~N(0,0.5),
seasonal time series around levels of 500 to 5000) compared with the FP32 ONNX model
(cosine per output, max |err| / max |ref|, new NaN/Inf). A bfloat16 model that onnxruntime's
CPU provider cannot load is compared through mixprec's emulation model
(`mixprec.validate.emulate.emulate_low_precision`: FP32 compute, bf16 rounding), marked
``emul``.

Each model runs in its own child process (a crash is recorded, not fatal).

    python bench/sweep_transformers.py                       # everything -> bench/out/sweep/results.json
    python bench/sweep_transformers.py --only gpt2 llama     # some models
    python bench/sweep_transformers.py --only gpt2 --exporter dynamo --target float16 --runtime default
    python bench/sweep_transformers.py --stress --out bench/out/sweep-stress   # outlier activations
    python bench/sweep_transformers.py --list

Exported FP32 models stay in ``<out>/models/<name>_<exporter>.onnx`` and converted ones in
``<out>/conv/``, for reproductions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

SEQ = 8
BATCH = 2
VOCAB = 256
IMG = 32
SERIES_LEN, SERIES_CHANNELS = 64, 3  # time series: context length and channels
SPEC_FRAMES, SPEC_BINS = 32, 16  # spectrogram transformers: frames and mel bins

VARIANTS = [  # (target, runtime, calibrate on data) ; runtime None = mixprec's default profile
    ("float16", None, False),
    ("float16", "ort-cpu", False),
    ("bfloat16", None, False),
]
# --stress: text models get outlier channels in their token embeddings (+-2000, as the massive
# activations of trained LLMs), converted without and with calibration data.
STRESS_VARIANTS = [
    ("float16", None, False),
    ("float16", None, True),
    ("bfloat16", None, False),
]
STRESS_KINDS = ("text", "encdec", "ids", "clip")


# ---------------------------------------------------------------------------------------------
# Model specs
# ---------------------------------------------------------------------------------------------

def _text(t, cls_name, cfg_name, kind="text", **cfg):
    def build():
        config = getattr(t, cfg_name)(**cfg)
        return getattr(t, cls_name)(config), config
    return build, kind


def specs():
    """name -> (family, builder() -> (model, config), input kind). Imports transformers lazily."""
    import transformers as t

    L = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    dec = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, use_cache=False)
    # BART-style encoder-decoders (BART, Marian, Pegasus, M2M100, Whisper, Speech2Text)
    ed = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
              decoder_ffn_dim=64, use_cache=False)
    # The text and vision towers of the CLIP-style models (CLIP, SigLIP, OWL-ViT).
    towers = (
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64),
        dict(image_size=IMG, patch_size=8, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4),
    )
    out = {
        # encoders
        "bert": ("encoder", *_text(t, "BertModel", "BertConfig", vocab_size=VOCAB, hidden_size=32,
                                   max_position_embeddings=64, **L)),
        "roberta": ("encoder", *_text(t, "RobertaModel", "RobertaConfig", vocab_size=VOCAB,
                                      hidden_size=32, max_position_embeddings=72, **L)),
        "distilbert": ("encoder", *_text(t, "DistilBertModel", "DistilBertConfig", vocab_size=VOCAB,
                                         dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                         max_position_embeddings=64)),
        "albert": ("encoder", *_text(t, "AlbertModel", "AlbertConfig", vocab_size=VOCAB,
                                     embedding_size=16, hidden_size=32,
                                     max_position_embeddings=64, **L)),
        "deberta_v2": ("encoder", *_text(t, "DebertaV2Model", "DebertaV2Config", vocab_size=VOCAB,
                                         hidden_size=32, max_position_embeddings=64,
                                         relative_attention=True, position_buckets=16,
                                         pos_att_type=["p2c", "c2p"], **L)),
        "electra": ("encoder", *_text(t, "ElectraForPreTraining", "ElectraConfig", vocab_size=VOCAB,
                                      embedding_size=16, hidden_size=32,
                                      max_position_embeddings=64, **L)),
        "xlm_roberta": ("encoder", *_text(t, "XLMRobertaForMaskedLM", "XLMRobertaConfig",
                                          vocab_size=VOCAB, hidden_size=32,
                                          max_position_embeddings=72, **L)),
        # decoders
        "gpt2": ("decoder", *_text(t, "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB,
                                   n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                   use_cache=False)),
        "gpt_neo": ("decoder", *_text(t, "GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=VOCAB,
                                      max_position_embeddings=64, hidden_size=32, num_layers=2,
                                      num_heads=4, attention_types=[[["global", "local"], 1]],
                                      window_size=4, intermediate_size=64, use_cache=False)),
        "gpt_j": ("decoder", *_text(t, "GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB,
                                    n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                    use_cache=False)),
        "opt": ("decoder", *_text(t, "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB,
                                  hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                  num_attention_heads=4, max_position_embeddings=64,
                                  word_embed_proj_dim=32, use_cache=False)),
        "bloom": ("decoder", *_text(t, "BloomForCausalLM", "BloomConfig", vocab_size=VOCAB,
                                    hidden_size=32, n_layer=2, n_head=4, use_cache=False)),
        "llama": ("decoder", *_text(t, "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2,
                                    **dec)),
        "mistral": ("decoder", *_text(t, "MistralForCausalLM", "MistralConfig",
                                      num_key_value_heads=2, sliding_window=4, **dec)),
        "qwen2": ("decoder", *_text(t, "Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2,
                                    **dec)),
        "qwen3": ("decoder", *_text(t, "Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2,
                                    head_dim=8, **dec)),
        "phi": ("decoder", *_text(t, "PhiForCausalLM", "PhiConfig", partial_rotary_factor=0.5,
                                  **dec)),
        "gemma": ("decoder", *_text(t, "GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1,
                                    head_dim=8, **dec)),
        "gemma2": ("decoder", *_text(t, "Gemma2ForCausalLM", "Gemma2Config",
                                     num_key_value_heads=2, head_dim=8, sliding_window=4, **dec)),
        "falcon": ("decoder", *_text(t, "FalconForCausalLM", "FalconConfig", vocab_size=VOCAB,
                                     hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     multi_query=True, new_decoder_architecture=False,
                                     use_cache=False)),
        # encoder-decoders
        "t5": ("enc-dec", *_text(t, "T5ForConditionalGeneration", "T5Config", "encdec",
                                 vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_decoder_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, decoder_start_token_id=0,
                                 use_cache=False)),
        "bart": ("enc-dec", *_text(t, "BartModel", "BartConfig", "encdec", max_position_embeddings=64,
                                   **ed)),
        "marian": ("enc-dec", *_text(t, "MarianMTModel", "MarianConfig", "encdec",
                                     decoder_vocab_size=VOCAB, max_position_embeddings=64,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **ed)),
        # vision
        "vit": ("vision", *_text(t, "ViTForImageClassification", "ViTConfig", "image",
                                 image_size=IMG, patch_size=8, hidden_size=32, num_labels=10, **L)),
        "deit": ("vision", *_text(t, "DeiTModel", "DeiTConfig", "image", image_size=IMG,
                                  patch_size=8, hidden_size=32, **L)),
        "swin": ("vision", *_text(t, "SwinModel", "SwinConfig", "image", image_size=IMG,
                                  patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4)),
        "convnext": ("vision", *_text(t, "ConvNextForImageClassification", "ConvNextConfig", "image",
                                      hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                      num_labels=10)),
        "resnet": ("vision", *_text(t, "ResNetForImageClassification", "ResNetConfig", "image",
                                    embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", num_labels=10)),
        "mobilenet_v2": ("vision", *_text(t, "MobileNetV2ForImageClassification",
                                          "MobileNetV2Config", "image", image_size=IMG,
                                          depth_multiplier=0.25, num_labels=10)),
        "clip": ("multimodal", *_text(t, "CLIPModel", "CLIPConfig", "clip",
                                      text_config=dict(towers[0]), vision_config=dict(towers[1]),
                                      projection_dim=16)),
        # audio
        "wav2vec2": ("audio", *_text(t, "Wav2Vec2ForCTC", "Wav2Vec2Config", "audio", vocab_size=32,
                                     hidden_size=32, conv_dim=(16, 16), conv_stride=(5, 2),
                                     conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                     num_conv_pos_embedding_groups=4, feat_extract_norm="group",
                                     do_stable_layer_norm=False, **L)),
        "hubert": ("audio", *_text(t, "HubertModel", "HubertConfig", "audio", hidden_size=32,
                                   conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                   num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                   feat_extract_norm="layer", do_stable_layer_norm=True, **L)),
        "whisper": ("audio", *_text(t, "WhisperForConditionalGeneration", "WhisperConfig", "whisper",
                                    num_mel_bins=16, max_source_positions=16,
                                    max_target_positions=32, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, decoder_start_token_id=3, **ed)),
        # second wave: rarer patterns (FFT, scans, MoE, grouped/1-D convs, resize, LSTM, ...)
        "xlnet": ("encoder", *_text(t, "XLNetModel", "XLNetConfig", vocab_size=VOCAB, d_model=32,
                                    n_layer=2, n_head=4, d_inner=64, mem_len=None,
                                    use_mems_eval=False)),
        "funnel": ("encoder", *_text(t, "FunnelModel", "FunnelConfig", vocab_size=VOCAB,
                                     block_sizes=[1, 1], num_decoder_layers=1, d_model=32,
                                     n_head=4, d_head=8, d_inner=64)),
        "convbert": ("encoder", *_text(t, "ConvBertModel", "ConvBertConfig", vocab_size=VOCAB,
                                       hidden_size=32, embedding_size=32, head_ratio=2,
                                       conv_kernel_size=3, max_position_embeddings=64, **L)),
        "squeezebert": ("encoder", *_text(t, "SqueezeBertModel", "SqueezeBertConfig",
                                          vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                                          q_groups=2, k_groups=2, v_groups=2,
                                          post_attention_groups=1, intermediate_groups=4,
                                          output_groups=4, max_position_embeddings=64, **L)),
        "mobilebert": ("encoder", *_text(t, "MobileBertModel", "MobileBertConfig", vocab_size=VOCAB,
                                         hidden_size=32, embedding_size=16,
                                         intra_bottleneck_size=16, true_hidden_size=16,
                                         num_feedforward_networks=2, max_position_embeddings=64,
                                         **L)),
        "fnet": ("encoder", *_text(t, "FNetModel", "FNetConfig", "ids", vocab_size=VOCAB,
                                   hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                   max_position_embeddings=64,
                                   use_tpu_fourier_optimizations=False)),
        "longformer": ("encoder", *_text(t, "LongformerModel", "LongformerConfig", vocab_size=VOCAB,
                                         hidden_size=32, attention_window=[4, 4],
                                         max_position_embeddings=72, **L)),
        "modernbert": ("encoder", *_text(t, "ModernBertModel", "ModernBertConfig", vocab_size=VOCAB,
                                         hidden_size=32, max_position_embeddings=64,
                                         global_attn_every_n_layers=2, local_attention=4,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                         cls_token_id=2, sep_token_id=1, **L)),
        "esm": ("encoder", *_text(t, "EsmModel", "EsmConfig", vocab_size=VOCAB, hidden_size=32,
                                  max_position_embeddings=64, position_embedding_type="rotary",
                                  pad_token_id=1, mask_token_id=2, token_dropout=False, **L)),
        "mamba": ("decoder", *_text(t, "MambaForCausalLM", "MambaConfig", vocab_size=VOCAB,
                                    hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                    conv_kernel=4, use_cache=False)),
        "rwkv": ("decoder", *_text(t, "RwkvForCausalLM", "RwkvConfig", "ids", vocab_size=VOCAB,
                                   context_length=64, hidden_size=32, num_hidden_layers=2,
                                   attention_hidden_size=32, intermediate_size=64,
                                   use_cache=False)),
        "gpt_bigcode": ("decoder", *_text(t, "GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                                          vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                          n_head=4, multi_query=True, use_cache=False)),
        "mixtral": ("decoder", *_text(t, "MixtralForCausalLM", "MixtralConfig",
                                      num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, **dec)),
        "phi3": ("decoder", *_text(t, "Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, **dec)),
        "pegasus": ("enc-dec", *_text(t, "PegasusModel", "PegasusConfig", "encdec",
                                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=0, **ed)),
        "m2m100": ("enc-dec", *_text(t, "M2M100Model", "M2M100Config", "encdec",
                                     max_position_embeddings=64, **ed)),
        "beit": ("vision", *_text(t, "BeitModel", "BeitConfig", "image", image_size=IMG,
                                  patch_size=8, hidden_size=32, use_relative_position_bias=True,
                                  use_mask_token=False, **L)),
        "dinov2": ("vision", *_text(t, "Dinov2Model", "Dinov2Config", "image", image_size=IMG,
                                    patch_size=8, hidden_size=32, **L)),
        "segformer": ("vision", *_text(t, "SegformerForSemanticSegmentation", "SegformerConfig",
                                       "image", num_encoder_blocks=2, depths=[1, 1],
                                       sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                       patch_sizes=[7, 3], strides=[4, 2],
                                       num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                       decoder_hidden_size=32, num_labels=5)),
        "mobilevit": ("vision", *_text(t, "MobileViTForImageClassification", "MobileViTConfig",
                                       "image", image_size=IMG, patch_size=2,
                                       hidden_sizes=[32, 48, 64],
                                       neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                                       num_attention_heads=2, num_labels=10)),
        "efficientnet": ("vision", *_text(t, "EfficientNetForImageClassification",
                                          "EfficientNetConfig", "image", image_size=IMG,
                                          width_coefficient=0.25, depth_coefficient=0.25,
                                          hidden_dim=320, num_labels=10)),
        "regnet": ("vision", *_text(t, "RegNetForImageClassification", "RegNetConfig", "image",
                                    embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    groups_width=8, num_labels=10)),
        "convnextv2": ("vision", *_text(t, "ConvNextV2ForImageClassification", "ConvNextV2Config",
                                        "image", hidden_sizes=[16, 32], depths=[1, 1],
                                        num_stages=2, num_labels=10)),
        "siglip": ("multimodal", *_text(t, "SiglipModel", "SiglipConfig", "clip",
                                        text_config=dict(towers[0]), vision_config=dict(towers[1]))),
        "speech2text": ("audio", *_text(t, "Speech2TextModel", "Speech2TextConfig", "s2t",
                                        input_feat_per_channel=16, input_channels=1,
                                        num_conv_layers=2, conv_channels=32,
                                        conv_kernel_sizes=[5, 5], max_source_positions=64,
                                        max_target_positions=32, **ed)),
        "sew": ("audio", *_text(t, "SEWModel", "SEWConfig", "audio", hidden_size=32,
                                conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                squeeze_factor=2, num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=4, **L)),
        # detectors: a ViT with detection tokens, and DETR on a ResNet backbone (no timm)
        "yolos": ("vision", *_text(t, "YolosForObjectDetection", "YolosConfig", "image",
                                   image_size=[IMG, IMG], patch_size=8, hidden_size=32,
                                   num_detection_tokens=5, num_labels=5, **L)),
        "detr": ("vision", *_text(t, "DetrForObjectDetection", "DetrConfig", "image",
                                  use_timm_backbone=False, use_pretrained_backbone=False,
                                  backbone_config=dict(model_type="resnet", embedding_size=16,
                                                       hidden_sizes=[16, 32], depths=[1, 1],
                                                       out_features=["stage2"]),
                                  d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=10,
                                  num_labels=5)),
        "encodec": ("audio", *_text(t, "EncodecModel", "EncodecConfig", "codec",
                                    target_bandwidths=[1.5], sampling_rate=24000,
                                    audio_channels=1, hidden_size=32, num_filters=8,
                                    num_residual_layers=1, upsampling_ratios=[8, 5, 4, 2],
                                    codebook_size=1024, num_lstm_layers=2)),
        # third wave: time series (instance scaling of series far from 0), speech (WavLM's gated
        # relative position bias), a spectrogram transformer, depth estimation, image backbones
        # (LeViT, PVTv2, FocalNet's focal modulation) and open-vocabulary detection
        "patchtst": ("series", *_text(t, "PatchTSTForPrediction", "PatchTSTConfig", "series",
                                      num_input_channels=SERIES_CHANNELS, context_length=SERIES_LEN,
                                      patch_length=8, patch_stride=8, prediction_length=16,
                                      d_model=32, num_attention_heads=4, num_hidden_layers=2,
                                      ffn_dim=64, scaling="std")),
        "patchtsmixer": ("series", *_text(t, "PatchTSMixerForPrediction", "PatchTSMixerConfig",
                                          "series", num_input_channels=SERIES_CHANNELS,
                                          context_length=SERIES_LEN, patch_length=8, patch_stride=8,
                                          prediction_length=16, d_model=32, num_layers=2,
                                          scaling="std")),
        "wavlm": ("audio", *_text(t, "WavLMModel", "WavLMConfig", "audio", hidden_size=32,
                                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                  num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                  num_buckets=32, max_bucket_distance=64, **L)),
        "data2vec_audio": ("audio", *_text(t, "Data2VecAudioModel", "Data2VecAudioConfig", "audio",
                                           hidden_size=32, conv_dim=(16, 16), conv_stride=(5, 2),
                                           conv_kernel=(10, 3), num_conv_pos_embeddings=5,
                                           num_conv_pos_embedding_groups=4, **L)),
        "ast": ("audio", *_text(t, "ASTForAudioClassification", "ASTConfig", "spectrogram",
                                hidden_size=32, patch_size=8, frequency_stride=8, time_stride=8,
                                max_length=SPEC_FRAMES, num_mel_bins=SPEC_BINS, num_labels=10, **L)),
        "dpt": ("vision", *_text(t, "DPTForDepthEstimation", "DPTConfig", "image", image_size=IMG,
                                 patch_size=8, hidden_size=32, num_hidden_layers=4,
                                 num_attention_heads=4, intermediate_size=64,
                                 backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 16, 32],
                                 fusion_hidden_size=16, head_in_index=-1)),
        "glpn": ("vision", *_text(t, "GLPNForDepthEstimation", "GLPNConfig", "image",
                                  num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                  hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                  num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                  decoder_hidden_size=16)),
        "levit": ("vision", *_text(t, "LevitForImageClassification", "LevitConfig", "image",
                                   image_size=IMG, hidden_sizes=[32, 48, 64], num_attention_heads=[2, 2, 2],
                                   depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10)),
        "focalnet": ("vision", *_text(t, "FocalNetForImageClassification", "FocalNetConfig", "image",
                                      image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1],
                                      focal_levels=[2, 2], focal_windows=[3, 3], num_labels=10)),
        "pvt_v2": ("vision", *_text(t, "PvtV2ForImageClassification", "PvtV2Config", "image",
                                    num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                    hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                    num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=10)),
        "owlvit": ("multimodal", *_text(t, "OwlViTForObjectDetection", "OwlViTConfig", "clip",
                                        text_config=dict(towers[0]), vision_config=dict(towers[1]),
                                        projection_dim=32)),  # the text width: its class head needs it
        # newer decoders: QK norms, sliding windows
        "gemma3": ("decoder", *_text(t, "Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2,
                                     head_dim=8, sliding_window=4, **dec)),
        "olmo2": ("decoder", *_text(t, "Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2, **dec)),
        "starcoder2": ("decoder", *_text(t, "Starcoder2ForCausalLM", "Starcoder2Config",
                                         num_key_value_heads=2, **dec)),
        "granite": ("decoder", *_text(t, "GraniteForCausalLM", "GraniteConfig", num_key_value_heads=2, **dec)),
        # audio and vision encoders
        "wav2vec2_conformer": ("audio", *_text(t, "Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerConfig", "audio",
                                               vocab_size=32, hidden_size=32, conv_dim=(16, 16),
                                               conv_stride=(5, 2), conv_kernel=(10, 3),
                                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                               position_embeddings_type="rotary", conv_depthwise_kernel_size=7,
                                               **L)),
        "swinv2": ("vision", *_text(t, "Swinv2Model", "Swinv2Config", "image", image_size=IMG, patch_size=4,
                                    embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
        "hiera": ("vision", *_text(t, "HieraModel", "HieraConfig", "image", image_size=[IMG, IMG],
                                   patch_size=[7, 7], patch_stride=[4, 4], patch_padding=[3, 3],
                                   embed_dim=16, num_heads=[1, 2], depths=[1, 1], query_stride=[2, 2],
                                   masked_unit_size=[4, 4], embed_dim_multiplier=2.0, num_query_pool=1)),
    }
    return out


NAMES = ["bert", "roberta", "distilbert", "albert", "deberta_v2", "electra", "xlm_roberta",
         "gpt2", "gpt_neo", "gpt_j", "opt", "bloom", "llama", "mistral", "qwen2", "qwen3", "phi",
         "gemma", "gemma2", "falcon", "t5", "bart", "marian", "vit", "deit", "swin", "convnext",
         "resnet", "mobilenet_v2", "clip", "wav2vec2", "hubert", "whisper",
         "xlnet", "funnel", "convbert", "squeezebert", "mobilebert", "fnet", "longformer",
         "modernbert", "esm", "mamba", "rwkv", "gpt_bigcode", "mixtral", "phi3", "pegasus",
         "m2m100", "beit", "dinov2", "segformer", "mobilevit", "efficientnet", "regnet",
         "convnextv2", "siglip", "speech2text", "sew", "yolos", "detr", "encodec",
         "patchtst", "patchtsmixer", "wavlm", "data2vec_audio", "ast", "dpt", "glpn", "levit",
         "focalnet", "pvt_v2", "owlvit", "gemma3", "olmo2", "starcoder2", "granite",
         "wav2vec2_conformer", "swinv2", "hiera"]


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def input_names(kind):
    return {
        "text": ["input_ids", "attention_mask"],
        "encdec": ["input_ids", "attention_mask", "decoder_input_ids"],
        "image": ["pixel_values"],
        "clip": ["input_ids", "attention_mask", "pixel_values"],
        "audio": ["input_values"],
        "whisper": ["input_features", "decoder_input_ids"],
        "ids": ["input_ids"],
        "s2t": ["input_features", "attention_mask", "decoder_input_ids"],
        "codec": ["input_values"],
        "series": ["past_values"],
        "spectrogram": ["input_values"],
    }[kind]


def dynamic_axes(kind):
    """{input: {axis: name}} of the axes marked dynamic."""
    bs = {0: "batch", 1: "seq"}
    return {
        "text": {"input_ids": bs, "attention_mask": bs},
        "encdec": {"input_ids": bs, "attention_mask": bs,
                   "decoder_input_ids": {0: "batch", 1: "dec_seq"}},
        "image": {"pixel_values": {0: "batch"}},
        "clip": {"input_ids": {0: "batch"}, "attention_mask": {0: "batch"},
                 "pixel_values": {0: "batch"}},
        "audio": {"input_values": {0: "batch", 1: "samples"}},
        "whisper": {"input_features": {0: "batch"},
                    "decoder_input_ids": {0: "batch", 1: "dec_seq"}},
        "ids": {"input_ids": bs},
        "s2t": {"input_features": {0: "batch", 1: "frames"}, "attention_mask": {0: "batch", 1: "frames"},
                "decoder_input_ids": {0: "batch", 1: "dec_seq"}},
        "codec": {"input_values": {0: "batch", 2: "samples"}},
        "series": {"past_values": {0: "batch"}},
        "spectrogram": {"input_values": {0: "batch"}},
    }[kind]


def make_inputs(kind, rng, batch=BATCH, seq=SEQ, pad=False, config=None):
    """Realistic random inputs (numpy). `pad`: the last row's last 3 positions are masked."""
    import numpy as np

    def ids(n):
        return rng.integers(3, VOCAB, size=(batch, n), dtype=np.int64)

    def mask(n):
        m = np.ones((batch, n), dtype=np.int64)
        if pad and batch > 1:
            m[-1, n - 3:] = 0
        return m

    if kind == "text":
        return {"input_ids": ids(seq), "attention_mask": mask(seq)}
    if kind == "encdec":
        return {"input_ids": ids(seq), "attention_mask": mask(seq),
                "decoder_input_ids": ids(max(seq // 2, 2))}
    if kind == "image":
        return {"pixel_values": rng.standard_normal((batch, 3, IMG, IMG)).astype(np.float32)}
    if kind == "clip":
        return {"input_ids": ids(SEQ), "attention_mask": mask(SEQ),
                "pixel_values": rng.standard_normal((batch, 3, IMG, IMG)).astype(np.float32)}
    if kind == "audio":
        n = 400 + 80 * seq  # 1040 samples at seq=8
        return {"input_values": (0.1 * rng.standard_normal((batch, n))).astype(np.float32)}
    if kind == "whisper":
        return {"input_features": (0.5 * rng.standard_normal((batch, 16, 32))).astype(np.float32),
                "decoder_input_ids": ids(max(seq // 2, 2))}
    if kind == "ids":
        return {"input_ids": ids(seq)}
    if kind == "s2t":
        n = 4 * seq
        return {"input_features": rng.standard_normal((batch, n, 16)).astype(np.float32),
                "attention_mask": mask(n), "decoder_input_ids": ids(max(seq // 2, 2))}
    if kind == "codec":
        n = 80 * seq
        return {"input_values": (0.1 * rng.standard_normal((batch, 1, n))).astype(np.float32)}
    if kind == "series":
        # Seasonal series around a level far from 0 (loads, prices, sales): level and spread
        # differ per series, as instance scaling expects.
        t = np.arange(SERIES_LEN)[None, :, None]
        level = rng.uniform(500, 5000, (batch, 1, SERIES_CHANNELS))
        spread = level * rng.uniform(0.05, 0.2, (batch, 1, SERIES_CHANNELS))
        phase = rng.uniform(0, 2 * np.pi, (batch, 1, SERIES_CHANNELS))
        noise = 0.2 * rng.standard_normal((batch, SERIES_LEN, SERIES_CHANNELS))
        return {"past_values": (level + spread * (np.sin(t / 4 + phase) + noise)).astype(np.float32)}
    if kind == "spectrogram":
        # Log-mel features as AST's extractor normalizes them (about N(0, 0.5)).
        return {"input_values": (0.5 * rng.standard_normal((batch, SPEC_FRAMES, SPEC_BINS))).astype(np.float32)}
    raise ValueError(kind)


def test_batches(kind, rng):
    """Three batches: export shape with padding, another batch/seq, export shape plain."""
    return [make_inputs(kind, rng, BATCH, SEQ, pad=True),
            make_inputs(kind, rng, 3, SEQ + 4),
            make_inputs(kind, rng, 1, SEQ)]


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def _flatten(x, out):
    import torch

    if x is None:
        return out
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif hasattr(x, "to_tuple"):
        _flatten(x.to_tuple(), out)
    elif isinstance(x, dict):
        for v in x.values():
            _flatten(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _flatten(v, out)
    return out


def make_wrapper(model, names):
    """An nn.Module whose forward takes `names` positionally and returns a flat tuple."""
    import torch

    ns = {"_flatten": _flatten}
    src = (f"def forward(self, {', '.join(names)}):\n"
           f"    return tuple(_flatten(self.m({', '.join(f'{n}={n}' for n in names)}, "
           f"return_dict=False, **self.kw), []))\n")
    exec(src, ns)  # noqa: S102

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model
            self.kw = {}

    Wrapper.forward = ns["forward"]
    return Wrapper()


def export(wrapper, kind, inputs, path, exporter):
    """Export; returns a note on what was done (dynamic or static shapes)."""
    import torch

    names = input_names(kind)
    args = tuple(torch.from_numpy(inputs[n]) for n in names)
    axes = dynamic_axes(kind)
    if exporter == "dynamo":
        auto = torch.export.Dim.AUTO
        dyn = {n: {a: auto for a in axes.get(n, {})} for n in names}
        try:
            torch.onnx.export(wrapper, args, str(path), dynamo=True, input_names=names,
                              dynamic_shapes=dyn, verbose=False)
            return "dynamic"
        except Exception as exc:  # noqa: BLE001
            first = _first_line(exc)
            torch.onnx.export(wrapper, args, str(path), dynamo=True, input_names=names,
                              verbose=False)
            return f"static (dynamic failed: {first[:80]})"
    torch.onnx.export(wrapper, args, str(path), dynamo=False, opset_version=17,
                      input_names=names, dynamic_axes=axes)
    return "dynamic"


def calibrate_batchnorm(wrapper, kind):
    """Give BatchNorm layers the running statistics of a trained model (random init with unit
    running stats makes deep CNNs such as MobileNetV2 collapse to ~1e-27 outputs): cumulative
    statistics over a few training-mode passes on random inputs, then eval."""
    import numpy as np
    import torch

    bns = [m for m in wrapper.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return ""
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    rng = np.random.default_rng(123)
    wrapper.train()
    with torch.no_grad():
        for _ in range(4):
            b = make_inputs(kind, rng, 4, SEQ)
            wrapper(*[torch.from_numpy(b[n]) for n in input_names(kind)])
    wrapper.eval()
    return f"{len(bns)} BatchNorm layers given running statistics from 4 random batches"


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def _first_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()  # default options (graph optimizations on)
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def probe_load(path):
    """'' when a child process survives creating the default CPU session (load errors included:
    they are recorded in-process), else what killed it (onnxruntime can segfault on a model)."""
    code = ("import onnxruntime as ort, sys\n"
            "try:\n    ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
            "except Exception:\n    pass\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=300)
    if proc.returncode == 0:
        return ""
    return f"onnxruntime crashed creating the session (rc={proc.returncode})"


def _feed(sess, batch):
    import numpy as np

    feed = {}
    types = {i.name: i.type for i in sess.get_inputs()}
    for name, arr in batch.items():
        if name not in types:
            continue
        if types[name] == "tensor(float16)":
            arr = arr.astype(np.float16)
        feed[name] = arr
    return feed


def compare(ref_outs, outs, names):
    """Per-output cosine, scaled max error, new non-finite counts."""
    import numpy as np

    rows = []
    for name, r, c in zip(names, ref_outs, outs):
        r = np.asarray(r)
        c = np.asarray(c)
        if not np.issubdtype(r.dtype, np.floating):
            rows.append({"name": name, "exact": bool(np.array_equal(r, c))})
            continue
        r64 = r.astype(np.float64)
        c64 = c.astype(np.float64)
        ref_bad = ~np.isfinite(r64)
        new_bad = int(np.sum(~np.isfinite(c64) & ~ref_bad))
        ok = np.isfinite(r64) & np.isfinite(c64)
        rv, cv = r64[ok], c64[ok]
        denom = np.linalg.norm(rv) * np.linalg.norm(cv)
        if rv.size == 0:
            cos = float("nan")
        elif denom == 0:  # one side all zeros: equal only when both are
            cos = 1.0 if not np.any(rv) and not np.any(cv) else 0.0
        else:
            cos = float(np.dot(rv, cv) / denom)
        ref_max = float(np.max(np.abs(rv))) if rv.size else 0.0
        err = float(np.max(np.abs(rv - cv))) if rv.size else 0.0
        rows.append({"name": name, "cos": cos, "rel_err": err / ref_max if ref_max else err,
                     "new_nonfinite": new_bad, "ref_nonfinite": int(ref_bad.sum())})
    return rows


def run_batches(sess, batches):
    names = [o.name for o in sess.get_outputs()]
    return names, [sess.run(None, _feed(sess, b)) for b in batches]


def summarize(per_batch):
    """Worst values over batches and outputs."""
    cos = [o["cos"] for rows in per_batch for o in rows if "cos" in o]
    rel = [o["rel_err"] for rows in per_batch for o in rows if "rel_err" in o]
    bad = sum(o.get("new_nonfinite", 0) for rows in per_batch for o in rows)
    inexact = [o["name"] for rows in per_batch for o in rows if o.get("exact") is False]
    return {"cos_min": min(cos) if cos else None, "rel_err_max": max(rel) if rel else None,
            "new_nonfinite": bad, "int_mismatch": sorted(set(inexact))}


# ---------------------------------------------------------------------------------------------
# One model (child process)
# ---------------------------------------------------------------------------------------------

def add_outliers(model):
    """Two embedding channels become +-2000 (one sign per token): what the residual stream of a
    trained LLM carries in a few channels."""
    import torch

    emb = model.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        sign = torch.where(torch.rand(emb.weight.shape[0], generator=g) < 0.5, -1.0, 1.0)
        emb.weight[:, 0] = 2000.0 * sign
        emb.weight[:, 1] = -1500.0
    return "embedding channels 0,1 set to +-2000/-1500"


def run_model(name, outdir, exporters, variants, stress=False):
    import numpy as np
    import onnx
    import torch

    import mixprec
    from mixprec.errors import RunError, ValidationFailure

    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    family, build, kind = specs()[name]
    rows = []
    base = {"model": name, "family": family}
    torch.manual_seed(0)
    try:
        model, _config = build()
        model.eval()
    except Exception as exc:  # noqa: BLE001
        return [{**base, "exporter": "-", "stage": "build", "status": f"skip: {_first_line(exc)}"}]
    if stress:
        if kind not in STRESS_KINDS:
            return [{**base, "exporter": "-", "stage": "build", "status": "skip: --stress is for text models"}]
        try:
            add_outliers(model)
        except Exception as exc:  # noqa: BLE001
            return [{**base, "exporter": "-", "stage": "build", "status": f"skip: no embeddings: {_first_line(exc)}"}]
    wrapper = make_wrapper(model, input_names(kind)).eval()
    export_inputs = make_inputs(kind, np.random.default_rng(0))
    try:
        bn_note = calibrate_batchnorm(wrapper, kind)
        with torch.no_grad():
            torch_out = [t.numpy() for t in wrapper(*[torch.from_numpy(export_inputs[n])
                                                      for n in input_names(kind)])]
    except Exception as exc:  # noqa: BLE001
        return [{**base, "exporter": "-", "stage": "build",
                 "status": f"skip: torch forward failed: {_first_line(exc)}"}]
    (outdir / "models").mkdir(parents=True, exist_ok=True)
    (outdir / "conv").mkdir(parents=True, exist_ok=True)

    for exporter in exporters:
        src = outdir / "models" / f"{name}_{exporter}.onnx"
        row0 = {**base, "exporter": exporter}
        t0 = time.time()
        try:
            with torch.no_grad():
                shapes = export(wrapper, kind, export_inputs, src, exporter)
        except Exception as exc:  # noqa: BLE001
            rows.append({**row0, "stage": "export", "status": f"skip: export failed: {_first_line(exc)}"})
            continue
        export_s = time.time() - t0
        try:
            proto = onnx.load(str(src))
            opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
            n_nodes = len(proto.graph.node)
            ref_sess = _session(str(src))
            out_names = [o.name for o in ref_sess.get_outputs()]
            onnx_out = ref_sess.run(None, _feed(ref_sess, export_inputs))
            export_check = summarize([compare(torch_out, onnx_out, out_names)])
        except Exception as exc:  # noqa: BLE001
            rows.append({**row0, "stage": "export", "status": f"skip: FP32 ONNX does not run: {_first_line(exc)}"})
            continue
        # Test batches; fall back to the export shape where the FP32 model rejects a shape.
        rng = np.random.default_rng(1)
        batches, shape_notes = [], []
        for b in test_batches(kind, rng):
            try:
                ref_sess.run(None, _feed(ref_sess, b))
                batches.append(b)
            except Exception as exc:  # noqa: BLE001
                shape_notes.append(f"shape {[v.shape for v in b.values()]} rejected by FP32 model: {_first_line(exc)[:100]}")
                batches.append(make_inputs(kind, rng, BATCH, SEQ, pad=len(batches) == 0))
        _, ref_outs = run_batches(ref_sess, batches)
        # A random init can collapse a deep CNN's activations to ~1e-30: no 16-bit model of it
        # can agree, and a comparison says nothing about the conversion.
        import numpy as _np

        degenerate = [n for n, o in zip(out_names, ref_outs[0])
                      if _np.issubdtype(_np.asarray(o).dtype, _np.floating) and _np.asarray(o).size
                      and float(_np.nanmax(_np.abs(o))) < 1e-10]
        if degenerate:
            shape_notes.append(f"degenerate FP32 outputs (max |value| < 1e-10): {degenerate}")
        rows.append({**row0, "stage": "export", "status": "ok", "opset": opset, "nodes": n_nodes,
                     "shapes": shapes, "export_s": round(export_s, 1),
                     "torch_vs_onnx_cos": export_check["cos_min"],
                     "torch_vs_onnx_rel": export_check["rel_err_max"],
                     "notes": shape_notes + ([bn_note] if bn_note else [])})

        calib_rng = np.random.default_rng(2)
        calib = [make_inputs(kind, calib_rng, BATCH, SEQ, pad=i == 0) for i in range(4)]
        for target, runtime, use_data in variants:
            row = {**row0, "stage": "convert", "target": target, "degenerate_ref": bool(degenerate),
                   "runtime": (runtime or "default") + ("+data" if use_data else ""), "src": str(src)}
            dst = outdir / "conv" / f"{name}_{exporter}_{target}_{row['runtime']}.onnx"
            if dst.exists():
                dst.unlink()
            t0 = time.time()
            result = None
            kwargs = {"target_dtype": target}
            if runtime:
                kwargs["runtime"] = runtime
            if use_data:
                kwargs["data"] = calib
            try:
                result = mixprec.convert(str(src), str(dst), **kwargs)
                row["convert"] = "ok"
            except (ValidationFailure, RunError) as exc:
                row["convert"] = f"validation: {_first_line(exc)}"
                try:  # keep the model to look at it
                    result = mixprec.convert(str(src), str(dst), validate="none", **kwargs)
                except Exception as exc2:  # noqa: BLE001
                    row["convert_retry"] = _first_line(exc2)
            except Exception as exc:  # noqa: BLE001
                row["convert"] = f"exception: {_first_line(exc)}"
                row["traceback"] = traceback.format_exc()[-3000:]
            row["convert_s"] = round(time.time() - t0, 2)
            if result is not None:
                rep = result.report
                by = rep.nodes_by_precision
                low, fp32 = by.get("low", 0), by.get("fp32", 0)
                v = rep.validation
                row.update({
                    "casts_inserted": rep.casts_inserted, "casts_runtime": rep.casts_runtime,
                    "low_nodes": low, "fp32_nodes": fp32,
                    "low_share": round(low / (low + fp32), 3) if low + fp32 else None,
                    "low_compute_share": rep.low_compute_share,
                    "fp32_by_category": rep.fp32_by_category,
                    "mx_checker": v.checker, "mx_runtime": v.runtime, "mx_numerics": v.numerics,
                    "mx_scaled_err": max((o.scaled_error or 0.0 for o in v.outputs), default=None),
                    "mx_new_nonfinite": sum(o.new_nonfinite for o in v.outputs),
                    "mx_real_scaled_err": max((o.scaled_error or 0.0 for o in v.real_outputs), default=None),
                    "mx_notes": v.notes[:6], "report_notes": rep.notes[:6],
                })
            if not dst.exists():
                rows.append(row)
                continue
            row["dst"] = str(dst)
            try:
                onnx.checker.check_model(str(dst), full_check=True)
                row["checker"] = "ok"
            except Exception as exc:  # noqa: BLE001
                row["checker"] = _first_line(exc)
            sess = None
            crash = probe_load(dst)
            if crash:
                row["ort_load"] = crash
            else:
                try:
                    sess = _session(str(dst))
                    row["ort_load"] = "ok"
                except Exception as exc:  # noqa: BLE001
                    row["ort_load"] = _first_line(exc)
            how = "real"
            if sess is None:
                if target == "bfloat16" or "NOT_IMPLEMENTED" in row["ort_load"]:
                    try:
                        from mixprec.validate.emulate import emulate_low_precision

                        sess = _session(emulate_low_precision(str(dst)).SerializeToString())
                        how = "emul"
                    except Exception as exc:  # noqa: BLE001
                        row["emulate"] = _first_line(exc)
            if sess is None:
                row["run"] = "not run"
                rows.append(row)
                continue
            try:
                names, outs = run_batches(sess, batches)
                per_batch = [compare(r, o, names) for r, o in zip(ref_outs, outs)]
                row.update(summarize(per_batch))
                row["run"] = how
                row["per_output"] = per_batch
            except Exception as exc:  # noqa: BLE001
                row["run"] = f"{how} failed: {_first_line(exc)}"
            if how == "real":
                # onnxruntime's CPU provider silently runs float16 nodes it has no kernel for in
                # FP32 (its InsertCastTransformer): also compare the rounding a true 16-bit
                # runtime would do, through mixprec's emulation model.
                try:
                    from mixprec.validate.emulate import emulate_low_precision

                    esess = _session(emulate_low_precision(str(dst)).SerializeToString())
                    names, outs = run_batches(esess, batches)
                    s2 = summarize([compare(r, o, names) for r, o in zip(ref_outs, outs)])
                    row["emul_cos_min"] = s2["cos_min"]
                    row["emul_rel_err_max"] = s2["rel_err_max"]
                    row["emul_new_nonfinite"] = s2["new_nonfinite"]
                except Exception as exc:  # noqa: BLE001
                    row["emulate"] = _first_line(exc)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Table and driver
# ---------------------------------------------------------------------------------------------

def verdict(row):
    """'' when fine, else what is wrong."""
    if row["stage"] != "convert":
        return ""
    issues = []
    if row.get("convert") != "ok":
        issues.append(row.get("convert", "?"))
    if row.get("checker") not in (None, "ok"):
        issues.append("checker")
    if row.get("ort_load") not in (None, "ok") and (
            row["target"] == "float16" or "crashed" in row["ort_load"]):
        issues.append("ort-load")
    if "failed" in str(row.get("run", "")):
        issues.append("run")
    if row.get("new_nonfinite"):
        issues.append("nan/inf")
    if row.get("int_mismatch"):
        issues.append("int-out")
    if row.get("degenerate_ref"):
        issues.append("degenerate FP32 reference (numbers not meaningful)")
        return "; ".join(issues)
    cos = row.get("cos_min")
    limit = 0.99 if row["target"] == "float16" else 0.95
    if cos is not None and cos < limit:
        issues.append(f"cos<{limit}")
    ecos = row.get("emul_cos_min")
    if ecos is not None and ecos < limit:
        issues.append(f"emul cos<{limit}")
    if row.get("emul_new_nonfinite"):
        issues.append("emul nan/inf")
    if "emulate" in row:
        issues.append("emulation failed")
    return "; ".join(issues)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows):
    head = (f"{'model':13} {'exp':6} {'target':8} {'runtime':8} {'convert':10} {'chk':4} "
            f"{'ort':4} {'run':5} {'cos_min':>9} {'relerr':>8} {'nan':>4} {'casts':>5} "
            f"{'low%':>5} {'mx_err':>8} {'emul_cos':>9}  issues")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["stage"] != "convert":
            if r["status"] != "ok":
                lines.append(f"{r['model']:13} {r['exporter']:6} {r['status'][:110]}")
            continue
        conv = "ok" if r.get("convert") == "ok" else r.get("convert", "?").split(":")[0]
        lines.append(
            f"{r['model']:13} {r['exporter']:6} {r['target']:8} {r['runtime']:8} {conv:10} "
            f"{'ok' if r.get('checker') == 'ok' else ('-' if 'checker' not in r else 'FAIL'):4} "
            f"{'ok' if r.get('ort_load') == 'ok' else ('-' if 'ort_load' not in r else 'FAIL'):4} "
            f"{str(r.get('run', '-'))[:5]:5} {_fmt(r.get('cos_min'), '.6f'):>9} "
            f"{_fmt(r.get('rel_err_max'), '.2e'):>8} {r.get('new_nonfinite', '-')!s:>4} "
            f"{r.get('casts_inserted', '-')!s:>5} "
            f"{_fmt(None if r.get('low_share') is None else 100 * r['low_share'], '.0f'):>5} "
            f"{_fmt(r.get('mx_scaled_err'), '.2e'):>8} {_fmt(r.get('emul_cos_min'), '.6f'):>9}  "
            f"{verdict(r)}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    ap.add_argument("--exporter", choices=["dynamo", "ts", "both"], default="both")
    ap.add_argument("--target", choices=["float16", "bfloat16"], default=None)
    ap.add_argument("--runtime", default=None, help="'default' or a profile (ort-cpu, ...)")
    ap.add_argument("--out", default="bench/out/sweep")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per model")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--stress", action="store_true",
                    help="outlier embedding channels; variants without and with calibration data")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    outdir = Path(args.out)
    exporters = ["dynamo", "ts"] if args.exporter == "both" else [args.exporter]
    variants = [(t, r, d) for t, r, d in (STRESS_VARIANTS if args.stress else VARIANTS)
                if (args.target is None or t == args.target)
                and (args.runtime is None or (r or "default") + ("+data" if d else "") == args.runtime)]
    if args.runtime not in (None, "default", "default+data") and not variants:
        variants = [(args.target or "float16", args.runtime, False)]

    if args.list:
        print("\n".join(NAMES))
        return 0
    if args.worker:
        rows = run_model(args.worker, outdir, exporters, variants, stress=args.stress)
        (outdir / "rows").mkdir(parents=True, exist_ok=True)
        (outdir / "rows" / f"{args.worker}.json").write_text(json.dumps(rows, indent=1, default=str))
        return 0

    names = args.only or NAMES
    if args.stress:
        all_specs = specs()
        names = [n for n in names if all_specs[n][2] in STRESS_KINDS]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        ap.error(f"unknown models {unknown}: see --list")
    (outdir / "rows").mkdir(parents=True, exist_ok=True)
    all_rows = []
    kept = []  # with --only, the other models' rows of an earlier run stay in results.json
    if args.only and (outdir / "results.json").exists():
        kept = [r for r in json.loads((outdir / "results.json").read_text()) if r["model"] not in names]
    t_start = time.time()
    for name in names:
        rowfile = outdir / "rows" / f"{name}.json"
        if rowfile.exists():
            rowfile.unlink()
        cmd = [sys.executable, __file__, "--worker", name, "--out", str(outdir),
               "--exporter", args.exporter]
        if args.target:
            cmd += ["--target", args.target]
        if args.runtime:
            cmd += ["--runtime", args.runtime]
        if args.stress:
            cmd += ["--stress"]
        t0 = time.time()
        env = dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:
            rc, err = "timeout", ""
        if rowfile.exists():
            rows = json.loads(rowfile.read_text())
        else:
            tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] if err else []
            rows = [{"model": name, "family": "?", "exporter": "-", "stage": "worker",
                     "status": f"worker crashed (rc={rc}): {tail[0] if tail else ''}"[:300]}]
        all_rows.extend(rows)
        if kept:
            order = {n: i for i, n in enumerate(NAMES)}
            all_rows = sorted([r for r in kept if r["model"] not in {x["model"] for x in all_rows}]
                              + all_rows, key=lambda r: order.get(r["model"], 1 << 20))
        bad = [verdict(r) for r in rows if verdict(r)]
        print(f"[{time.time() - t_start:6.0f}s] {name}: {time.time() - t0:.0f}s, "
              f"{len(rows)} rows, {len(bad)} flagged", flush=True)
        (outdir / "results.json").write_text(json.dumps(all_rows, indent=1, default=str))
    print()
    print(table(all_rows))
    (outdir / "table.txt").write_text(table(all_rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
