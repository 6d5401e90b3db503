"""What the model families share: finding the shipped assets, checking a checkpoint directory, loading
one offline, the tokenizer the tiny checkpoints are built with, and the processor of text-only models."""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

MODELING_DIR = Path(importlib.import_module("pypto_gym.modeling").__file__).parent  # modeling/, installed too
CORPUS = MODELING_DIR / "tiny_qwen2_5_vl" / "corpus.txt"  # what every tiny tokenizer is trained on

# W8A8: the linears that read each decoder norm kind's output rows directly, relative to the norm's
# parent, as Qwen2/2.5/3 and Llama decoders name them. The final norm hands none over: its output leaves
# the model (last_hidden_state, hidden_states[-1]) and must be a plain tensor there, and an int8 lm_head
# (int8_lm_head=True) reads only the rows it needs, one at decode, which it quantises itself.
TEXT_LINEARS_AFTER_NORM = {
    "text.input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "text.post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
# W8A8: the decoder linear whose input no fused op produces (it quantises it itself), and where its
# SmoothQuant scale folds into a checkpoint (quant/fold.py): v_proj's output rows, per kv head.
TEXT_OWN_INPUT = {"self_attn.o_proj": ("self_attn.v_proj", "kv_heads")}
# ...and a LayerNorm vision tower's linears (Qwen2-VL's names and Qwen3-VL's), which all quantise their own input: no
# LayerNorm or GELU kernel here writes int8 rows. Each smooth scale folds into what writes its rows: the blocks' qkv
# and fc1 into norm1 / norm2 (weight and bias), attn.proj into qkv's v third, a merger's first linear into its norm
# (the main merger's rows regrouped, 4 of D as one of 4D; Qwen3-VL's DeepStack mergers' after the shuffle, as they
# are); every second MLP linear reads a GELU's output: nowhere, not smoothed. The longest suffix a path ends with
# wins (quant/topology.py): "mlp.linear_fc1" before "linear_fc1".
LAYER_NORM_VISION_OWN_INPUT = {
    "attn.qkv": ("norm1", "same"), "attn.proj": ("attn.qkv", "v_third"),
    "mlp.fc1": ("norm2", "same"), "mlp.fc2": None, "merger.mlp.0": ("merger.ln_q", "tiled"), "merger.mlp.2": None,
    "mlp.linear_fc1": ("norm2", "same"), "linear_fc1": ("norm", "tiled"), "linear_fc2": None,
}
TEXT_PROMPTS = ["Write a sentence about tensors.", "What is an RMS norm?", "Count from one to ten.",
                "Describe the weather in one line."]  # calibration prompts of the text-only families


def check_model_dir(path) -> Path:
    """Refuse a missing or incomplete checkpoint directory with a one-line message."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--model: {p} is not a directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"--model: {p} has no config.json")
    try:
        config = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model: {p / 'config.json'} is not valid JSON ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model: {p / 'config.json'} holds a JSON {type(config).__name__}; expected an object")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"--model: {p} has no *.safetensors weights")
    return p


def model_type(path) -> str:
    """config.json's model_type of a checkpoint directory (checked first)."""
    return str(json.loads((check_model_dir(path) / "config.json").read_text()).get("model_type"))


def from_pretrained(cls, path, dtype="auto", device="cpu"):
    """`cls.from_pretrained(path)` offline, in `dtype` on `device`, failures as one line naming --model."""
    import torch

    from safetensors import SafetensorError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model = cls.from_pretrained(path, dtype=torch_dtype)
    except SafetensorError as e:  # a truncated or damaged weights file: say which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model: {damaged_weights_file(path) or path}: not a readable safetensors file "
                         f"({first})") from None
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model: could not load {path}: {first}") from None
    return model.to(device).eval()


def damaged_weights_file(path) -> Path | None:
    """The first *.safetensors file of a checkpoint whose header safetensors refuses (truncated, damaged), or None."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return f
    return None


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")  # fast tokenizer, BPE vocab (+ merges), spm


def check_tokenizer_files(path) -> None:
    """Refuse a checkpoint without tokenizer files before AutoTokenizer builds an empty tokenizer from it (the prompt
    then tokenised to nothing and generate failed in a reshape or a torch.cat)."""
    p = Path(path)
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"--model: {p} has no tokenizer files; expected one of {', '.join(TOKENIZER_FILES)}")


def train_tokenizer(special_tokens: list[str], eos: str, pad: str, chat_template: str, vocab_size: int = 640):
    """A byte-level BPE trained offline on the shipped corpus (deterministic), as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    tok.add_special_tokens(special_tokens)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token=None, bos_token=None,
                                   model_max_length=32768, clean_up_tokenization_spaces=False)
    fast.chat_template = chat_template
    return fast


def save_tokenizer(tokenizer, out: Path, tokenizer_class: str) -> None:
    """Save, naming a tokenizer class both transformers 4.57 and 5.x resolve."""
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_weights(model, out: Path, skip=()) -> None:
    """The model's weights as one deterministic safetensors file (tied copies left out: `skip`)."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def randomise_norms(model) -> None:
    """Random (not ones) norm weights, so a wrong gamma shows up in tests."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_q" in name):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))


class TextProcessor:
    """The tokenizer of a text-only model with its chat template: prompts -> left-padded inputs for generate."""

    multimodal = False

    def __init__(self, path):
        from transformers import AutoTokenizer

        check_tokenizer_files(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def save_pretrained(self, out) -> None:
        """The tokenizer files (with the chat template), as this class reads them back."""
        self.tokenizer.save_pretrained(out)

    def __call__(self, prompts, images=None, model=None):
        if images is not None and any(im is not None for im in images):
            raise ValueError("--image: this is a text-only model; it takes prompts only")
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True) for p in prompts]
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def decode(self, ids):
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def build_text_tiny(out: Path, config_cls, config: dict, special_tokens: list[str], eos: str, pad: str,
                    chat_template: str, tokenizer_class: str, model_cls, seed: int = 0) -> None:
    """Write a tiny text checkpoint: tokenizer (trained on the corpus), config, generation config and random
    weights from `seed`. Running it twice gives identical files."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(special_tokens, eos, pad, chat_template)
    save_tokenizer(tokenizer, out, tokenizer_class)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special_tokens}
    cfg = config_cls(vocab_size=len(tokenizer), eos_token_id=ids[eos], pad_token_id=ids[pad], bos_token_id=ids[pad],
                     **config)
    cfg.architectures = [model_cls.__name__]  # without it vLLM takes the checkpoint for a pooling model
    cfg.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[pad], "eos_token_id": ids[eos], "pad_token_id": ids[pad], "do_sample": False},
        indent=2) + "\n")
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.bfloat16).eval()
    randomise_norms(model)
    save_weights(model, out, skip={"lm_head.weight"} if cfg.tie_word_embeddings else ())
