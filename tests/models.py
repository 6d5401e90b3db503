"""Tiny real transformers models built from configs, for the patching and capture tests."""
import torch
from torch import nn


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def assert_fold_scales_the_input(model, inputs, fold):
    """quant/fold.py's claim for one Fold, on the running model: scaling the source's output channel c by f_c (its
    weight and bias) scales the linear's input channel j by f[index[j]]; the source's other channels keep 1."""
    seen = []
    handle = model.get_submodule(fold.path).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    f = torch.ones(fold.width)
    f[fold.index] = torch.rand(fold.width, generator=torch.Generator().manual_seed(0))[fold.index] + 0.5
    params = [fold.source.weight] + ([fold.source.bias] if getattr(fold.source, "bias", None) is not None else [])
    saved = [p.detach().clone() for p in params]
    try:
        logits(model, inputs)
        with torch.no_grad():
            for p in params:
                p.mul_(f.view(-1, *[1] * (p.dim() - 1)))
        logits(model, inputs)
    finally:
        handle.remove()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    torch.testing.assert_close(seen[1], seen[0] * f[fold.index], rtol=1e-4, atol=1e-5, msg=fold.path)


def tiny_qwen2_vl():
    """Qwen2-VL: RMSNorm in the text model, LayerNorm (not RMSNorm) in the vision tower."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def tiny_qwen3_vl():
    """Qwen3-VL: LayerNorms with a bias and a GELU MLP in the vision tower, DeepStack mergers feeding the first
    decoder layers, interleaved MRoPE (sections [2, 3, 3] of a head_dim of 16), Qwen3's q/k norms."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    randomise_norm_weights(model)
    return model


def qwen3_vl_inputs(model, grids=((1, 4, 6),), seed=1) -> dict:
    """A prompt around one image per grid (t, h, w in patches), as the processor lays it out: each image's merged
    tokens between vision_start and vision_end, its patch rows in pixel_values."""
    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size ** 2
    width = cfg.vision_config.in_channels * cfg.vision_config.temporal_patch_size * cfg.vision_config.patch_size ** 2
    ids, rows = [1, 2], 0
    for t, h, w in grids:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // merge) + [cfg.vision_end_token_id]
        rows += t * h * w
    ids = torch.tensor([ids + [5, 6, 7]])
    pixels = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                  image_grid_thw=torch.tensor([list(g) for g in grids]))
    import inspect

    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers 5.x asks for it
        inputs["mm_token_type_ids"] = (ids == cfg.image_token_id).long()
    return inputs


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    randomise_norm_weights(model)
    return model


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    randomise_norm_weights(model)
    return model


def randomise_norm_weights(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


class GutenOcr3BVLRMSNorm(nn.Module):
    """A remote-code copy of Qwen2.5-VL's RMSNorm under another name (as GutenOCR-3B ships)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class OnePlusWeightRMSNorm(GutenOcr3BVLRMSNorm):
    """Gemma's math: x / rms * (1 + weight). Same attributes, different formula."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)
