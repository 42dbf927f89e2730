"""Write a small, randomly initialised HuggingFace Llama (nothing downloaded) to DIR, for trying fine-tuning:

    python examples/make_small_hf_llama.py /tmp/hf-llama
    megakernels train --load-hf /tmp/hf-llama --save /tmp/tuned --steps 20 --tp 2 --nproc 2
    megakernels convert megakernels-to-hf --input /tmp/tuned --output /tmp/tuned-hf

Its vocabulary (300 ids) holds the byte tokenizer's 261, so it trains on the embedded corpus as it is. With
``--tokenizer DIR`` (a HuggingFace tokenizer directory, e.g. one from ``examples/make_chat_tokenizer.py``) the
model takes that tokenizer's vocabulary and special tokens instead, and the tokenizer's files are written beside
it, as a published checkpoint ships them (supervised fine-tuning, README).
"""

from __future__ import annotations

import argparse

import torch
import transformers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the directory to write (config.json, model.safetensors, generation_config.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", metavar="DIR", help="a tokenizer directory whose vocabulary the model takes")
    ns = p.parse_args()
    torch.manual_seed(ns.seed)
    vocab = dict(vocab_size=300, bos_token_id=256, eos_token_id=256, pad_token_id=None)
    tok = None
    if ns.tokenizer:
        tok = transformers.AutoTokenizer.from_pretrained(ns.tokenizer)
        vocab = dict(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **vocab,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(ns.out, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(ns.out)
    print(f"wrote a small Llama to {ns.out}")


if __name__ == "__main__":
    main()
