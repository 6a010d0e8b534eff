"""The encoder families the model suite's inference and embeddings cases run beside BERT: a
transformers config of a named size (``BertConfig.preset``) per family, and its bertfast encoder
class. XLM-R stands for the RoBERTa family (RoBERTa and CamemBERT run
transformers' same code, and bertfast's)."""
from __future__ import annotations

FAMILIES = ("bert", "xlm-roberta", "electra", "distilbert")
_CLASS_PREFIX = {"bert": "Bert", "xlm-roberta": "XLMRoberta", "electra": "Electra", "distilbert": "DistilBert"}


def config(preset: str, family: str = "bert", pad_token_id: int = 0, vocab_size: int = 0, max_positions: int = 0):
    """The family's transformers config at the preset's sizes. RoBERTa's positions start after
    padding_idx (here the pad id), so its table is that much longer; ELECTRA's embeddings are 128
    wide and projected to the hidden size (ELECTRA-small's); DistilBERT's activation is GELU.
    ``vocab_size`` and ``max_positions`` (the longest sequence) 0: the preset's."""
    import transformers

    from bertfast import BertConfig
    if family not in FAMILIES:
        raise ValueError(f"unknown encoder family {family!r}; expected one of {FAMILIES}")
    base = BertConfig.preset(preset)
    sizes = dict(vocab_size=vocab_size or base.vocab_size, hidden_size=base.hidden_size,
                 num_hidden_layers=base.num_hidden_layers, num_attention_heads=base.num_attention_heads,
                 intermediate_size=base.intermediate_size,
                 max_position_embeddings=max_positions or base.max_position_embeddings,
                 layer_norm_eps=base.layer_norm_eps, pad_token_id=pad_token_id)
    if family == "bert":
        return transformers.BertConfig(**sizes)
    if family == "xlm-roberta":
        sizes["max_position_embeddings"] += pad_token_id + 1
        return transformers.XLMRobertaConfig(type_vocab_size=1, **sizes)
    if family == "electra":
        return transformers.ElectraConfig(embedding_size=min(128, base.hidden_size), **sizes)
    return transformers.DistilBertConfig(
        vocab_size=sizes["vocab_size"], dim=base.hidden_size, n_layers=base.num_hidden_layers,
        n_heads=base.num_attention_heads, hidden_dim=base.intermediate_size, activation="gelu",
        max_position_embeddings=sizes["max_position_embeddings"], pad_token_id=pad_token_id)


def encoder_class(family: str) -> type:
    """bertfast's encoder class of the family (``BertModel``, ``XLMRobertaModel``, ...); transformers'
    has the same name."""
    import bertfast
    return getattr(bertfast, _CLASS_PREFIX[family] + "Model")
