"""Generate a tiny Hugging Face causal LM offline, deterministic by seed.

The model is a Llama-architecture transformer of about 95k parameters with a byte-level tokenizer
(256 byte symbols, no merges, three special tokens). Transformers and SGLang both load the
directory with no hub access. Tests, benchmarks and the quickstart use it. One generator per family
the trainer supports (ARCHS): qwen2 adds q/k/v biases; qwen3 adds per-head q/k RMSNorm and a head_dim
other than hidden_size / heads, as the real Qwen3 models have.

    python -m rlfleet.trainer.tiny OUT_DIR [--seed 0] [--arch llama|qwen2|qwen3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3")
VOCAB_SIZE = 320  # 256 bytes + specials, rounded up so embeddings stay aligned
SPECIAL_TOKENS = ("<|endoftext|>", "<|bos|>", "<|pad|>")
MODEL_SETTINGS = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def build_tokenizer():
    """A byte-level tokenizer: every byte is one token, so any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        bos_token="<|bos|>",
        pad_token="<|pad|>",
        unk_token=None,
    )


def build_config(arch: str = "llama"):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    tokenizer_ids = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
    common: dict[str, Any] = dict(
        MODEL_SETTINGS,
        eos_token_id=tokenizer_ids["<|endoftext|>"],
        bos_token_id=tokenizer_ids["<|bos|>"],
        pad_token_id=tokenizer_ids["<|pad|>"],
        torch_dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, attention_bias=False, use_sliding_window=False, **common)
    raise ValueError(f"unknown architecture {arch!r}: expected one of {ARCHS}")


def write_tiny_model(out_dir: str | os.PathLike, seed: int = 0, arch: str = "llama") -> Path:
    """Write the model, config and tokenizer to out_dir and return its path."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = build_config(arch)
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    # save_pretrained writes safetensors with mode 0600; engines in other containers must read it.
    for path in out.iterdir():
        path.chmod(0o644)
    (out / "rlfleet-tiny.json").write_text(json.dumps({"seed": seed, "arch": arch}) + "\n")
    return out


def ensure_tiny_model(out_dir: str | os.PathLike, seed: int = 0, arch: str = "llama") -> Path:
    """Write the model unless out_dir already holds the same seed and architecture.

    Written beside out_dir and renamed into place, so processes that ask for the same model at once
    (test workers) never read half of one."""
    out = Path(out_dir)
    if _holds(out, seed, arch):
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_tiny_model(tmp, seed=seed, arch=arch)
        if out.exists() and not _holds(out, seed, arch):
            shutil.rmtree(out, ignore_errors=True)  # another seed or architecture, or a write cut short
        try:
            os.rename(tmp, out)
        except OSError:
            if not _holds(out, seed, arch):  # anything but another process having written the same
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _holds(directory: Path, seed: int, arch: str) -> bool:
    marker = directory / "rlfleet-tiny.json"
    try:
        return bool(json.loads(marker.read_text()) == {"seed": seed, "arch": arch})
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--if-missing", action="store_true", help="keep an existing model of the same seed")
    args = parser.parse_args(argv)
    write = ensure_tiny_model if args.if_missing else write_tiny_model
    path = write(args.out_dir, seed=args.seed, arch=args.arch)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
