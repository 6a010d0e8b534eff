"""Pre-training and fine-tuning data for bertfast.

  corpus        plain-text documents, and the embedded corpus (standard-library docstrings)
  tokenization  WordPiece on Hugging Face ``tokenizers`` (load a vocab.txt or train one)
  nsp           next-sentence-prediction examples, as the original BERT pipeline builds them
  masking       the 15% / 80-10-10 masked-LM corruption
  shards        memory-mapped binary shards and their index
  prepare       ``bertfast prepare``: corpus -> shards (resumable, multi-process)
  loader        deterministic, resumable, rank-aware pre-training batches
  tasks         fine-tuning readers and features (GLUE-style, CoNLL, SQuAD, SWAG)
  metrics       accuracy, F1, Matthews, Pearson/Spearman, entity F1, SQuAD EM/F1 (numpy)
  synthetic     small learnable datasets in each fine-tuning format (tests, trying things out)
  textfile      where a file stops being UTF-8 (the readers' errors name path:line)
"""
