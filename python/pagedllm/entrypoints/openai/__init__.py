"""The OpenAI-compatible server: ``pagedllm serve`` (api_server), request/response models
(protocol), handlers (serving_completion, serving_chat), errors, and Prometheus metrics."""
