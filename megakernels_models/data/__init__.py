"""The data pipeline: tokenizers, preprocessing, the indexed dataset, samples, blending.

- ``tokenizer``     ``build_tokenizer("byte" | "hf:PATH" | "spm:PATH")``: one interface, nothing downloaded
- ``preprocess``    ``megakernels preprocess``: text/JSONL (.gz) files or folders -> ``PREFIX.bin`` + ``PREFIX.idx``
- ``indexed``       ``IndexedDataset``: the validated, memory-mapped reader (and the writer)
- ``corpus``        the embedded default corpus (the Python standard library), preprocessed once into a cache
- ``datasets``      GPT windows (optionally with document keys), BERT sentence pairs, splits by documents, the
                    deterministic global-batch order; the batch contract's keys
- ``chat``          ``preprocess --chat``: conversations rendered with a chat template -> tokens + assistant mask
- ``sft``           ``SFTDataset``: conversations packed whole (best-fit decreasing) or one a sample
- ``sample_index``  the cached GPT/BERT sample indices
- ``blending``      ``BlendedDataset``: several datasets in exact proportions
- ``build``         the trainer's entry point: ``validate_data_args``, ``tokenizer_for``, ``build_datasets``
"""

from megakernels_models.data.blending import BlendedDataset, parse_blend
from megakernels_models.data.datasets import BertDataset, GPTDataset, global_batch_indices, split_documents
from megakernels_models.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from megakernels_models.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "build_tokenizer",
    "DataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "GPTDataset",
    "BertDataset",
    "BlendedDataset",
    "parse_blend",
    "global_batch_indices",
    "split_documents",
]
