"""Qwen3 (and Qwen3-VL's text model): q/k RMSNorm per head before RoPE, SwiGLU MLPs, no biases.

The shipped tiny checkpoint (modeling/tiny_qwen3) has Qwen3's structure at toy size: 4 layers, hidden 128, 4 heads of
32 and 2 KV heads, a ChatML template; random weights from a fixed seed.
"""
from .family import text_family

FAMILY = text_family(
    "qwen3", "Qwen3ForCausalLM", "Qwen3Config",
    tiny=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=True),
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    eos="<|im_end|>", pad="<|endoftext|>", tokenizer_class="Qwen2Tokenizer",
    chat_template=("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
