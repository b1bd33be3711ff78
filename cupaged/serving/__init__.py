"""An example of cupaged in a model: a Llama decoder in PyTorch (:mod:`.llama`) and a
continuous-batching serving loop over :class:`cupaged.PagedKVCache` (:mod:`.engine`).
torch is needed here only."""
