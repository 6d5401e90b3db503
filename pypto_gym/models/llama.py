"""Llama (Llama 2/3 and the many models with its structure): RMSNorms, SwiGLU MLPs, RoPE, no biases.

The shipped tiny checkpoint (modeling/tiny_llama) has Llama's structure at toy size: 4 layers, hidden 128, 4 heads
and 2 KV heads, untied embeddings, a Llama-3 style chat template; random weights from a fixed seed.
"""
from .family import text_family

FAMILY = text_family(
    "llama", "LlamaForCausalLM", "LlamaConfig",
    tiny=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
              tie_word_embeddings=False),
    special_tokens=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    eos="<|eot_id|>", pad="<|begin_of_text|>", tokenizer_class="PreTrainedTokenizerFast",
    chat_template=("<|begin_of_text|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                   "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"))
