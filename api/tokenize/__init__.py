"""Text and chat messages → token ids, per model, for the scoring API.

A ``POST /score`` request may carry ``token_ids``, a ``prompt`` (text) or ``messages``
(OpenAI chat messages: the whole conversation, rendered with the model's chat template).
Block keys are computed from token ids, so text must be tokenized exactly as the engine
does. Every tokenizer implements the :class:`~kvindex.api.tokenize.protocol.Tokenizer`
Protocol and fails only with a ``TokenizerError``; two of them tokenize:

- :mod:`~kvindex.api.tokenize.local`: ``LocalTokenizer``, a Hugging Face ``tokenizer.json``
  (the ``tokenizers`` package) plus the model's Jinja2 chat template
  (:mod:`~kvindex.api.tokenize.chat_template`), rendered like ``transformers``'
  ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``;
- :mod:`~kvindex.api.tokenize.replica`: ``ReplicaTokenizer``, the replica's own vLLM
  ``POST /tokenize`` endpoint, which guarantees the exact tokens the engine sees (its
  chat-message normalisation included).

:mod:`~kvindex.api.tokenize.cache`'s ``CachingTokenizer`` wraps either with an LRU cache
(repeated system prompts and conversations are the common case).
:mod:`~kvindex.api.tokenize.choice` assembles one from a ``TokenizerSpec``.

Special tokens follow vLLM's defaults: a prompt is encoded *with* special tokens (the
completions path), a rendered conversation *without* (its template already has them).
"""
