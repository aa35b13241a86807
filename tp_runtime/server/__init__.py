"""`tp-runtime serve`: the OpenAI-compatible HTTP app (`api_server`), OpenAI's request and response
models (`protocol`) and how engine outputs become them (`openai_format`), the Prometheus metrics
(`metrics`), the process that serves and drains (`runner`) and the command line (`cli`)."""
