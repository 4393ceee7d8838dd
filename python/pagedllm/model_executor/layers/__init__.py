"""The building blocks of the decoder models (vLLM's model_executor/layers): parallel linear layers
and their linear methods, the vocabulary-parallel embedding and LM head, RMSNorm, rotary
embeddings and paged attention. A model file (model_executor/models/) composes them."""
