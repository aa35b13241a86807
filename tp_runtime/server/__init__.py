"""`tp-runtime serve`: the OpenAI-compatible HTTP server (`api_server`), its request and response models
(`protocol`), its Prometheus metrics (`metrics`) and its command line (`cli`)."""
