"""Supervised fine-tuning end to end, as the README shows it: a small random HuggingFace Llama that ships a chat
tokenizer (examples/make_chat_tokenizer.py, examples/make_small_hf_llama.py), the example conversations through
``megakernels preprocess --chat``, ``megakernels train --load-hf DIR --sft``, ``megakernels convert
megakernels-to-hf``, then transformers: the tokenizer and its chat template came along, the exported logits equal
the checkpoint's, and greedy generation stops on the tokenizer's end of turn."""

from __future__ import annotations

import os
import runpy
import sys

import torch
import transformers  # noqa: E402  (the test extra)

from megakernels_models.cli import main  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLES = os.path.join(ROOT, "examples")


def _example(script: str, *argv: str) -> None:
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    finally:
        sys.argv = saved


def test_chat_jsonl_to_an_exported_model_that_transformers_chats_with(tmp_path, capsys):
    tok, hf, data, ckpt, out = (str(tmp_path / n) for n in ("tok", "hf", "chat", "sft", "sft-hf"))
    _example("make_chat_tokenizer.py", tok)
    _example("make_small_hf_llama.py", hf, "--tokenizer", tok)
    chat_file = os.path.join(EXAMPLES, "data", "chat_small.jsonl")
    assert main(["preprocess", "--chat", chat_file, "--tokenizer", hf, "--output", data, "--seq-length", "256"]) == 0
    argv = ["train", "--load-hf", hf, "--sft", "--data", data, "--seq-length", "256", "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "4", "--steps", "8", "--lr", "3e-3", "--save", ckpt, "--eval-interval", "0"]
    assert main(argv) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    first, last = (float(x) for x in done[0].split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first
    assert main(["convert", "megakernels-to-hf", "--input", ckpt, "--output", out]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)  # the chat template travelled with the model
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is a list?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    from megakernels_models import load_pretrained
    from megakernels_models.inference.pretrained import release

    try:
        ours = load_pretrained(ckpt)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
        eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
        assert model.generation_config.eos_token_id == eot == tokenizer.eos_token_id
        theirs = model.generate(ids, max_new_tokens=40, do_sample=False)[0].tolist()
        mine = ours.generate(ids, max_new_tokens=40, eos_token_id=eot)[0].tolist()
        assert theirs == mine[: len(theirs)] and eot not in theirs[ids.shape[1] : -1]
    finally:
        release()  # the one-process world load_pretrained started (later tests make their own)
