"""Tokenizers and datasets for the trainer.

- ``tokenizer``  the embedded byte-level tokenizer (no files, nothing downloaded)
- ``corpus``     the embedded default corpus: the Python standard library's own source files
- ``datasets``   the dataset interface the trainer reads through: GPT windows, BERT sentence pairs, and the
                 deterministic global-batch order (independent of data parallelism)
"""

from megakernels_models.data.datasets import BertDataset, GPTDataset, global_batch_indices, split_documents
from megakernels_models.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "GPTDataset", "BertDataset", "global_batch_indices", "split_documents"]
