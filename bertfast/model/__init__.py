"""The model: transformers' BERT classes whose forward runs the fused ops, and what they stand on.

``modeling`` (the encoder, BertModel) and ``task_models`` (the task heads); ``config``
(BertConfig and its presets); ``model_inputs`` (the forward's argument checks); ``layout`` (the
token layout one forward runs its layers over, on bertfast.padding); ``fused_qkv`` and
``residual_linear`` (the GEMMs around the ops) and ``working_weights`` (the bf16 copies AdamW
writes for them); ``losses``; ``saving`` (checked, atomic loading and saving); ``mfu`` (the
model's FLOPs and the GPU peaks). The public names are ``bertfast``'s.
"""
