"""Write a small HuggingFace tokenizer directory with a chat template (nothing downloaded), for trying
``megakernels preprocess --chat`` and supervised fine-tuning:

    python examples/make_chat_tokenizer.py /tmp/chat-tok
    megakernels preprocess --chat examples/data/chat_small.jsonl --tokenizer /tmp/chat-tok \\
        --output /tmp/chat --seq-length 256

The tokenizer is a byte-level BPE trained on the conversations' text (``--vocab-size`` ids, default 512, with the
special tokens ``<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|> <|pad|>``);
``tokenizer_config.json`` holds a Llama 3-style template written for this project (``chat.HEADER_TEMPLATE``).
"""

from __future__ import annotations

import argparse
import os

from megakernels_models.data.chat import conversation_texts, write_small_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the directory to write (tokenizer.json, tokenizer_config.json)")
    p.add_argument(
        "--chat",
        nargs="+",
        default=[os.path.join(HERE, "data", "chat_small.jsonl")],
        metavar="FILE",
        help="chat JSONL whose text the tokenizer is trained on (default: examples/data/chat_small.jsonl)",
    )
    p.add_argument("--vocab-size", type=int, default=512)
    ns = p.parse_args()
    write_small_tokenizer(ns.out, conversation_texts(ns.chat), ns.vocab_size)
    print(f"wrote a {ns.vocab_size}-id tokenizer with a chat template to {ns.out}")


if __name__ == "__main__":
    main()
