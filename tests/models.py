"""Tiny real transformers models built from configs, for the patching and capture tests."""
import torch
from torch import nn


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


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
